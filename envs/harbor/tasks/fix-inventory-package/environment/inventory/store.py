from inventory.models import Item


class Store:
    def __init__(self):
        self.items = {}

    def add(self, item: Item):
        self.items[item.sku] = item

    def remove(self, sku, n):
        item = self.items[sku]
        item.quantity -= n
        if item.quantity < 0:
            raise ValueError(f"not enough {sku}")
