import unittest
from calendar_utils import is_leap

class T(unittest.TestCase):
    def test_century(self):
        self.assertFalse(is_leap(1900))
        self.assertTrue(is_leap(2000))
