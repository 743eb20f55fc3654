#!/bin/bash
set -e
cd /app
cat > stats.py <<'EOF'
def median(xs):
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2
EOF
