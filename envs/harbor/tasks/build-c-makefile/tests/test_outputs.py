import sys, unittest
sys.path.append("/app")

import os, shutil, subprocess


class T(unittest.TestCase):
    def run_make(self, *args):
        return subprocess.run(["make", *args], cwd="/app", capture_output=True, text=True, timeout=60)

    def test_build_and_run(self):
        self.run_make("clean")
        self.assertFalse(os.path.exists("/app/bin/wc-lite"), "make clean must remove bin/wc-lite")
        r = self.run_make()
        self.assertEqual(r.returncode, 0, r.stderr)
        out = subprocess.run(["/app/bin/wc-lite"], input="one two  three\nfour\n", capture_output=True,
                             text=True, timeout=10)
        self.assertEqual(out.stdout, "4\n")

    def test_clean(self):
        self.run_make()
        self.run_make("clean")
        self.assertFalse(os.path.exists("/app/bin"))
        self.assertFalse([f for f in os.listdir("/app/src") if f.endswith(".o")])

if __name__ == "__main__":
    unittest.main()
