import sys, unittest
sys.path.append("/app")

import configparser, os, subprocess


class T(unittest.TestCase):
    def test_values(self):
        cp = configparser.ConfigParser()
        self.assertTrue(cp.read("/app/service.ini"))
        self.assertEqual(cp.get("server", "host"), "127.0.0.1")
        self.assertEqual(cp.getint("server", "port"), 8080)
        self.assertEqual(cp.getint("server", "workers"), 4)
        self.assertEqual(cp.get("logging", "level"), "warning")
        self.assertEqual(os.path.normpath(cp.get("storage", "data_dir")), "/app/data")
        self.assertTrue(os.path.isdir("/app/data"))

    def test_service_check(self):
        r = subprocess.run(["python3", "/app/service.py", "--check"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.stdout.strip(), "config ok", r.stderr)

if __name__ == "__main__":
    unittest.main()
