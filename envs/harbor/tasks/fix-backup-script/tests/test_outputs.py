import sys, unittest
sys.path.append("/app")

import os, subprocess, tempfile


class T(unittest.TestCase):
    def test_spaces_and_new_dest(self):
        with tempfile.TemporaryDirectory() as d:
            src, dest = os.path.join(d, "my docs"), os.path.join(d, "out dir")
            os.mkdir(src)
            for name, body in [("a b.txt", "1"), ("c.txt", "2"), ("notes.md", "3"), ("xtxt", "4")]:
                with open(os.path.join(src, name), "w") as f:
                    f.write(body)
            os.mkdir(os.path.join(src, "sub.txt"))
            r = subprocess.run(["sh", "/app/backup.sh", src, dest], capture_output=True, text=True, timeout=30)
            self.assertEqual(r.stdout.strip(), "2", r.stderr)
            self.assertEqual(sorted(os.listdir(dest)), ["a b.txt.bak", "c.txt.bak"])
            with open(os.path.join(dest, "a b.txt.bak")) as f:
                self.assertEqual(f.read(), "1")

if __name__ == "__main__":
    unittest.main()
