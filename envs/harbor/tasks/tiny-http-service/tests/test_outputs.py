import sys, unittest
sys.path.append("/app")

import json, os, subprocess, time, urllib.error, urllib.request

PORT = 18642


def get(path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, None


class T(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        env = dict(os.environ, PORT=str(PORT))
        cls.proc = subprocess.Popen(["python3", "/app/server.py"], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        for _ in range(60):
            try:
                get("/health")
                return
            except OSError:
                time.sleep(0.05)

    @classmethod
    def tearDownClass(cls):
        cls.proc.kill()
        cls.proc.wait()

    def test_health(self):
        self.assertEqual(get("/health"), (200, {"status": "ok"}))

    def test_sum(self):
        self.assertEqual(get("/sum?a=2&b=40"), (200, {"sum": 42}))
        self.assertEqual(get("/sum?a=-5&b=3"), (200, {"sum": -2}))

    def test_errors(self):
        self.assertEqual(get("/sum?a=x&b=1"), (400, {"error": "bad request"}))
        self.assertEqual(get("/sum?a=1"), (400, {"error": "bad request"}))
        self.assertEqual(get("/nope")[0], 404)

if __name__ == "__main__":
    unittest.main()
