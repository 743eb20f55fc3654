import pathlib, unittest
import pkg

class H(unittest.TestCase):
    def test_bump(self):
        self.assertEqual(pkg.__version__, "1.5.0")
        self.assertIn("version = 1.5.0", pathlib.Path("setup.cfg").read_text())
        log = pathlib.Path("CHANGELOG.md").read_text()
        self.assertLess(log.index("## 1.5.0"), log.index("## 1.4.2"))
