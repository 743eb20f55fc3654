import unittest
from helpers.text import shout

class H(unittest.TestCase):
    def test_more(self):
        self.assertEqual(shout(""), "!")
        self.assertEqual(shout("a b"), "A B!")
