import pathlib, unittest
from app.db import fetch_user
from app.api import handle
import app.cli

class H(unittest.TestCase):
    def test_renamed(self):
        self.assertEqual(fetch_user(1), "ada")
        self.assertEqual(handle(2), {"user": "grace"})
        for p in pathlib.Path("app").rglob("*.py"):
            self.assertNotIn("get_user", p.read_text(), str(p))
