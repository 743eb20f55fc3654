import unittest
from helpers.text import shout

class T(unittest.TestCase):
    def test_shout(self):
        self.assertEqual(shout("hi"), "HI!")
