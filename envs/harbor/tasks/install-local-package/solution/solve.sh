#!/bin/bash
set -e
cd /app
sed -i 's/packages=\["textstat"\]/packages=["textstats"]/' textstats/setup.py
python3 -m pip install --no-index --no-build-isolation --no-cache-dir --target /app/vendor ./textstats
