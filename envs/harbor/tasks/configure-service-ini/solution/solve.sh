#!/bin/bash
set -e
cd /app
mkdir -p /app/data
touch /app/data/.keep
cat > service.ini <<'EOF'
[server]
host = 127.0.0.1
port = 8080
workers = 4

[logging]
level = warning

[storage]
data_dir = /app/data
EOF
python3 service.py --check
