import unittest
from records import parse_line

class H(unittest.TestCase):
    def test_more(self):
        self.assertEqual(parse_line(" x "), ["x"])
        self.assertEqual(parse_line("1,2\n"), ["1", "2"])
