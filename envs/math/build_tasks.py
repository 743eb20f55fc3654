"""Build the shipped math task suite: python -m megatron_rl.envs.math.build_tasks (writes tasks/train.jsonl, heldout.jsonl).

Hand-written problems (`PROBLEMS`): (id, question, answer, check) where `check` recomputes the answer in Python
so a typo in an answer cannot ship (the builder asserts it). Every fifth of them is held out.

Generated problems (`FAMILIES`, ids math-gen-<family>-<n>): 20 seeded families with integer or exact fraction
answers: an easy tier for small models (one-step sums, differences, products, halves, x + a = b, rectangle
area and perimeter) and a medium tier (linear equations, fractions, percentages, sequences and series,
counting, gcd/lcm, remainders, word problems, quadratics with integer roots, exponential equations). Each
answer is computed from the parameters, written as LaTeX and checked with math-verify against the computed
value when built.
Split rule (see `envs.suite_gen`): a generated task is held out exactly when its family's key parameter lies
in the family's held-out band, so train and held-out tasks of a family never share that parameter's value.
"""
# ruff: noqa: E501  (task data tables)
from __future__ import annotations

import math
import random
from fractions import Fraction as F
from pathlib import Path

import sympy as sp

from megatron_rl.envs.base import Task
from megatron_rl.envs.suite_gen import Family, meta, split_of
from megatron_rl.envs.tasks import write_splits

x = sp.symbols("x")

