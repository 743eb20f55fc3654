import pathlib, unittest
import config, client, worker

class H(unittest.TestCase):
    def test_constant(self):
        self.assertEqual(config.TIMEOUT_S, 45)
        self.assertEqual(client.request_timeout(), 45)
        self.assertEqual(worker.poll_timeout(), 90)
        config.TIMEOUT_S = 10
        self.assertEqual(client.request_timeout(), 10)
        for f in ("client.py", "worker.py"):
            self.assertNotIn("30", pathlib.Path(f).read_text())
