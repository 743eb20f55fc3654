import unittest
from inventory import total_between

class T(unittest.TestCase):
    def test_inclusive(self):
        self.assertEqual(total_between([1, 2, 3, 4], 1, 2), 5)