PROBLEMS = [
    ("arith-1", "Compute $17 \\times 23 - 91$.", "300", 17 * 23 - 91),
    ("arith-2", "What is $2^{10} + 3^5$?", "1267", 2**10 + 3**5),
    ("frac-1", "Simplify $\\frac{3}{4} + \\frac{5}{6}$.", "\\frac{19}{12}", F(3, 4) + F(5, 6)),
    ("frac-2", "Compute $\\frac{2}{3} \\cdot \\frac{9}{10} - \\frac{1}{5}$.", "\\frac{2}{5}", F(2, 3) * F(9, 10) - F(1, 5)),
    ("lin-1", "Solve for $x$: $3x + 7 = 25$.", "6", sp.solve(3 * x + 7 - 25, x)[0]),
    ("lin-2", "Solve for $x$: $5(x - 2) = 2x + 11$.", "7", sp.solve(5 * (x - 2) - 2 * x - 11, x)[0]),
    ("quad-1", "What is the larger root of $x^2 - 5x + 6 = 0$?", "3", max(sp.solve(x**2 - 5 * x + 6, x))),
    ("quad-2", "What is the sum of the roots of $2x^2 - 7x + 3 = 0$?", "\\frac{7}{2}", sum(sp.solve(2 * x**2 - 7 * x + 3, x))),
    ("quad-3", "What is the product of the roots of $x^2 + 4x - 21 = 0$?", "-21", sp.prod(sp.solve(x**2 + 4 * x - 21, x))),
    ("pct-1", "A jacket costs $80$ dollars and is discounted by $15\\%$. What is the new price in dollars?", "68", 80 * 0.85),
    ("pct-2", "A number increased by $20\\%$ is $150$. What is the number?", "125", F(150) / F(6, 5)),
    ("comb-1", "How many ways can 3 people be chosen from a group of 10?", "120", math.comb(10, 3)),
    ("comb-2", "How many distinct arrangements of the letters of the word LEVEL are there?", "30",
     math.factorial(5) // (math.factorial(2) * math.factorial(2))),
    ("comb-3", "How many positive divisors does $360$ have?", "24", len(sp.divisors(360))),
    ("prob-1", "Two fair six-sided dice are rolled. What is the probability that the sum is 7?", "\\frac{1}{6}",
     F(sum(1 for a in range(1, 7) for b in range(1, 7) if a + b == 7), 36)),
    ("prob-2", "A fair coin is flipped 4 times. What is the probability of exactly 2 heads?", "\\frac{3}{8}",
     F(math.comb(4, 2), 16)),
    ("geo-1", "A right triangle has legs 9 and 12. What is the length of its hypotenuse?", "15", math.hypot(9, 12)),
    ("geo-2", "What is the area of a circle with radius 6? Give an exact answer.", "36\\pi", 36 * sp.pi),
    ("geo-3", "What is the sum of the interior angles of a hexagon, in degrees?", "720", (6 - 2) * 180),
    ("geo-4", "A rectangle has perimeter 34 and length 12. What is its area?", "60", 12 * (34 // 2 - 12)),
    ("seq-1", "What is the sum of the first 50 positive integers?", "1275", sum(range(1, 51))),
    ("seq-2", "The first term of an arithmetic sequence is 4 and the common difference is 7. What is the 20th term?",
     "137", 4 + 19 * 7),
    ("seq-3", "What is the sum of the infinite geometric series $1 + \\frac{1}{3} + \\frac{1}{9} + \\cdots$?",
     "\\frac{3}{2}", sp.summation(sp.Rational(1, 3) ** sp.Symbol("k"), (sp.Symbol("k"), 0, sp.oo))),
    ("nt-1", "What is the greatest common divisor of 252 and 198?", "18", math.gcd(252, 198)),
    ("nt-2", "What is the least common multiple of 12, 18 and 30?", "180", math.lcm(12, 18, 30)),
    ("nt-3", "What is the remainder when $7^{100}$ is divided by 5?", "1", pow(7, 100, 5)),
    ("nt-4", "What is the sum of all prime numbers less than 30?", "129", sum(sp.primerange(2, 30))),
    ("alg-1", "If $f(x) = 2x^2 - 3x + 1$, what is $f(4)$?", "21", 2 * 16 - 12 + 1),
    ("alg-2", "Expand and simplify $(x + 3)^2 - (x - 3)^2$.", "12x", sp.expand((x + 3) ** 2 - (x - 3) ** 2)),
    ("alg-3", "Simplify $\\sqrt{72}$.", "6\\sqrt{2}", sp.sqrt(72)),
    ("alg-4", "Solve for $x$: $2^{x+1} = 64$.", "5", sp.solve(2 ** (x + 1) - 64, x)[0]),
    ("alg-5", "What is $\\log_2 256$?", "8", sp.log(256, 2)),
    ("calc-1", "What is the derivative of $x^3 - 4x$ evaluated at $x = 2$?", "8", sp.diff(x**3 - 4 * x, x).subs(x, 2)),
    ("calc-2", "Compute $\\int_0^3 x^2 \\, dx$.", "9", sp.integrate(x**2, (x, 0, 3))),
    ("word-1", "A train travels 180 km in 2.5 hours. What is its average speed in km/h?", "72", 180 / 2.5),
    ("word-2", "Alice is 3 times as old as Bob. In 10 years she will be twice as old as Bob. How old is Alice now?",
     "30", 3 * sp.solve(3 * x + 10 - 2 * (x + 10), x)[0]),
    ("word-3", "A tank fills in 6 hours with pipe A alone and in 3 hours with pipe B alone. How many hours does it "
     "take with both pipes open?", "2", 1 / (F(1, 6) + F(1, 3))),
    ("word-4", "The average of five numbers is 18. Four of them are 12, 15, 20 and 25. What is the fifth?", "18",
     5 * 18 - (12 + 15 + 20 + 25)),
    ("set-1", "For which real $x$ does $|x - 2| < 3$ hold? Give the answer as an interval.", "(-1, 5)",
     sp.solve_univariate_inequality(sp.Abs(x - 2) < 3, x, relational=False)),
    ("set-2", "What are the solutions of $x^2 = 9$? Give them as a set.", "\\{-3, 3\\}", sp.FiniteSet(*sp.solve(x**2 - 9, x))),
]


# ------------------------------------------------------------------------------------- generated families
def _tex(v) -> str:
    """An exact value as the LaTeX a solver would write: an integer, a terminating decimal or \\frac{p}{q}."""
    v = F(v)
    if v.denominator == 1:
        return str(v.numerator)
    d = v.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:
        return str(v.numerator / v.denominator)
    sign = "-" if v < 0 else ""
    return f"{sign}\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"


def _signed(c: int) -> str:
    """' + c' or ' - |c|' for writing a term after another."""
    return f" + {c}" if c >= 0 else f" - {-c}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _r(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def _linear(p):
    a, x, b = p["a"], p["x"], p["b"]
    return f"Find $x$ if ${a}x{_signed(b)} = {a * x + b}$.", x


def _frac(p):
    a, b, c, d, op = p["a"], p["b"], p["c"], p["d"], p["op"]
    value = F(a, b) + F(c, d) if op == "+" else F(a, b) - F(c, d)
    return f"Compute $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}}$ exactly.", value


def _arith_seq(p):
    a, d, n = p["a"], p["d"], p["n"]
    return (f"The arithmetic sequence ${a}, {a + d}, {a + 2 * d}, \\ldots$ continues with the same difference. "
            f"What is its {_ordinal(n)} term?", a + (n - 1) * d)


def _arith_sum(p):
    a, d, n = p["a"], p["d"], p["n"]
    return (f"What is the sum of the first {n} terms of the arithmetic sequence ${a}, {a + d}, {a + 2 * d}, "
            f"\\ldots$?", n * (2 * a + (n - 1) * d) // 2)


def _geom(p):
    a, r, n = p["a"], p["r"], p["n"]
    return (f"The geometric sequence ${a}, {a * r}, {a * r * r}, \\ldots$ continues with the same ratio. What is its "
            f"{_ordinal(n)} term?", a * r ** (n - 1))


def _shop(p):
    n, price, bill = p["n"], p["price"], p["bill"]
    return (f"{p['who']} buys {n} {p['item']} at {price} dollars each and pays with {bill} dollars. How many "
            f"dollars of change does {p['who']} get?", bill - n * price)


def _rect(p):
    w, h = p["w"], p["h"]
    if p["ask"] == "area":
        return f"A rectangle is {w} cm wide and {h} cm long. What is its area in square centimetres?", w * h
    return f"A rectangle is {w} cm wide and {h} cm long. What is its perimeter in centimetres?", 2 * (w + h)


def _quad(p):
    r, s = p["r"], p["s"]
    b, c = -(r + s), r * s
    bx = "" if b == 0 else f"{_signed(b)}x".replace(" 1x", " x")
    cterm = _signed(c) if c else ""
    return f"The equation $x^2{bx}{cterm} = 0$ has two integer roots. What is the smaller one?", min(r, s)


def _draw_frac(rng):
    b, d = _r(rng, 2, 12), _r(rng, 2, 12)
    return {"a": _r(rng, 1, b - 1), "b": b, "c": _r(rng, 1, d - 1), "d": d, "op": rng.choice("+-")}


def _draw_shop(rng):
    n, price = _r(rng, 2, 9), _r(rng, 1, 9)
    return {"who": rng.choice(["Ana", "Ben", "Chloe", "Dev", "Ema"]), "item": rng.choice(["pens", "apples", "cards"]),
            "n": n, "price": price, "bill": 10 * (n * price // 10 + _r(rng, 1, 3))}


def _draw_quad(rng):
    r = _r(rng, -9, 8)
    return {"r": r, "s": _r(rng, r + 1, 9)}


# name, tier, key, held band, n, draw, render(params) -> (prompt, exact value)
_SPECS = [
    ("add", "easy", "a", (18, 24), 40, lambda g: {"a": _r(g, 2, 40), "b": _r(g, 2, 40)},
     lambda p: (f"What is ${p['a']} + {p['b']}$?", p["a"] + p["b"])),
    ("sub", "easy", "b", (7, 10), 40, lambda g: {"a": _r(g, 20, 99), "b": _r(g, 1, 19)},
     lambda p: (f"Compute ${p['a']} - {p['b']}$.", p["a"] - p["b"])),
    ("mul", "easy", "a", (7, 8), 40, lambda g: {"a": _r(g, 2, 12), "b": _r(g, 2, 12)},
     lambda p: (f"What is ${p['a']} \\times {p['b']}$?", p["a"] * p["b"])),
    ("half", "easy", "k", (25, 34), 30, lambda g: {"k": _r(g, 3, 60)},
     lambda p: (f"What is half of {2 * p['k']}?", p["k"])),
    ("onestep", "easy", "x", (13, 18), 30, lambda g: {"x": _r(g, 1, 30), "a": _r(g, 1, 30)},
     lambda p: (f"If $x + {p['a']} = {p['x'] + p['a']}$, what is $x$?", p["x"])),
    ("linear", "medium", "x", (3, 7), 30, lambda g: {"a": _r(g, 2, 9), "x": _r(g, -9, 15), "b": _r(g, -30, 30)},
     _linear),
    ("frac", "medium", "b", (7, 8), 25, _draw_frac, _frac),
    ("percent", "medium", "p", (40, 55), 25, lambda g: {"p": 5 * _r(g, 1, 19), "n": 20 * _r(g, 1, 20)},
     lambda p: (f"What is ${p['p']}\\%$ of ${p['n']}$?", F(p["p"] * p["n"], 100))),
    ("arith_seq", "medium", "d", (6, 7), 20, lambda g: {"a": _r(g, 1, 20), "d": _r(g, 2, 12), "n": _r(g, 10, 40)},
     _arith_seq),
    ("arith_sum", "medium", "n", (20, 25), 20, lambda g: {"a": _r(g, 1, 9), "d": _r(g, 1, 6), "n": _r(g, 5, 40)},
     _arith_sum),
    ("geom", "medium", "a", (3, 4), 20, lambda g: {"a": _r(g, 1, 6), "r": _r(g, 2, 4), "n": _r(g, 3, 8)}, _geom),
    ("choose", "medium", "n", (10, 11), 20, lambda g: (lambda n: {"n": n, "k": _r(g, 2, n - 2)})(_r(g, 5, 16)),
     lambda p: (f"In how many ways can {p['k']} items be chosen from {p['n']} distinct items?",
                math.comb(p["n"], p["k"]))),
    ("arrange", "medium", "n", (8, 9), 20, lambda g: {"n": _r(g, 4, 12), "k": _r(g, 2, 4)},
     lambda p: (f"{p['n']} runners race. In how many different ways can the first {p['k']} places be filled?",
                math.perm(p["n"], p["k"]))),
    ("gcd", "medium", "g", (6, 7), 20, lambda g: {"g": _r(g, 2, 12), "m": _r(g, 2, 15), "k": _r(g, 2, 15)},
     lambda p: (f"Find $\\gcd({p['g'] * p['m']}, {p['g'] * p['k']})$.", math.gcd(p["g"] * p["m"], p["g"] * p["k"]))),
    ("lcm", "medium", "a", (9, 11), 20, lambda g: {"a": _r(g, 2, 20), "b": _r(g, 2, 20)},
     lambda p: (f"Find the least common multiple of {p['a']} and {p['b']}.", math.lcm(p["a"], p["b"]))),
    ("remainder", "medium", "b", (7, 8), 20, lambda g: {"a": _r(g, 20, 500), "b": _r(g, 3, 12)},
     lambda p: (f"What is the remainder when {p['a']} is divided by {p['b']}?", p["a"] % p["b"])),
    ("shop", "medium", "n", (5, 6), 20, _draw_shop, _shop),
    ("rect", "easy", "w", (7, 9), 25, lambda g: {"w": _r(g, 2, 15), "h": _r(g, 2, 15), "ask": g.choice(["area", "perimeter"])},
     _rect),
    ("quad", "medium", "r", (-2, 0), 20, _draw_quad, _quad),
    ("exp", "medium", "x", (5, 5), 20, lambda g: {"b": _r(g, 2, 5), "x": _r(g, 2, 8)},
     lambda p: (f"Solve ${p['b']}^x = {p['b'] ** p['x']}$ for $x$.", p["x"])),
]
FAMILIES = [(Family(name, tier, key, held, n, draw), render) for name, tier, key, held, n, draw, render in _SPECS]
SEED = "math-gen-0"


def generated() -> list[tuple[Task, object]]:
    """(task, exact value) for every generated problem."""
    out = []
    for fam, render in FAMILIES:
        for i, params in enumerate(fam.params(SEED)):
            prompt, value = render(params)
            out.append((Task(id=f"math-gen-{fam.name}-{i}", domain="math", prompt=prompt,
                             payload={"answer": _tex(value), **meta(fam, params)}, split=split_of(fam, params)),
                        value))
    return out


def _check(answer: str, value) -> None:
    from megatron_rl.envs.rewards import math_equal

    if not math_equal(answer, sp.latex(sp.sympify(value)) if not isinstance(value, sp.Set) else sp.latex(value)):
        raise AssertionError(f"shipped answer {answer!r} does not equal the recomputed {value!r}")


def build() -> list[Task]:
    tasks = []
    for i, (pid, question, answer, value) in enumerate(PROBLEMS):
        _check(answer, value)
        tasks.append(Task(id=f"math-{pid}", domain="math", prompt=question, payload={"answer": answer},
                          split="heldout" if i % 5 == 4 else "train"))
    for task, value in generated():
        _check(task.payload["answer"], value)
        tasks.append(task)
    return tasks


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
