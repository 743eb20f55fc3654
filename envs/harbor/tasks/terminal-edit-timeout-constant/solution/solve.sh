#!/bin/bash
set -e
cd /app
echo 'TIMEOUT_S = 45' >> config.py && printf 'import config\n\n\ndef request_timeout():\n    return config.TIMEOUT_S\n' > client.py && printf 'import config\n\n\ndef poll_timeout():\n    return config.TIMEOUT_S * 2\n' > worker.py
