from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    price: float
    quantity: int

    def total_value(self):
        return self.price + self.quantity
