import unittest
from inventory import total_between

class H(unittest.TestCase):
    def test_more(self):
        self.assertEqual(total_between([1, 2, 3, 4], 0, 3), 10)
        self.assertEqual(total_between([5], 0, 0), 5)
