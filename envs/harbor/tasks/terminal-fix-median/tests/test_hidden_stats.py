import unittest
from stats import median

class H(unittest.TestCase):
    def test_more(self):
        self.assertEqual(median([1, 2]), 1.5)
        self.assertEqual(median([5]), 5)
        self.assertEqual(median([7, 1, 5, 3, 9, 11]), 6)
