#!/bin/bash
set -e
cat > /app/summary.sh <<'EOF'
cat "$1"/*.log | awk '$2 == "ERROR" { print substr($1, 1, 13) }' | sort | uniq -c | awk '{ print $2, $1 }'
EOF
sh /app/summary.sh /app/logs > /app/errors_by_hour.txt
