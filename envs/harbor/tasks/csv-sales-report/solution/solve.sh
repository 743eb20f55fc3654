#!/bin/bash
set -e
cat > /app/report.py <<'EOF'
import csv, json, sys
from collections import defaultdict

rows = []
with open(sys.argv[1], newline="") as f:
    for r in csv.DictReader(f):
        try:
            rows.append((r["region"], r["product"], int(r["units"]), float(r["unit_price"])))
        except ValueError:
            continue
by_region, units = defaultdict(float), defaultdict(int)
for region, product, n, price in rows:
    by_region[region] += n * price
    units[product] += n
top = min(units, key=lambda p: (-units[p], p)) if units else None
out = {"total": round(sum(by_region.values()), 2), "by_region": {k: round(v, 2) for k, v in by_region.items()},
       "top_product": top}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
EOF
