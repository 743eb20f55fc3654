import unittest
from names import join_names
from report import summary

class H(unittest.TestCase):
    def test_sep(self):
        self.assertEqual(join_names(["b", "a"]), "a, b")
        self.assertEqual(join_names(["b", "a"], sep="|"), "a|b")
        self.assertEqual(summary(["y", "x"]), "Team: x; y")
