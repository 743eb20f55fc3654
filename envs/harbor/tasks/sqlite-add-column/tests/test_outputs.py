import sys, unittest
sys.path.append("/app")

import sqlite3


class T(unittest.TestCase):
    def test_rows(self):
        con = sqlite3.connect("/app/app.db")
        rows = con.execute("SELECT id, name, email, domain FROM users ORDER BY id").fetchall()
        self.assertEqual(rows, [(1, "Ada", "ada@example.com", "example.com"),
                                (2, "Linus", "linus@kernel.org", "kernel.org"),
                                (3, "Grace", "grace@navy.mil", "navy.mil")])

    def test_index(self):
        con = sqlite3.connect("/app/app.db")
        idx = con.execute("SELECT name, sql FROM sqlite_master WHERE type='index' AND tbl_name='users'").fetchall()
        self.assertIn("users_email_idx", [n for n, _ in idx])
        with self.assertRaises(sqlite3.IntegrityError):
            con.execute("INSERT INTO users (name, email) VALUES ('x', 'ada@example.com')")

if __name__ == "__main__":
    unittest.main()
