"""Build the shipped math task suite: python -m envs.math.build_tasks (writes tasks/train.jsonl, heldout.jsonl).

Each problem: (id, question, answer, check) where `check` recomputes the answer in Python so a typo in an
answer cannot ship (the builder asserts it). Every fifth problem is held out.
"""
# ruff: noqa: E501  (task data tables)
from __future__ import annotations

import math
from fractions import Fraction as F
from pathlib import Path

import sympy as sp

from envs.base import Task
from envs.tasks import write_splits

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


def _check(answer: str, value) -> None:
    from envs.rewards import math_equal

    if not math_equal(answer, sp.latex(sp.sympify(value)) if not isinstance(value, sp.Set) else sp.latex(value)):
        raise AssertionError(f"shipped answer {answer!r} does not equal the recomputed {value!r}")


def build() -> list[Task]:
    tasks = []
    for i, (pid, question, answer, value) in enumerate(PROBLEMS):
        _check(answer, value)
        tasks.append(Task(id=f"math-{pid}", domain="math", prompt=question, payload={"answer": answer},
                          split="heldout" if i % 5 == 4 else "train"))
    return tasks


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
