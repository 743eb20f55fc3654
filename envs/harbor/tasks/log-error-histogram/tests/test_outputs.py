import sys, unittest
sys.path.append("/app")

import os, subprocess, tempfile

WANT = "2026-03-01T09 1\n2026-03-01T10 2\n2026-03-01T11 1\n"


class T(unittest.TestCase):
    def test_report_file(self):
        with open("/app/errors_by_hour.txt") as f:
            self.assertEqual(f.read(), WANT)

    def test_script_on_other_logs(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "x.log"), "w") as f:
                f.write("2026-04-02T23:00:00 ERROR a\n2026-04-02T23:10:00 ERROR b\n2026-04-02T01:00:00 ERROR c\n"
                        "2026-04-02T02:00:00 INFO d\n")
            r = subprocess.run(["sh", "/app/summary.sh", d], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.stdout, "2026-04-02T01 1\n2026-04-02T23 2\n")

if __name__ == "__main__":
    unittest.main()
