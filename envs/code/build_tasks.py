"""Build the shipped code task suite: python -m megatron_rl.envs.code.build_tasks (writes tasks/train.jsonl, heldout.jsonl).

Hand-written problems (`PROBLEMS`): (id, signature, description, canonical solution, tests). Every fifth is
held out.

Generated problems (`FAMILIES`, ids code-gen-<family>-<n>): 18 families of small functions whose spec carries
constants drawn with a fixed seed (add k, multiply by k, divisible by k, repeat a string, count a character,
clamp to a range, shift letters, rotate, chunk, write in base b, window sums, ...); an easy tier is one-line
arithmetic or string functions. Each task's canonical_solution is rendered from source with the constants
filled in, while the expected values of its asserts come from a separate Python reference of the spec
(`ref`), so running one against the other checks both: the builder runs each canonical_solution against its
asserts in-process (trusted code, written here) and fails on a mismatch; the suite's tests run them again in
the sandbox through the domain's reward. Test inputs are drawn per task with a seeded RNG, plus edge cases (empty inputs).
Split rule (see `envs.suite_gen`): a generated task is held out exactly when its family's key constant lies in
the family's held-out band, so no train task of a family uses a held-out constant.
"""
# ruff: noqa: E501  (task data tables)
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.envs.base import Task
from megatron_rl.envs.suite_gen import Family, meta, split_of
from megatron_rl.envs.tasks import write_splits

