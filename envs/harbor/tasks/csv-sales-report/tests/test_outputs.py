import sys, unittest
sys.path.append("/app")

import json, subprocess, tempfile


def run(csv_path):
    with tempfile.TemporaryDirectory() as d:
        out = d + "/out.json"
        r = subprocess.run(["python3", "/app/report.py", csv_path, out], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        with open(out) as f:
            return json.load(f)


class T(unittest.TestCase):
    def test_example(self):
        self.assertEqual(run("/app/sales.csv"), {"total": 47.5, "by_region": {"north": 27.5, "south": 20.0},
                                                 "top_product": "widget"})

    def test_hidden(self):
        got = run("/tests/hidden.csv")
        self.assertEqual(got["total"], 33.33)
        self.assertEqual(got["by_region"], {"west": 33.33})
        self.assertEqual(got["top_product"], "apple")

if __name__ == "__main__":
    unittest.main()
