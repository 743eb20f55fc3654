import unittest
from app import load

class H(unittest.TestCase):
    def test_settings(self):
        self.assertEqual(load(), ("demo", 8080, False))
