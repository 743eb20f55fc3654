import sys, unittest
sys.path.append("/app")

import glob, os, subprocess


class T(unittest.TestCase):
    def test_import_from_vendor(self):
        env = {"PYTHONPATH": "/app/vendor", "PATH": "/usr/bin:/bin"}
        r = subprocess.run(["python3", "-c", "import textstats, sys; print(textstats.mean_word_length('ab abcd'));"
                            "print(textstats.__file__)"], cwd="/tmp", env=env, capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        value, path = r.stdout.split()
        self.assertEqual(value, "3.0")
        self.assertTrue(path.startswith("/app/vendor/"), path)

    def test_metadata(self):
        self.assertTrue(glob.glob("/app/vendor/textstats-0.2.0*.dist-info/METADATA"))

if __name__ == "__main__":
    unittest.main()
