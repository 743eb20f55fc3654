import unittest
from pricing import final_price

class H(unittest.TestCase):
    def test_more(self):
        self.assertEqual(final_price(50, 0, 0), 50.0)
        self.assertEqual(final_price(80, 25, 5), 63.0)
