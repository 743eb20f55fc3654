import subprocess, sys, unittest
from mathutils import clamp

class H(unittest.TestCase):
    def test_clamp(self):
        self.assertEqual(clamp(15, 0, 10), 10)
        self.assertEqual(clamp(-3, 0, 10), 0)
        self.assertEqual(clamp(4, 0, 10), 4)
        out = subprocess.run([sys.executable, "main.py", "15"], capture_output=True, text=True)
        self.assertEqual(out.stdout.strip(), "10")
