"""Countdown, the demo task a tiny model learns: `<answer>(25 - 5) * 3</answer>` for numbers [3, 5, 25] and
target 60. The expression is checked in the worker only as text (allowed characters, which numbers it uses);
its value is computed IN THE SANDBOX with exact fractions, never evaluated in the worker.

Reward: `correct` 1 if the expression uses only the given numbers (each at most once) and equals the target;
`format` (weight 0.1) 1 if the response has exactly one <answer>...</answer>.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from megatron_rl.envs.base import (
    ENVIRONMENTS,
    RewardComponent,
    RewardContext,
    RewardOutput,
    RewardSpec,
    SingleTurnEnvironment,
    Task,
)
from megatron_rl.envs.rewards import extract_tag, reward
from megatron_rl.envs.sandbox.base import Limits
from megatron_rl.envs.workspace import sandbox_problem

PROMPT = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
          "operations (+, -, *, /) and each number can be used at most once. Show your work in <think> </think> "
          "tags, then give the final equation in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>.")
MAX_EXPR_CHARS = 200
_ALLOWED = re.compile(r"^[\d\s+\-*/()]+$")

# Runs in the sandbox: parse with ast, allow only integer literals and + - * / (and parentheses), compute
# exactly with Fraction, print "num/den". Anything else prints an error line.
_EVAL = r'''
import ast, sys
from fractions import Fraction
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b}
def ev(n):
    if isinstance(n, ast.Expression):
        return ev(n.body)
    if isinstance(n, ast.BinOp) and type(n.op) in OPS:
        return OPS[type(n.op)](ev(n.left), ev(n.right))
    if isinstance(n, ast.Constant) and type(n.value) is int:
        return Fraction(n.value)
    raise ValueError("only integers, + - * / and parentheses are allowed")
try:
    v = ev(ast.parse(open("expr.txt").read(), mode="eval"))
    print("VALUE %d/%d" % (v.numerator, v.denominator))
except ZeroDivisionError:
    print("ERROR division by zero")
except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    print("ERROR %s" % (type(e).__name__,))
'''


def check_expression(expr: str, numbers: list[int]) -> str | None:
    """Text-only checks (no evaluation): characters, length, numbers used. Returns an error or None."""
    if len(expr) > MAX_EXPR_CHARS:
        return f"expression longer than {MAX_EXPR_CHARS} characters"
    if not _ALLOWED.match(expr):
        return "expression may only contain integers, + - * / and parentheses"
    used = Counter(int(x) for x in re.findall(r"\d+", expr))
    avail = Counter(numbers)
    over = {n: c for n, c in used.items() if c > avail.get(n, 0)}
    if over:
        return f"numbers not available (or used too often): {sorted(over)}"
    return None


def answer_expression(response: str) -> str | None:
    expr = extract_tag(response, "answer")
    if expr is None:
        return None
    return expr.split("=")[0].strip()  # "(1 + 2) * 3 = 9" -> left side


EVAL_RUNS = 3
"""Runs of the evaluation before a limit hit is reported. An expression that passed `check_expression` evaluates
in milliseconds, so a limit it hits is the machine's (a loaded host, a slow sandbox start), never the model's:
it is run again, and after `EVAL_RUNS` hits the sample is a sandbox_error (dropped and counted, not a 0)."""


@reward("countdown", version="1")
def countdown_reward(ctx: RewardContext) -> RewardOutput:
    """1 if the <answer> expression uses only the task's numbers (each at most once) and equals the target."""
    numbers, target = list(ctx.task.payload["numbers"]), int(ctx.task.payload["target"])
    expr = answer_expression(ctx.response)
    if not expr:
        return RewardOutput(0.0, "no <answer> expression")
    err = check_expression(expr, numbers)
    if err:
        return RewardOutput(0.0, err)
    if ctx.sandbox is None:
        return RewardOutput(0.0, "no sandbox available", status="sandbox_error")
    prov = {"sandbox": getattr(ctx.sandbox, "name", "?")}
    for _ in range(EVAL_RUNS):
        res = ctx.sandbox.run(["python3", "eval.py"], files={"eval.py": _EVAL, "expr.txt": expr},
                              limits=Limits(wall_s=5.0, cpu_s=2.0, memory_mb=256))
        problem = sandbox_problem(res)
        if not problem:
            break
    if problem:  # never the model's doing: the expression passed check_expression (<= 200 chars of + - * /)
        return RewardOutput(0.0, f"{problem[0]} in {EVAL_RUNS} runs evaluating a checked expression",
                            {**prov, "runs": EVAL_RUNS}, "sandbox_error")
    m = re.search(r"^VALUE (-?\d+)/(\d+)$", res.stdout, re.M)
    if not m:
        err = re.search(r"^ERROR (.*)$", res.stdout, re.M)
        return RewardOutput(0.0, f"could not evaluate: {err.group(1) if err else res.stderr[-200:]}", prov)
    value = Fraction(int(m.group(1)), int(m.group(2)))
    ok = value == target
    return RewardOutput(float(ok), f"{expr} = {value}{'' if ok else f', target {target}'}", prov)


