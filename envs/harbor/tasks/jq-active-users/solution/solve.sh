#!/bin/bash
set -e
cat > /app/active.sh <<'EOF'
jq -r '[.[] | select(.active and .age >= 18) | .name] | sort | .[]' "$1"
EOF
