#!/bin/bash
set -e
cat > /app/settings.py <<'EOF'
import os


def load():
    mode = os.environ.get("APP_MODE", "development")
    return {"mode": mode, "data_dir": os.environ.get("APP_DATA_DIR", "/tmp/data"), "debug": mode != "production"}
EOF
