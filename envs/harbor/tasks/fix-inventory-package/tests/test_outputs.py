import sys, unittest
sys.path.append("/app")

from inventory.models import Item
from inventory.store import Store
from inventory.report import low_stock


class T(unittest.TestCase):
    def setUp(self):
        self.s = Store()
        for sku, q in [("b", 5), ("a", 1), ("c", 10), ("d", 2)]:
            self.s.add(Item(sku, 2.5, q))

    def test_value(self):
        self.assertEqual(Item("x", 2.5, 4).total_value(), 10.0)

    def test_remove(self):
        self.s.remove("b", 3)
        self.assertEqual(self.s.items["b"].quantity, 2)
        with self.assertRaises(ValueError):
            self.s.remove("a", 2)
        self.assertEqual(self.s.items["a"].quantity, 1)

    def test_low_stock(self):
        self.assertEqual(low_stock(self.s, 5), ["a", "d"])
        self.assertEqual(low_stock(self.s, 1), [])

if __name__ == "__main__":
    unittest.main()
