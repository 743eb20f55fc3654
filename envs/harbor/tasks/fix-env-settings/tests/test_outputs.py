import sys, unittest
sys.path.append("/app")

import os
import settings


class T(unittest.TestCase):
    def test_from_container_env(self):
        self.assertEqual(os.environ.get("APP_MODE"), "production")
        self.assertEqual(settings.load(), {"mode": "production", "data_dir": "/app/var", "debug": False})

    def test_defaults(self):
        saved = {k: os.environ.pop(k) for k in ("APP_MODE", "APP_DATA_DIR") if k in os.environ}
        try:
            self.assertEqual(settings.load(), {"mode": "development", "data_dir": "/tmp/data", "debug": True})
        finally:
            os.environ.update(saved)

if __name__ == "__main__":
    unittest.main()
