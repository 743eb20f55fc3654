#!/bin/bash
set -e
cd /app
echo '{"name": "demo", "port": 8080, "debug": false}' > settings.json
