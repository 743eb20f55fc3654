#!/bin/bash
set -e
cat > /app/backup.sh <<'EOF'
#!/bin/sh
mkdir -p "$2"
n=0
for f in "$1"/*.txt; do
    [ -f "$f" ] || continue
    cp "$f" "$2/$(basename "$f").bak"
    n=$((n + 1))
done
echo $n
EOF
