import sys, unittest
sys.path.append("/app")

import json, subprocess, tempfile


def run(path):
    return subprocess.run(["sh", "/app/active.sh", path], capture_output=True, text=True, timeout=30).stdout


class T(unittest.TestCase):
    def test_example(self):
        self.assertEqual(run("/app/users.json"), "cal\nzoe\n")

    def test_other(self):
        users = [{"name": n, "active": a, "age": g} for n, a, g in
                 [("m", True, 99), ("b", True, 18), ("k", False, 50), ("a", True, 2)]]
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(users, f)
            f.flush()
            self.assertEqual(run(f.name), "b\nm\n")

if __name__ == "__main__":
    unittest.main()