PROBLEMS = [
    ("add_digits", "add_digits(n: int) -> int",
     "Return the sum of the decimal digits of the non-negative integer n.",
     "def add_digits(n):\n    return sum(int(c) for c in str(n))\n",
     ["assert add_digits(0) == 0", "assert add_digits(7) == 7", "assert add_digits(1234) == 10",
      "assert add_digits(99999) == 45"]),
    ("is_palindrome", "is_palindrome(s: str) -> bool",
     "Return True if s reads the same forwards and backwards, ignoring case and non-alphanumeric characters.",
     "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
     ["assert is_palindrome('A man, a plan, a canal: Panama')", "assert not is_palindrome('hello')",
      "assert is_palindrome('')", "assert is_palindrome('No lemon, no melon')"]),
    ("fizzbuzz", "fizzbuzz(n: int) -> list[str]",
     "Return the FizzBuzz strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
     "'FizzBuzz' for multiples of both, else the number as a string.",
     "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % 3 == 0 else '') + "
     "('Buzz' if i % 5 == 0 else '')\n        out.append(s or str(i))\n    return out\n",
     ["assert fizzbuzz(1) == ['1']", "assert fizzbuzz(5)[-1] == 'Buzz'", "assert fizzbuzz(15)[-1] == 'FizzBuzz'",
      "assert fizzbuzz(3) == ['1', '2', 'Fizz']", "assert fizzbuzz(0) == []"]),
    ("second_largest", "second_largest(xs: list[int]) -> int | None",
     "Return the second largest distinct value in xs, or None if there are fewer than two distinct values.",
     "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) >= 2 else None\n",
     ["assert second_largest([3, 1, 2]) == 2", "assert second_largest([5, 5, 5]) is None",
      "assert second_largest([]) is None", "assert second_largest([4, 4, 3, 1]) == 3",
      "assert second_largest([-1, -2]) == -2"]),
    ("run_length_encode", "run_length_encode(s: str) -> str",
     "Run-length encode s: each run of a repeated character becomes the count followed by the character, "
     "e.g. 'aaabcc' -> '3a1b2c'.",
     "def run_length_encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
     "        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{j - i}{s[i]}')\n"
     "        i = j\n    return ''.join(out)\n",
     ["assert run_length_encode('aaabcc') == '3a1b2c'", "assert run_length_encode('') == ''",
      "assert run_length_encode('x') == '1x'", "assert run_length_encode('aabbaa') == '2a2b2a'"]),
    ("flatten", "flatten(xs: list) -> list",
     "Flatten an arbitrarily nested list of lists into a flat list, preserving order.",
     "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n"
     "        else:\n            out.append(x)\n    return out\n",
     ["assert flatten([]) == []", "assert flatten([1, [2, [3, [4]]], 5]) == [1, 2, 3, 4, 5]",
      "assert flatten([[], [[]], 'a']) == ['a']", "assert flatten([[1, 2], [3]]) == [1, 2, 3]"]),
    ("gcd", "gcd(a: int, b: int) -> int",
     "Return the greatest common divisor of two non-negative integers (gcd(0, 0) == 0). Do not use math.gcd.",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
     ["assert gcd(12, 18) == 6", "assert gcd(0, 5) == 5", "assert gcd(0, 0) == 0", "assert gcd(17, 13) == 1",
      "assert gcd(100, 75) == 25"]),
    ("word_count", "word_count(text: str) -> dict[str, int]",
     "Count words case-insensitively; words are maximal runs of letters a-z (apostrophes and digits split words).",
     "import re\n\ndef word_count(text):\n    out = {}\n    for w in re.findall(r'[a-z]+', text.lower()):\n"
     "        out[w] = out.get(w, 0) + 1\n    return out\n",
     ["assert word_count('') == {}", "assert word_count('The the THE') == {'the': 3}",
      "assert word_count('a1b, c') == {'a': 1, 'b': 1, 'c': 1}", "assert word_count('Hi! hi?') == {'hi': 2}"]),
    ("rotate_list", "rotate_list(xs: list, k: int) -> list",
     "Return xs rotated right by k positions (k may be negative or larger than len(xs)); do not modify xs.",
     "def rotate_list(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[-k:] + xs[:-k] "
     "if k else list(xs)\n",
     ["assert rotate_list([1, 2, 3, 4], 1) == [4, 1, 2, 3]", "assert rotate_list([1, 2, 3], -1) == [2, 3, 1]",
      "assert rotate_list([], 5) == []", "assert rotate_list([1, 2], 4) == [1, 2]",
      "xs = [1, 2, 3]; rotate_list(xs, 1); assert xs == [1, 2, 3]"]),
    ("is_prime", "is_prime(n: int) -> bool",
     "Return True if n is a prime number.",
     "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
     "            return False\n        i += 1\n    return True\n",
     ["assert not is_prime(1)", "assert is_prime(2)", "assert is_prime(97)", "assert not is_prime(91)",
      "assert not is_prime(-7)", "assert is_prime(7919)"]),
    ("merge_intervals", "merge_intervals(intervals: list[list[int]]) -> list[list[int]]",
     "Merge overlapping closed intervals [start, end] (touching intervals merge too) and return them sorted.",
     "def merge_intervals(intervals):\n    out = []\n    for s, e in sorted(intervals):\n"
     "        if out and s <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], e)\n        else:\n"
     "            out.append([s, e])\n    return out\n",
     ["assert merge_intervals([]) == []", "assert merge_intervals([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]",
      "assert merge_intervals([[5, 6], [1, 5]]) == [[1, 6]]", "assert merge_intervals([[1, 2], [3, 4]]) == [[1, 2], [3, 4]]"]),
    ("roman_to_int", "roman_to_int(s: str) -> int",
     "Convert a Roman numeral (I, V, X, L, C, D, M with subtractive notation) to an integer.",
     "def roman_to_int(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n    total = 0\n"
     "    for a, b in zip(s, s[1:] + ' '):\n        total += -v[a] if b != ' ' and v[a] < v[b] else v[a]\n    return total\n",
     ["assert roman_to_int('III') == 3", "assert roman_to_int('IV') == 4", "assert roman_to_int('MCMXCIV') == 1994",
      "assert roman_to_int('LVIII') == 58"]),
    ("int_to_binary", "int_to_binary(n: int) -> str",
     "Return the binary representation of the integer n without a prefix; negative numbers get a leading '-'. "
     "Do not use bin() or format().",
     "def int_to_binary(n):\n    if n == 0:\n        return '0'\n    sign, n = ('-', -n) if n < 0 else ('', n)\n"
     "    bits = ''\n    while n:\n        bits = str(n % 2) + bits\n        n //= 2\n    return sign + bits\n",
     ["assert int_to_binary(0) == '0'", "assert int_to_binary(5) == '101'", "assert int_to_binary(-6) == '-110'",
      "assert int_to_binary(1024) == '10000000000'"]),
    ("anagram_groups", "anagram_groups(words: list[str]) -> list[list[str]]",
     "Group words that are anagrams of each other. Keep words in their input order within a group and order "
     "groups by the position of their first word.",
     "def anagram_groups(words):\n    groups = {}\n    for w in words:\n        groups.setdefault(''.join(sorted(w)), []).append(w)\n"
     "    return list(groups.values())\n",
     ["assert anagram_groups([]) == []",
      "assert anagram_groups(['eat', 'tea', 'tan', 'ate', 'nat', 'bat']) == [['eat', 'tea', 'ate'], ['tan', 'nat'], ['bat']]",
      "assert anagram_groups(['a']) == [['a']]"]),
    ("balanced_brackets", "balanced_brackets(s: str) -> bool",
     "Return True if the brackets (), [], {} in s are balanced and properly nested; other characters are ignored.",
     "def balanced_brackets(s):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n    for c in s:\n"
     "        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n"
     "            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack\n",
     ["assert balanced_brackets('')", "assert balanced_brackets('a(b[c]{d})')", "assert not balanced_brackets('(]')",
      "assert not balanced_brackets('((')", "assert not balanced_brackets('())')"]),
    ("fibonacci", "fibonacci(n: int) -> int",
     "Return the n-th Fibonacci number with fibonacci(0) == 0 and fibonacci(1) == 1; n can be up to 10_000.",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     ["assert fibonacci(0) == 0", "assert fibonacci(1) == 1", "assert fibonacci(10) == 55",
      "assert fibonacci(90) == 2880067194370816120", "assert len(str(fibonacci(10000))) == 2090"]),
    ("transpose", "transpose(m: list[list[int]]) -> list[list[int]]",
     "Return the transpose of a rectangular matrix given as a list of rows.",
     "def transpose(m):\n    return [list(r) for r in zip(*m)]\n",
     ["assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]", "assert transpose([]) == []",
      "assert transpose([[7]]) == [[7]]"]),
    ("caesar", "caesar(text: str, shift: int) -> str",
     "Shift each ASCII letter by `shift` positions in the alphabet (wrapping, preserving case); other "
     "characters are unchanged.",
     "def caesar(text, shift):\n    out = []\n    for c in text:\n        if 'a' <= c <= 'z' or 'A' <= c <= 'Z':\n"
     "            base = ord('a') if c.islower() else ord('A')\n            c = chr(base + (ord(c) - base + shift) % 26)\n"
     "        out.append(c)\n    return ''.join(out)\n",
     ["assert caesar('abc', 1) == 'bcd'", "assert caesar('xyz', 3) == 'abc'", "assert caesar('Hello, World!', 13) == 'Uryyb, Jbeyq!'",
      "assert caesar('abc', -1) == 'zab'", "assert caesar('é', 5) == 'é'"]),
    ("dedupe", "dedupe(xs: list) -> list",
     "Remove duplicates from xs, keeping the first occurrence of each element (elements are hashable).",
     "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n"
     "            out.append(x)\n    return out\n",
     ["assert dedupe([]) == []", "assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]", "assert dedupe(['a', 'a']) == ['a']"]),
    ("binary_search", "binary_search(xs: list[int], target: int) -> int",
     "Return the index of target in the sorted list xs, or -1 if absent (any index if duplicated).",
     "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
     "        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n            lo = mid + 1\n"
     "        else:\n            hi = mid - 1\n    return -1\n",
     ["assert binary_search([], 3) == -1", "assert binary_search([1, 3, 5, 7], 7) == 3",
      "assert binary_search([1, 3, 5, 7], 4) == -1", "xs = list(range(0, 2000, 2)); assert binary_search(xs, 1234) == 617",
      "assert binary_search([2, 2, 2], 2) in (0, 1, 2)"]),
    ("count_vowels", "count_vowels(s: str) -> int",
     "Return the number of vowels (a, e, i, o, u, either case) in s.",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
     ["assert count_vowels('') == 0", "assert count_vowels('Hello World') == 3", "assert count_vowels('rhythm') == 0",
      "assert count_vowels('AEIOUaeiou') == 10"]),
    ("matrix_multiply", "matrix_multiply(a: list[list[int]], b: list[list[int]]) -> list[list[int]]",
     "Multiply two matrices given as lists of rows (the shapes are compatible).",
     "def matrix_multiply(a, b):\n    return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]\n",
     ["assert matrix_multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]",
      "assert matrix_multiply([[1, 2, 3]], [[1], [2], [3]]) == [[14]]",
      "assert matrix_multiply([[2]], [[3, 4]]) == [[6, 8]]"]),
    ("longest_common_prefix", "longest_common_prefix(words: list[str]) -> str",
     "Return the longest common prefix of all words ('' for an empty list).",
     "def longest_common_prefix(words):\n    if not words:\n        return ''\n    p = words[0]\n    for w in words[1:]:\n"
     "        while not w.startswith(p):\n            p = p[:-1]\n    return p\n",
     ["assert longest_common_prefix([]) == ''", "assert longest_common_prefix(['flower', 'flow', 'flight']) == 'fl'",
      "assert longest_common_prefix(['dog', 'car']) == ''", "assert longest_common_prefix(['same']) == 'same'"]),
    ("parse_duration", "parse_duration(s: str) -> int",
     "Parse a duration like '1h30m', '45s', '2h5s' or '3m' (units h, m, s, each at most once, in that order) into "
     "seconds; raise ValueError for anything else (including the empty string).",
     "import re\n\ndef parse_duration(s):\n    m = re.fullmatch(r'(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?', s)\n"
     "    if not s or not m:\n        raise ValueError(s)\n    h, mi, se = (int(g or 0) for g in m.groups())\n"
     "    return h * 3600 + mi * 60 + se\n",
     ["assert parse_duration('1h30m') == 5400", "assert parse_duration('45s') == 45", "assert parse_duration('2h5s') == 7205",
      "try:\n    parse_duration('')\n    raise AssertionError('no error')\nexcept ValueError:\n    pass",
      "try:\n    parse_duration('5x')\n    raise AssertionError('no error')\nexcept ValueError:\n    pass"]),
    ("chunk", "chunk(xs: list, size: int) -> list[list]",
     "Split xs into consecutive chunks of `size` elements (the last may be shorter); size < 1 raises ValueError.",
     "def chunk(xs, size):\n    if size < 1:\n        raise ValueError(size)\n    return [xs[i:i + size] for i in range(0, len(xs), size)]\n",
     ["assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]", "assert chunk([], 3) == []",
      "try:\n    chunk([1], 0)\n    raise AssertionError('no error')\nexcept ValueError:\n    pass"]),
    ("max_subarray", "max_subarray(xs: list[int]) -> int",
     "Return the largest sum of a non-empty contiguous subarray of the non-empty list xs.",
     "def max_subarray(xs):\n    best = cur = xs[0]\n    for x in xs[1:]:\n        cur = max(x, cur + x)\n        best = max(best, cur)\n"
     "    return best\n",
     ["assert max_subarray([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6", "assert max_subarray([-3, -1, -2]) == -1",
      "assert max_subarray([5]) == 5", "assert max_subarray([1, 2, 3]) == 6"]),
    ("title_case", "title_case(s: str, minor: set[str]) -> str",
     "Title-case s: capitalise every word except words in `minor` (compared lower-case), which are lower-cased, "
     "unless it is the first word. Words are separated by single spaces.",
     "def title_case(s, minor):\n    words = s.split(' ')\n    out = []\n    for i, w in enumerate(words):\n"
     "        lw = w.lower()\n        out.append(lw if i and lw in minor else lw.capitalize())\n    return ' '.join(out)\n",
     ["assert title_case('the lord OF the rings', {'of', 'the'}) == 'The Lord of the Rings'",
      "assert title_case('a', {'a'}) == 'A'", "assert title_case('war and peace', set()) == 'War And Peace'"]),
    ("digital_root", "digital_root(n: int) -> int",
     "Repeatedly sum the decimal digits of the non-negative integer n until one digit remains; return it.",
     "def digital_root(n):\n    while n >= 10:\n        n = sum(map(int, str(n)))\n    return n\n",
     ["assert digital_root(0) == 0", "assert digital_root(16) == 7", "assert digital_root(942) == 6",
      "assert digital_root(493193) == 2"]),
    ("pascal_row", "pascal_row(n: int) -> list[int]",
     "Return row n of Pascal's triangle (row 0 is [1]).",
     "def pascal_row(n):\n    row = [1]\n    for _ in range(n):\n        row = [a + b for a, b in zip([0] + row, row + [0])]\n"
     "    return row\n",
     ["assert pascal_row(0) == [1]", "assert pascal_row(1) == [1, 1]", "assert pascal_row(4) == [1, 4, 6, 4, 1]",
      "assert sum(pascal_row(20)) == 2 ** 20"]),
    ("valid_ipv4", "valid_ipv4(s: str) -> bool",
     "Return True if s is a dotted-quad IPv4 address: four decimal parts 0-255, no leading zeros (except '0'), "
     "no signs or spaces.",
     "def valid_ipv4(s):\n    parts = s.split('.')\n    if len(parts) != 4:\n        return False\n    for p in parts:\n"
     "        if not p.isdigit() or not p.isascii() or (len(p) > 1 and p[0] == '0') or int(p) > 255:\n"
     "            return False\n    return True\n",
     ["assert valid_ipv4('192.168.0.1')", "assert not valid_ipv4('256.1.1.1')", "assert not valid_ipv4('01.2.3.4')",
      "assert not valid_ipv4('1.2.3')", "assert not valid_ipv4('1.2.3.-4')", "assert valid_ipv4('0.0.0.0')"]),
    ("top_k_frequent", "top_k_frequent(xs: list[int], k: int) -> list[int]",
     "Return the k most frequent values, most frequent first; ties broken by the smaller value first.",
     "from collections import Counter\n\ndef top_k_frequent(xs, k):\n    c = Counter(xs)\n"
     "    return sorted(c, key=lambda v: (-c[v], v))[:k]\n",
     ["assert top_k_frequent([1, 1, 1, 2, 2, 3], 2) == [1, 2]", "assert top_k_frequent([4, 4, 5, 5, 6], 2) == [4, 5]",
      "assert top_k_frequent([], 3) == []", "assert top_k_frequent([7], 1) == [7]"]),
    ("snake_to_camel", "snake_to_camel(name: str) -> str",
     "Convert snake_case to camelCase: drop underscores and capitalise the letter after each; leading and "
     "repeated underscores are dropped too, and the first letter stays lower-case.",
     "def snake_to_camel(name):\n    parts = [p for p in name.split('_') if p]\n    if not parts:\n        return ''\n"
     "    return parts[0].lower() + ''.join(p.capitalize() for p in parts[1:])\n",
     ["assert snake_to_camel('hello_world') == 'helloWorld'", "assert snake_to_camel('_private__name') == 'privateName'",
      "assert snake_to_camel('x') == 'x'", "assert snake_to_camel('') == ''"]),
]