@ENVIRONMENTS.register("countdown")
class CountdownEnv(SingleTurnEnvironment):
    """Single turn: the model answers with an arithmetic expression in <answer> tags."""

    name = "countdown"

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("correct", "countdown", 1.0),
                           RewardComponent("format", "format", 0.1, {"kind": "answer_tag"})])

    def compact_prompt(self, task: Task) -> str:
        """`3 5 25 -> 75`: the numbers and the target, for tiny byte-level models."""
        return f"{' '.join(map(str, task.payload['numbers']))} -> {task.payload['target']}\n"

    def reference_response(self, task: Task, corrupt: bool = False) -> str | None:
        """`<answer>solution</answer>`; corrupt: `<answer>1 + solution</answer>` (off the target by one)."""
        solution = task.payload.get("solution")
        if not isinstance(solution, str):
            return None
        return f"<answer>{'1 + ' if corrupt else ''}{solution}</answer>"


# ------------------------------------------------------------------------------------------- generator
def _random_solution(rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
    """Combine a random subset of `numbers` with random operations, keeping every intermediate a positive
    integer; return (expression, value) or None."""
    items = [(str(n), n) for n in rng.sample(numbers, rng.randint(2, len(numbers)))]
    while len(items) > 1:
        (ea, a), (eb, b) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
        if a < b:
            (ea, a), (eb, b) = (eb, b), (ea, a)
        op = rng.choice("+-*/")
        if op == "-" and a == b or op == "/" and (b == 0 or a % b) or op == "*" and a * b > 10_000:
            op = "+"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        items.append((f"({ea} {op} {eb})", value))
    expr, value = items[0]
    return (expr[1:-1], value) if 1 <= value <= 1000 else None


def generate_tasks(n: int, seed: int = 0, split: str = "train", prefix: str = "countdown") -> list[Task]:
    """`n` solvable countdown tasks, deterministic given `seed` (3-4 numbers in 1..99, target 1..1000)."""
    rng = random.Random(f"countdown:{seed}")
    tasks = []
    while len(tasks) < n:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        sol = _random_solution(rng, numbers)
        if sol is None or sol[1] in numbers:
            continue
        expr, target = sol
        tasks.append(Task(id=f"{prefix}-{split}-{len(tasks):04d}", domain="countdown",
                          prompt=PROMPT.format(numbers=numbers, target=target),
                          payload={"numbers": numbers, "target": target, "solution": expr}, split=split))
    return tasks


SHIPPED = {"train": (256, 0), "heldout": (32, 1)}
"""Shipped files: split -> (count, seed)."""


def main() -> None:
    """Regenerate the shipped files: python -m megatron_rl.envs.countdown"""
    from pathlib import Path

    from megatron_rl.envs.tasks import write_tasks

    for split, (n, seed) in SHIPPED.items():
        write_tasks(Path(__file__).parent / "tasks" / f"{split}.jsonl", generate_tasks(n, seed, split))

