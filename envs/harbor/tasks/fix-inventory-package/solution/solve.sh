#!/bin/bash
set -e
cd /app
sed -i 's/return self.price + self.quantity/return self.price * self.quantity/' inventory/models.py
cat > inventory/store.py <<'EOF'
from inventory.models import Item


class Store:
    def __init__(self):
        self.items = {}

    def add(self, item: Item):
        self.items[item.sku] = item

    def remove(self, sku, n):
        item = self.items[sku]
        if item.quantity < n:
            raise ValueError(f"not enough {sku}")
        item.quantity -= n
EOF
cat > inventory/report.py <<'EOF'
def low_stock(store, threshold):
    return sorted(sku for sku, item in store.items.items() if item.quantity < threshold)
EOF
