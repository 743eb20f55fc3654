"""Build the shipped terminal suite: python -m megatron_rl.envs.terminal.build_tasks (writes tasks/train.jsonl, heldout.jsonl).

Three kinds: a failing test to fix, a multi-file edit, a missing dependency (a module to create). Each task
has a hidden verifier (unittest over hidden tests plus the visible ones) and reference commands that solve it;
the suite's own tests run the reference commands and the verifier in the sandbox. Every fifth is held out.
"""
# ruff: noqa: E501  (task data tables)
from __future__ import annotations

import textwrap
from pathlib import Path

from megatron_rl.envs.base import Task
from megatron_rl.envs.tasks import write_splits

VERIFY = "python3 -m unittest discover -s . -p 'test_*.py' 2>&1"


def d(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


def fix_test(tid: str, module: str, buggy: str, visible_test: str, hidden_test: str, fix: str, what: str) -> dict:
    return dict(id=f"terminal-fix-{tid}",
                prompt=f"The test suite in this directory fails: {what} Find the bug in {module}.py and fix it so "
                       f"that `python3 -m unittest` passes. Do not change the tests.",
                files={f"{module}.py": d(buggy), f"test_{module}.py": d(visible_test)},
                verify={"command": VERIFY, "files": {f"test_{module}.py": d(visible_test),
                                                     f"test_hidden_{module}.py": d(hidden_test)}},
                reference_commands=[fix])


FIX_TASKS = [
    fix_test("median", "stats", """
        def median(xs):
            s = sorted(xs)
            return s[len(s) // 2]
        """, """
        import unittest
        from stats import median

        class T(unittest.TestCase):
            def test_odd(self):
                self.assertEqual(median([3, 1, 2]), 2)

            def test_even(self):
                self.assertEqual(median([4, 1, 3, 2]), 2.5)
        """, """
        import unittest
        from stats import median

        class H(unittest.TestCase):
            def test_more(self):
                self.assertEqual(median([1, 2]), 1.5)
                self.assertEqual(median([5]), 5)
                self.assertEqual(median([7, 1, 5, 3, 9, 11]), 6)
        """, "cat > stats.py <<'EOF'\ndef median(xs):\n    s = sorted(xs)\n    n = len(s)\n    if n % 2:\n"
             "        return s[n // 2]\n    return (s[n // 2 - 1] + s[n // 2]) / 2\nEOF", "median is wrong for even-length lists."),
    fix_test("slugify", "slug", """
        import re

        def slugify(title):
            words = re.findall(r"[A-Za-z0-9]+", title)
            return "_".join(words)
        """, """
        import unittest
        from slug import slugify

        class T(unittest.TestCase):
            def test_basic(self):
                self.assertEqual(slugify("Hello World"), "hello-world")
        """, """
        import unittest
        from slug import slugify

        class H(unittest.TestCase):
            def test_more(self):
                self.assertEqual(slugify("  RL on Slurm: 101! "), "rl-on-slurm-101")
                self.assertEqual(slugify(""), "")
        """, "sed -i 's/return \"_\".join(words)/return \"-\".join(w.lower() for w in words)/' slug.py",
        "slugs must be lower-case and joined with '-'."),
    fix_test("leap", "calendar_utils", """
        def is_leap(year):
            return year % 4 == 0
        """, """
        import unittest
        from calendar_utils import is_leap

        class T(unittest.TestCase):
            def test_century(self):
                self.assertFalse(is_leap(1900))
                self.assertTrue(is_leap(2000))
        """, """
        import unittest
        from calendar_utils import is_leap

        class H(unittest.TestCase):
            def test_more(self):
                self.assertTrue(is_leap(2024))
                self.assertFalse(is_leap(2023))
                self.assertFalse(is_leap(2100))
                self.assertTrue(is_leap(2400))
        """, "sed -i 's/return year % 4 == 0/return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)/' "
             "calendar_utils.py", "century years are handled wrongly."),
    fix_test("range-total", "inventory", """
        def total_between(counts, start, end):
            \"\"\"Sum counts[start..end], both ends included.\"\"\"
            return sum(counts[start:end])
        """, """
        import unittest
        from inventory import total_between

        class T(unittest.TestCase):
            def test_inclusive(self):
                self.assertEqual(total_between([1, 2, 3, 4], 1, 2), 5)
        """, """
        import unittest
        from inventory import total_between

        class H(unittest.TestCase):
            def test_more(self):
                self.assertEqual(total_between([1, 2, 3, 4], 0, 3), 10)
                self.assertEqual(total_between([5], 0, 0), 5)
        """, "sed -i 's/counts\\[start:end\\]/counts[start:end + 1]/' inventory.py", "the inclusive range sum is off by one."),
    fix_test("csv-fields", "records", """
        def parse_line(line):
            return line.split(",")
        """, """
        import unittest
        from records import parse_line

        class T(unittest.TestCase):
            def test_spaces(self):
                self.assertEqual(parse_line("a, b ,c"), ["a", "b", "c"])
        """, """
        import unittest
        from records import parse_line

        class H(unittest.TestCase):
            def test_more(self):
                self.assertEqual(parse_line(" x "), ["x"])
                self.assertEqual(parse_line("1,2\\n"), ["1", "2"])
        """, "sed -i 's/return line.split(\",\")/return [f.strip() for f in line.split(\",\")]/' records.py",
        "fields keep surrounding whitespace."),
    fix_test("discount", "pricing", """
        def final_price(price, discount_pct, tax_pct):
            discounted = price * (1 - discount_pct / 100)
            discounted = discounted * (1 - discount_pct / 100)
            return round(discounted * (1 + tax_pct / 100), 2)
        """, """
        import unittest
        from pricing import final_price

        class T(unittest.TestCase):
            def test_price(self):
                self.assertEqual(final_price(100, 10, 20), 108.0)
        """, """
        import unittest
        from pricing import final_price

        class H(unittest.TestCase):
            def test_more(self):
                self.assertEqual(final_price(50, 0, 0), 50.0)
                self.assertEqual(final_price(80, 25, 5), 63.0)
        """, "sed -i '3d' pricing.py", "the discount is applied twice."),
]


def edit_task(tid: str, prompt: str, files: dict[str, str], hidden_test: str, fix: str) -> dict:
    return dict(id=f"terminal-edit-{tid}", prompt=prompt, files={k: d(v) for k, v in files.items()},
                verify={"command": VERIFY, "files": {"test_hidden_edit.py": d(hidden_test)}},
                reference_commands=[fix])


EDIT_TASKS = [
    edit_task("rename-function", "Rename the function `get_user` to `fetch_user` everywhere in the `app` package "
              "(its definition and every caller). No name `get_user` may remain.", {
                  "app/__init__.py": "",
                  "app/db.py": """
                      USERS = {1: "ada", 2: "grace"}

                      def get_user(uid):
                          return USERS.get(uid)
                      """,
                  "app/api.py": """
                      from app.db import get_user

                      def handle(uid):
                          user = get_user(uid)
                          return {"user": user} if user else {"error": "not found"}
                      """,
                  "app/cli.py": """
                      from app import db

                      def main(uid):
                          print(db.get_user(int(uid)))
                      """},
              """
              import pathlib, unittest
              from app.db import fetch_user
              from app.api import handle
              import app.cli

              class H(unittest.TestCase):
                  def test_renamed(self):
                      self.assertEqual(fetch_user(1), "ada")
                      self.assertEqual(handle(2), {"user": "grace"})
                      for p in pathlib.Path("app").rglob("*.py"):
                          self.assertNotIn("get_user", p.read_text(), str(p))
              """, "sed -i 's/get_user/fetch_user/g' app/*.py"),
    edit_task("timeout-constant", "The request timeout is hard-coded as 30 in several files. Add a constant "
              "`TIMEOUT_S = 45` to `config.py` and make `client.py` and `worker.py` use `config.TIMEOUT_S` "
              "(import config) instead of the literal 30.", {
                  "config.py": """
                      RETRIES = 3
                      """,
                  "client.py": """
                      def request_timeout():
                          return 30
                      """,
                  "worker.py": """
                      def poll_timeout():
                          return 30 * 2
                      """},
              """
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
              """, "echo 'TIMEOUT_S = 45' >> config.py && printf 'import config\\n\\n\\ndef request_timeout():\\n    "
                   "return config.TIMEOUT_S\\n' > client.py && printf 'import config\\n\\n\\ndef poll_timeout():\\n"
                   "    return config.TIMEOUT_S * 2\\n' > worker.py"),
    edit_task("add-parameter", "Add a keyword parameter `sep` (default `\", \"`) to `join_names` in `names.py`, "
              "used as the separator, and change `report.py` to call it with `sep=\"; \"`.", {
                  "names.py": """
                      def join_names(names):
                          return ", ".join(sorted(names))
                      """,
                  "report.py": """
                      from names import join_names

                      def summary(team):
                          return "Team: " + join_names(team)
                      """},
              """
              import unittest
              from names import join_names
              from report import summary

              class H(unittest.TestCase):
                  def test_sep(self):
                      self.assertEqual(join_names(["b", "a"]), "a, b")
                      self.assertEqual(join_names(["b", "a"], sep="|"), "a|b")
                      self.assertEqual(summary(["y", "x"]), "Team: x; y")
              """, "sed -i 's/def join_names(names):/def join_names(names, sep=\", \"):/; s/return \", \".join/return "
                   "sep.join/' names.py && sed -i 's/join_names(team)/join_names(team, sep=\"; \")/' report.py"),
    edit_task("version-bump", "Bump the version from 1.4.2 to 1.5.0 everywhere it appears (`pkg/__init__.py`, "
              "`setup.cfg` and `CHANGELOG.md`, where a new top entry `## 1.5.0` must come before `## 1.4.2`).", {
                  "pkg/__init__.py": """
                      __version__ = "1.4.2"
                      """,
                  "setup.cfg": """
                      [metadata]
                      name = pkg
                      version = 1.4.2
                      """,
                  "CHANGELOG.md": """
                      # Changelog

                      ## 1.4.2
                      - fix a crash
                      """},
              """
              import pathlib, unittest
              import pkg

              class H(unittest.TestCase):
                  def test_bump(self):
                      self.assertEqual(pkg.__version__, "1.5.0")
                      self.assertIn("version = 1.5.0", pathlib.Path("setup.cfg").read_text())
                      log = pathlib.Path("CHANGELOG.md").read_text()
                      self.assertLess(log.index("## 1.5.0"), log.index("## 1.4.2"))
              """, "sed -i 's/1.4.2/1.5.0/' pkg/__init__.py setup.cfg && sed -i 's/^## 1.4.2$/## 1.5.0\\n\\n## 1.4.2/' "
                   "CHANGELOG.md"),
]


def dep_task(tid: str, prompt: str, files: dict[str, str], hidden_test: str, fix: str) -> dict:
    return dict(id=f"terminal-dep-{tid}", prompt=prompt, files={k: d(v) for k, v in files.items()},
                verify={"command": VERIFY, "files": {"test_hidden_dep.py": d(hidden_test)}},
                reference_commands=[fix])


DEP_TASKS = [
    dep_task("clamp", "`python3 main.py 15` fails because the module `mathutils` does not exist. Create "
             "`mathutils.py` with `clamp(x, lo, hi)` returning x limited to [lo, hi], so main.py prints 10.", {
                 "main.py": """
                     import sys
                     from mathutils import clamp

                     if __name__ == "__main__":
                         print(clamp(int(sys.argv[1]), 0, 10))
                     """},
             """
             import subprocess, sys, unittest
             from mathutils import clamp

             class H(unittest.TestCase):
                 def test_clamp(self):
                     self.assertEqual(clamp(15, 0, 10), 10)
                     self.assertEqual(clamp(-3, 0, 10), 0)
                     self.assertEqual(clamp(4, 0, 10), 4)
                     out = subprocess.run([sys.executable, "main.py", "15"], capture_output=True, text=True)
                     self.assertEqual(out.stdout.strip(), "10")
             """, "printf 'def clamp(x, lo, hi):\\n    return max(lo, min(hi, x))\\n' > mathutils.py"),
    dep_task("package", "`python3 -m unittest` fails: the package `helpers` is missing. Create it so that "
             "`from helpers.text import shout` works; `shout(s)` returns s upper-cased with a trailing '!'.", {
                 "test_app.py": """
                     import unittest
                     from helpers.text import shout

                     class T(unittest.TestCase):
                         def test_shout(self):
                             self.assertEqual(shout("hi"), "HI!")
                     """},
             """
             import unittest
             from helpers.text import shout

             class H(unittest.TestCase):
                 def test_more(self):
                     self.assertEqual(shout(""), "!")
                     self.assertEqual(shout("a b"), "A B!")
             """, "mkdir -p helpers && touch helpers/__init__.py && printf 'def shout(s):\\n    return s.upper() + \"!\"\\n' "
                  "> helpers/text.py"),
    dep_task("settings", "`python3 app.py` crashes because `settings.json` is missing. Create it with the keys the "
             "app reads: `name` = \"demo\", `port` = 8080 and `debug` = false.", {
                 "app.py": """
                     import json

                     def load():
                         with open("settings.json") as f:
                             s = json.load(f)
                         return s["name"], int(s["port"]), bool(s["debug"])

                     if __name__ == "__main__":
                         print(*load())
                     """},
             """
             import unittest
             from app import load

             class H(unittest.TestCase):
                 def test_settings(self):
                     self.assertEqual(load(), ("demo", 8080, False))
             """, "echo '{\"name\": \"demo\", \"port\": 8080, \"debug\": false}' > settings.json"),
    dep_task("stub-module", "The module `units.py` imports `from conversions import km_to_miles, miles_to_km`, but "
             "`conversions.py` is missing. Create it (1 mile = 1.609344 km) so that `python3 -c \"import units\"` "
             "works and `units.marathon_miles()` is about 26.22.", {
                 "units.py": """
                     from conversions import km_to_miles, miles_to_km

                     def marathon_miles():
                         return round(km_to_miles(42.195), 2)
                     """},
             """
             import unittest
             import units
             from conversions import km_to_miles, miles_to_km

             class H(unittest.TestCase):
                 def test_conv(self):
                     self.assertAlmostEqual(miles_to_km(1), 1.609344)
                     self.assertAlmostEqual(km_to_miles(1.609344), 1.0)
                     self.assertEqual(units.marathon_miles(), 26.22)
             """, "printf 'def km_to_miles(km):\\n    return km / 1.609344\\n\\n\\ndef miles_to_km(mi):\\n    "
                  "return mi * 1.609344\\n' > conversions.py"),
]


def build() -> list[Task]:
    tasks = []
    for n, spec in enumerate(FIX_TASKS + EDIT_TASKS + DEP_TASKS):
        payload = {"files": spec["files"], "verify": spec["verify"], "reference_commands": spec["reference_commands"]}
        tasks.append(Task(id=spec["id"], domain="terminal", prompt=spec["prompt"], payload=payload,
                          split="heldout" if n % 5 == 4 else "train"))
    return tasks


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
