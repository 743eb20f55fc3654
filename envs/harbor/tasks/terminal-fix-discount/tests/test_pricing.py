import unittest
from pricing import final_price

class T(unittest.TestCase):
    def test_price(self):
        self.assertEqual(final_price(100, 10, 20), 108.0)
