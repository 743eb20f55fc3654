"""Run the pristine test files of /tests against the code in /app: exit 0 only when every test they
define (counted from their syntax tree) ran and passed, none skipped."""
import ast
import importlib.util
import os
import sys
import unittest

TESTS, APP = "/tests", "/app"


def expected(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return sum(1 for c in tree.body if isinstance(c, ast.ClassDef) for d in c.body
               if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name.startswith("test"))


def load(path):
    name = "pristine_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return unittest.defaultTestLoader.loadTestsFromModule(mod)


os.chdir(APP)
sys.path.append(APP)
paths = [os.path.join(TESTS, f) for f in sorted(os.listdir(TESTS)) if f.startswith("test") and f.endswith(".py")]
want = sum(expected(p) for p in paths)
result = unittest.TextTestRunner(verbosity=1).run(unittest.TestSuite(load(p) for p in paths))
ok = want > 0 and result.testsRun == want and result.wasSuccessful() and not result.skipped
print("ran %d of %d tests: %s" % (result.testsRun, want, "passed" if ok else "FAILED"))
sys.exit(0 if ok else 1)