# ------------------------------------------------------------------------------------- generated families
@dataclass(frozen=True)
class Spec:
    """A family's function: signature, description, solution source and reference, all from the constants."""

    entry: str
    sig: str
    desc: object
    """params -> the spec text."""
    source: object
    """params -> canonical solution source."""
    ref: object
    """(params, *args) -> the expected return value."""
    inputs: object
    """(params, rng) -> list of argument tuples."""


def _ints(rng, n=4, lo=-50, hi=50):
    return [(rng.randint(lo, hi),) for _ in range(n)]


def _lists(rng, n=4, lo=-20, hi=60, length=(0, 12)):
    return [([rng.randint(lo, hi) for _ in range(rng.randint(*length))],) for _ in range(n - 1)] + [([],)]


def _words(rng, n=4):
    def word():
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 11)))

    return [(" ".join(word() for _ in range(rng.randint(1, 7))),) for _ in range(n - 1)] + [("",)]


def _text(rng, n=4):
    alphabet = string.ascii_lowercase + "  ,.!"
    return [("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25))),) for _ in range(n - 1)] + [("",)]


def _shift(p, s):
    k = p["k"] if p["dir"] == "forward" else -p["k"]
    return "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s)


def _base(p, n):
    digits = string.digits + string.ascii_lowercase
    out = ""
    while n:
        n, r = divmod(n, p["b"])
        out = digits[r] + out
    return out or "0"


def _c(p):
    return p["c"]


SPECS = {
    "add_k": Spec("add_k", "add_k(x: int) -> int", lambda p: f"Return x plus {p['k']}.",
                  lambda p: f"def add_k(x):\n    return x + {p['k']}\n", lambda p, x: x + p["k"], lambda p, g: _ints(g)),
    "times_k": Spec("times_k", "times_k(x: int) -> int", lambda p: f"Return x multiplied by {p['k']}.",
                    lambda p: f"def times_k(x):\n    return x * {p['k']}\n", lambda p, x: x * p["k"], lambda p, g: _ints(g)),
    "is_multiple": Spec(
        "is_multiple", "is_multiple(n: int) -> bool", lambda p: f"Return True if n is divisible by {p['k']}, else False.",
        lambda p: f"def is_multiple(n):\n    return n % {p['k']} == 0\n", lambda p, n: n % p["k"] == 0,
        lambda p, g: [(p["k"] * g.randint(-9, 9),), (p["k"] * g.randint(1, 9) + 1,), (g.randint(-99, 99),), (0,)]),
    "repeat_text": Spec(
        "repeat_text", "repeat_text(s: str) -> str",
        lambda p: f"Return {p['k']} copies of s joined by the separator {p['sep']!r}.",
        lambda p: f"def repeat_text(s):\n    return {p['sep']!r}.join([s] * {p['k']})\n",
        lambda p, s: p["sep"].join(s for _ in range(p["k"])),
        lambda p, g: [("ab",), ("x",), ("",), ("hi there",)]),
    "count_char": Spec(
        "count_char", "count_char(s: str) -> int",
        lambda p: f"Return how many times the character {_c(p)!r} occurs in s (case-sensitive).",
        lambda p: f"def count_char(s):\n    return s.count({_c(p)!r})\n", lambda p, s: sum(ch == _c(p) for ch in s),
        lambda p, g: [(_c(p) * 3 + "xy" + _c(p).upper(),)] + _text(g, 3)),
    "clamp": Spec(
        "clamp", "clamp(x: int) -> int",
        lambda p: f"Return x limited to the range [{p['lo']}, {p['hi']}]: values below {p['lo']} become {p['lo']}, "
                  f"values above {p['hi']} become {p['hi']}, others are returned unchanged.",
        lambda p: f"def clamp(x):\n    return max({p['lo']}, min({p['hi']}, x))\n",
        lambda p, x: p["lo"] if x < p["lo"] else p["hi"] if x > p["hi"] else x,
        lambda p, g: [(p["lo"] - 3,), (p["hi"] + 1,), ((p["lo"] + p["hi"]) // 2,), (p["lo"],)]),
    "power_plus": Spec(
        "power_plus", "power_plus(x: int) -> int", lambda p: f"Return x to the power {p['e']}, plus {p['c']}.",
        lambda p: f"def power_plus(x):\n    return x ** {p['e']} + {p['c']}\n", lambda p, x: x ** p["e"] + p["c"],
        lambda p, g: _ints(g, 4, -9, 9)),
    "sum_multiples": Spec(
        "sum_multiples", "sum_multiples(xs: list[int]) -> int",
        lambda p: f"Return the sum of the elements of xs that are multiples of {p['k']} (0 if there are none).",
        lambda p: f"def sum_multiples(xs):\n    return sum(x for x in xs if x % {p['k']} == 0)\n",
        lambda p, xs: sum(x for x in xs if x % p["k"] == 0),
        lambda p, g: [([p["k"], 2 * p["k"] + 1, -3 * p["k"]],)] + _lists(g, 3)),
    "keep_above": Spec(
        "keep_above", "keep_above(xs: list[int]) -> list[int]",
        lambda p: f"Return the elements of xs that are greater than {p['t']}, in their original order.",
        lambda p: f"def keep_above(xs):\n    return [x for x in xs if x > {p['t']}]\n",
        lambda p, xs: [x for x in xs if x > p["t"]],
        lambda p, g: [([p["t"], p["t"] + 1],)] + _lists(g, 3)),
    "shift_letters": Spec(
        "shift_letters", "shift_letters(s: str) -> str",
        lambda p: f"Shift each lowercase ASCII letter of s {p['k']} places {p['dir']} in the alphabet, wrapping "
                  f"around between z and a; every other character stays as it is.",
        lambda p: ("def shift_letters(s):\n    out = ''\n    for c in s:\n        if 'a' <= c <= 'z':\n"
                   f"            c = chr((ord(c) - 97 {'+' if p['dir'] == 'forward' else '-'} {p['k']}) % 26 + 97)\n"
                   "        out += c\n    return out\n"),
        _shift, lambda p, g: [("xyz abc",)] + _text(g, 3)),
    "rotate_left": Spec(
        "rotate_left", "rotate_left(xs: list) -> list",
        lambda p: f"Return a new list: xs rotated left by {p['k']} positions, taken modulo len(xs) when xs is "
                  f"shorter; an empty list gives an empty list.",
        lambda p: f"def rotate_left(xs):\n    if not xs:\n        return []\n    k = {p['k']} % len(xs)\n"
                  "    return xs[k:] + xs[:k]\n",
        lambda p, xs: [xs[(i + p["k"]) % len(xs)] for i in range(len(xs))],
        lambda p, g: [(list(range(p["k"] + 2)),)] + _lists(g, 3)),
    "chunks": Spec(
        "chunks", "chunks(xs: list) -> list[list]",
        lambda p: f"Split xs into consecutive pieces of {p['k']} elements (the last piece may be shorter) and return "
                  "the list of pieces.",
        lambda p: f"def chunks(xs):\n    return [xs[i:i + {p['k']}] for i in range(0, len(xs), {p['k']})]\n",
        lambda p, xs: [list(xs[i * p["k"]:(i + 1) * p["k"]]) for i in range(-(-len(xs) // p["k"]))],
        lambda p, g: [(list(range(2 * p["k"] + 1)),)] + _lists(g, 3, length=(0, 30))),
    "to_base": Spec(
        "to_base", "to_base(n: int) -> str",
        lambda p: f"Return the non-negative integer n written in base {p['b']}, using the digits 0-9 and then "
                  "lowercase letters a-z, without a prefix; 0 is '0'.",
        lambda p: ("def to_base(n):\n    digits = '0123456789abcdefghijklmnopqrstuvwxyz'\n    out = ''\n"
                   f"    while n:\n        out = digits[n % {p['b']}] + out\n        n //= {p['b']}\n"
                   "    return out or '0'\n"),
        _base, lambda p, g: [(0,), (p["b"],), (g.randint(1, 999),), (g.randint(1000, 10**6),)]),
    "count_long_words": Spec(
        "count_long_words", "count_long_words(text: str) -> int",
        lambda p: f"Return how many of the space-separated words of text have {p['cmp']} {p['k']} characters.",
        lambda p: ("def count_long_words(text):\n"
                   f"    return sum(1 for w in text.split() if len(w) {'>' if p['cmp'] == 'more than' else '>='} "
                   f"{p['k']})\n"),
        lambda p, t: len([w for w in t.split() if len(w) > p["k"] - (p["cmp"] == "at least")]),
        lambda p, g: _words(g)),
    "every_kth": Spec(
        "every_kth", "every_kth(xs: list) -> list",
        lambda p: f"Return every {p['k']}th element of xs, starting with the element at index {p['s']} "
                  "(an empty list if xs is too short).",
        lambda p: f"def every_kth(xs):\n    return xs[{p['s']}::{p['k']}]\n",
        lambda p, xs: [x for i, x in enumerate(xs) if i >= p["s"] and (i - p["s"]) % p["k"] == 0],
        lambda p, g: [(list(range(20)),)] + _lists(g, 3, length=(0, 25))),
    "pad_number": Spec(
        "pad_number", "pad_number(n: int) -> str",
        lambda p: f"Return the decimal digits of the non-negative integer n as a string, padded on the left with "
                  f"{p['ch']!r} to at least {p['w']} characters.",
        lambda p: f"def pad_number(n):\n    return str(n).rjust({p['w']}, {p['ch']!r})\n",
        lambda p, n: p["ch"] * max(0, p["w"] - len(str(n))) + str(n),
        lambda p, g: [(0,), (7,), (g.randint(10, 9999),), (10 ** p["w"],)]),
    "window_sums": Spec(
        "window_sums", "window_sums(xs: list[int]) -> list[int]",
        lambda p: f"Return the sums of every run of {p['k']} consecutive elements of xs, in order (an empty list "
                  f"if xs has fewer than {p['k']} elements).",
        lambda p: f"def window_sums(xs):\n    return [sum(xs[i:i + {p['k']}]) for i in range(len(xs) - {p['k']} + 1)]\n",
        lambda p, xs: [sum(xs[i + j] for j in range(p["k"])) for i in range(max(0, len(xs) - p["k"] + 1))],
        lambda p, g: [(list(range(p["k"] + 3)),)] + _lists(g, 3, length=(0, 25))),
    "count_divisible": Spec(
        "count_divisible", "count_divisible(lo: int, hi: int) -> int",
        lambda p: f"Return how many integers from lo to hi inclusive are divisible by {p['k']} (0 if lo > hi).",
        lambda p: f"def count_divisible(lo, hi):\n    return sum(1 for n in range(lo, hi + 1) if n % {p['k']} == 0)\n",
        lambda p, lo, hi: max(0, hi // p["k"] - (lo - 1) // p["k"]),
        lambda p, g: [(1, 100), (0, 0), (g.randint(-50, 50), g.randint(50, 400)), (10, 3)]),
}


def _r(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


# name, tier, key, held band, n, draw
_FAMILY_SPECS = [
    ("add_k", "easy", "k", (41, 60), 24, lambda g: {"k": _r(g, 1, 99)}),
    ("times_k", "easy", "k", (21, 30), 22, lambda g: {"k": _r(g, 2, 50)}),
    ("is_multiple", "easy", "k", (12, 16), 20, lambda g: {"k": _r(g, 2, 30)}),
    ("repeat_text", "easy", "k", (6, 7), 20, lambda g: {"k": _r(g, 2, 11), "sep": g.choice(["", "-", " ", ", "])}),
    ("count_char", "easy", "i", (20, 25), 20, lambda g: (lambda i: {"i": i, "c": chr(97 + i)})(_r(g, 0, 25))),
    ("clamp", "easy", "lo", (-5, -1), 20, lambda g: (lambda lo: {"lo": lo, "hi": lo + _r(g, 3, 40)})(_r(g, -20, 10))),
    ("power_plus", "easy", "c", (8, 11), 20, lambda g: {"e": _r(g, 2, 5), "c": _r(g, 0, 20)}),
    ("sum_multiples", "medium", "k", (11, 14), 18, lambda g: {"k": _r(g, 2, 25)}),
    ("keep_above", "medium", "t", (10, 24), 18, lambda g: {"t": _r(g, -20, 50)}),
    ("shift_letters", "medium", "k", (10, 14), 20, lambda g: {"k": _r(g, 1, 25), "dir": g.choice(["forward", "backward"])}),
    ("rotate_left", "medium", "k", (13, 18), 18, lambda g: {"k": _r(g, 1, 30)}),
    ("chunks", "medium", "k", (10, 13), 18, lambda g: {"k": _r(g, 1, 25)}),
    ("to_base", "medium", "b", (15, 20), 18, lambda g: {"b": _r(g, 2, 36)}),
    ("count_long_words", "medium", "k", (6, 7), 18, lambda g: {"k": _r(g, 1, 10), "cmp": g.choice(["more than", "at least"])}),
    ("every_kth", "medium", "k", (5, 5), 18, lambda g: (lambda k: {"k": k, "s": _r(g, 0, k - 1)})(_r(g, 2, 7))),
    ("pad_number", "medium", "w", (6, 7), 18, lambda g: {"w": _r(g, 2, 12), "ch": g.choice(["0", "*", ".", "#", "_"])}),
    ("window_sums", "medium", "k", (8, 10), 18, lambda g: {"k": _r(g, 1, 20)}),
    ("count_divisible", "medium", "k", (17, 22), 18, lambda g: {"k": _r(g, 2, 40)}),
]
FAMILIES = [(Family(name, tier, key, held, n, draw), SPECS[name]) for name, tier, key, held, n, draw in _FAMILY_SPECS]
SEED = "code-gen-0"


def _tests(spec: Spec, params: dict, rng: random.Random) -> list[str]:
    out = []
    for args in spec.inputs(params, rng):
        call = f"{spec.entry}({', '.join(repr(a) for a in args)})"
        out.append(f"assert {call} == {spec.ref(params, *args)!r}")
    return list(dict.fromkeys(out))


def _self_check(task: Task) -> None:
    """Run the task's canonical solution (our own code) against its asserts in-process."""
    scope: dict = {}
    exec(task.payload["canonical_solution"], scope)  # trusted: generated here
    for test in task.payload["tests"]:
        try:
            exec(test, dict(scope))
        except AssertionError:
            raise AssertionError(f"{task.id}: canonical solution fails {test!r}") from None


def generated() -> list[Task]:
    tasks = []
    for fam, spec in FAMILIES:
        for i, params in enumerate(fam.params(SEED)):
            rng = random.Random(f"{SEED}-{fam.name}-{i}-inputs")
            payload = {"entry_point": spec.entry, "tests": _tests(spec, params, rng),
                       "canonical_solution": spec.source(params), **meta(fam, params)}
            tasks.append(Task(id=f"code-gen-{fam.name}-{i}", domain="code",
                              prompt=f"Write a Python function `{spec.sig}`.\n\n{spec.desc(params)}",
                              payload=payload, split=split_of(fam, params)))
            _self_check(tasks[-1])
    return tasks


def build() -> list[Task]:
    tasks = []
    for i, (name, sig, desc, solution, tests) in enumerate(PROBLEMS):
        prompt = f"Write a Python function `{sig}`.\n\n{desc}"
        tasks.append(Task(id=f"code-{name}", domain="code", prompt=prompt,
                          payload={"entry_point": name, "tests": tests, "canonical_solution": solution},
                          split="heldout" if i % 5 == 4 else "train"))
    return tasks + generated()


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
