import unittest
from records import parse_line

class T(unittest.TestCase):
    def test_spaces(self):
        self.assertEqual(parse_line("a, b ,c"), ["a", "b", "c"])
