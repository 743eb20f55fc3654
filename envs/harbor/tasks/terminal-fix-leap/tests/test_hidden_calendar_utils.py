import unittest
from calendar_utils import is_leap

class H(unittest.TestCase):
    def test_more(self):
        self.assertTrue(is_leap(2024))
        self.assertFalse(is_leap(2023))
        self.assertFalse(is_leap(2100))
        self.assertTrue(is_leap(2400))
