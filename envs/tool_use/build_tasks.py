"""Build the shipped tool-use suite: python -m envs.tool_use.build_tasks (writes tasks/train.jsonl, heldout.jsonl).

Three kinds, all with answers computed here from the same data the model gets:
calculator problems, questions over data files in the workspace (CSV, logs, JSON) and text-processing
questions. Data is generated with a fixed seed, so the files are byte-stable. Every fifth task is held out.
"""
from __future__ import annotations

import collections
import json
import random
import statistics
from pathlib import Path

from envs.base import Task
from envs.tasks import write_splits

REGIONS = ["north", "south", "east", "west"]
PRODUCTS = ["widget", "gadget", "gizmo", "doohickey"]
LEVELS = ["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"]


def calculator_tasks() -> list[tuple[str, str, object, dict]]:
    out = []
    for k, (p, r, n) in enumerate([(12400, 3.75, 3), (5000, 4.2, 5), (800, 12.5, 2), (25000, 1.9, 10)]):
        value = round(p * (1 + r / 100) ** n, 2)
        out.append((f"calc-interest-{k}", f"An account holds {p} dollars and earns {r}% interest per year, compounded "
                    f"annually. What is the balance after {n} years, rounded to the cent?", value, {"abs_tol": 0.011}))
    for k, (a, b, c) in enumerate([(48, 1.0625, 17), (391, 7.5, 13), (1234, 0.85, 9)]):
        value = round((a * b + c) ** 0.5, 4)
        out.append((f"calc-sqrt-{k}", f"Compute the square root of ({a} * {b} + {c}), rounded to 4 decimal places.",
                    value, {"abs_tol": 6e-5}))
    for k, (n, m) in enumerate([(2, 64), (3, 40), (7, 22)]):
        value = n**m % 1_000_007
        out.append((f"calc-mod-{k}", f"What is {n}^{m} modulo 1000007?", value, {}))
    return out


def _sales(rng: random.Random, n: int) -> tuple[str, list[dict]]:
    rows = [{"id": i + 1, "region": rng.choice(REGIONS), "product": rng.choice(PRODUCTS),
             "units": rng.randint(1, 40), "price": rng.choice([2.5, 4.0, 9.99, 12.75, 19.0])} for i in range(n)]
    text = "id,region,product,units,price\n" + "".join(
        f"{r['id']},{r['region']},{r['product']},{r['units']},{r['price']}\n" for r in rows)
    return text, rows


def _log(rng: random.Random, n: int) -> tuple[str, list[tuple[str, str, str]]]:
    users = [f"user{u:02d}" for u in range(1, 13)]
    entries = [(f"2024-05-{1 + i // 40:02d}T{(i * 7) % 24:02d}:{(i * 13) % 60:02d}:00", rng.choice(LEVELS),
                rng.choice(users)) for i in range(n)]
    text = "".join(f"{t} {lvl} {u} {'request failed' if lvl == 'ERROR' else 'ok'}\n" for t, lvl, u in entries)
    return text, entries


def data_tasks(rng: random.Random) -> list[tuple[str, str, object, dict, dict]]:
    out = []
    for k in range(4):
        text, rows = _sales(rng, 60 + 10 * k)
        files = {"sales.csv": text}
        region, product = REGIONS[k], PRODUCTS[(k + 1) % 4]
        revenue = round(sum(r["units"] * r["price"] for r in rows if r["region"] == region), 2)
        units = sum(r["units"] for r in rows if r["product"] == product)
        best = max(rows, key=lambda r: (r["units"] * r["price"], -r["id"]))["id"]
        out += [
            (f"sales-{k}-revenue", f"The file sales.csv in your workspace lists sales. What is the total revenue "
             f"(units * price) for the {region} region? Round to the cent.", revenue, {"abs_tol": 0.011}, files),
            (f"sales-{k}-units", f"Using sales.csv in your workspace: how many units of {product} were sold in total?",
             units, {}, files),
            (f"sales-{k}-best", "Using sales.csv in your workspace: what is the id of the row with the largest "
             "revenue (units * price)? If several tie, give the smallest id.", best, {}, files),
        ]
    for k in range(3):
        text, entries = _log(rng, 120 + 40 * k)
        files = {"logs/app.log": text}
        errors = sum(1 for _, lvl, _ in entries if lvl == "ERROR")
        by_user = collections.Counter(u for _, lvl, u in entries if lvl == "ERROR")
        worst = min(by_user, key=lambda u: (-by_user[u], u))
        out += [
            (f"log-{k}-errors", "How many ERROR lines are in logs/app.log in your workspace?", errors, {}, files),
            (f"log-{k}-user", "In logs/app.log in your workspace, which user has the most ERROR lines? If several "
             "tie, give the alphabetically first.", worst, {}, files),
        ]
    for k in range(3):
        nums = [rng.randint(-500, 500) for _ in range(51 + 10 * k)]
        files = {"numbers.json": json.dumps({"values": nums})}
        out += [
            (f"json-{k}-median", "numbers.json in your workspace holds {\"values\": [...]}. What is the median of the "
             "values?", statistics.median(nums), {}, files),
            (f"json-{k}-stdev", "numbers.json in your workspace holds {\"values\": [...]}. What is their population "
             "standard deviation, rounded to 3 decimal places?", round(statistics.pstdev(nums), 3),
             {"abs_tol": 0.0011}, files),
        ]
    return out


def build() -> list[Task]:
    rng = random.Random("tool_use:0")
    items = [(i, q, a, tol, {}) for i, q, a, tol in calculator_tasks()] + data_tasks(rng)
    tasks = []
    for n, (tid, question, answer, tol, files) in enumerate(items):
        payload = {"answer": answer, **tol}
        if files:
            payload["files"] = files
        tasks.append(Task(id=f"tool-{tid}", domain="tool_use", prompt=question, payload=payload,
                          split="heldout" if n % 5 == 4 else "train"))
    return tasks


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
