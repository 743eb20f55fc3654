import unittest
from slug import slugify

class H(unittest.TestCase):
    def test_more(self):
        self.assertEqual(slugify("  RL on Slurm: 101! "), "rl-on-slurm-101")
        self.assertEqual(slugify(""), "")
