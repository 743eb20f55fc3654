"""Build the shipped tool-use suite: python -m megatron_rl.envs.tool_use.build_tasks
(writes tasks/train.jsonl, heldout.jsonl).

Hand-written tasks (ids tool-calc-*, tool-sales-*, tool-log-*, tool-json-*): calculator problems and questions
over data files in the workspace (CSV, logs, JSON), answers computed here from the same data the model gets.
Held out: whole templates (`_hand_split`: the square-root problems and the log's top-user question), so
no held-out prompt is a train prompt with other numbers or other files.

Generated tasks (`FAMILIES`, ids tool-gen-<family>-<n>): 13 seeded families. Easy tier: two-number sums and
products for the calculator, a locker code or a password to look up in a workspace file. Medium: compound
interest, means and modular powers (calculator), questions over orders.csv, server.log, scores.json and
story.txt (read_file or run_python), and number-theory counts meant for run_python. Every answer is computed
twice: from the generator's data and again from what the model sees (the rendered file text, or the
calculator tool on the expression); the build fails if the two disagree.
Split rule (see `envs.suite_gen`): a generated task is held out exactly when its family's key parameter (an
operand, a row count, a bound, the locker or account asked about) lies in the family's held-out band. File
tasks name that key in the prompt, so no prompt is in both splits.
Data is generated with fixed seeds, so the files are byte-stable.
"""
from __future__ import annotations

import collections
import csv
import io
import json
import math
import random
import statistics
from pathlib import Path

from megatron_rl.envs.base import Task
from megatron_rl.envs.suite_gen import Family, meta, split_of
from megatron_rl.envs.tasks import write_splits
from megatron_rl.envs.tool_use.env import calculate

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


# ------------------------------------------------------------------------------------- generated families
# Each family's render(params) returns (prompt, files, answer, tolerances, check) where `check` is the answer
# recomputed from what the model is shown (file text, or the calculator on an expression).
WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "tundra", "umber",
         "velvet", "willow", "xenon", "yarrow", "zephyr"]
CUSTOMERS = ["acme", "globex", "initech", "umbrella", "hooli"]
ITEMS = ["bolt", "nut", "screw", "washer", "rivet"]
SERVICES = ["api", "auth", "billing", "search"]
STORY_WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "sun", "red"]


def _r(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def _calc(expr: str) -> float:
    return float(calculate(expr))


def _calc_add(p):
    a, b = p["a"], p["b"]
    return f"Use the calculator tool to work out {a} + {b}.", {}, a + b, {}, _calc(f"{a} + {b}")


def _calc_mul(p):
    a, b = p["a"], p["b"]
    return f"What is {a} times {b}? You may use the calculator tool.", {}, a * b, {}, _calc(f"{a} * {b}")


def _read_number(p):
    rng = random.Random(p["locker"])
    lockers = sorted({p["locker"], *rng.sample(range(1, 300), 2)})
    codes = {n: (p["code"] if n == p["locker"] else _r(rng, 1000, 9999)) for n in lockers}
    text = "".join(f"Locker {n}: code {c}\n" for n, c in codes.items())
    check = next(int(line.split("code ")[1]) for line in text.splitlines() if line.startswith(f"Locker {p['locker']}:"))
    return (f"Read note.txt in your workspace. What is the code for locker {p['locker']}?", {"note.txt": text},
            p["code"], {}, check)


def _read_password(p):
    rng = random.Random(p["w"])
    accounts = sorted({WORDS[p["w"]], *rng.sample(WORDS, 2)})
    words = {a: (p["pw"] if a == WORDS[p["w"]] else f"{rng.choice(WORDS)}{_r(rng, 10, 99)}") for a in accounts}
    text = "".join(f"account: {a}  password: {w}\n" for a, w in words.items())
    mine = f"account: {WORDS[p['w']]} "
    check = next(line.split("password: ")[1] for line in text.splitlines() if line.startswith(mine))
    return (f"What is the password of the account '{WORDS[p['w']]}' in vault.txt in your workspace?",
            {"vault.txt": text}, p["pw"], {}, check)


def _interest(p):
    principal, rate, years = p["p"], p["r"] / 10, p["n"]
    value = round(principal * (1 + rate / 100) ** years, 2)
    return (f"A deposit of {principal} dollars grows by {rate}% each year (compound interest). How many dollars is "
            f"it worth after {years} years? Round to the cent.", {}, value, {"abs_tol": 0.011},
            round(_calc(f"{principal} * (1 + {rate} / 100) ** {years}"), 2))


def _mean(p):
    nums = random.Random(p["s"]).sample(range(10, 1000), p["n"])
    listed, total = ", ".join(map(str, nums)), " + ".join(map(str, nums))
    return (f"What is the mean of these numbers: {listed}? Round to 2 decimal places.", {},
            round(statistics.fmean(nums), 2), {"abs_tol": 0.006}, round(_calc(f"({total}) / {len(nums)}"), 2))


def _modpow(p):
    b, e, m = p["b"], p["e"], p["m"]
    return (f"What is the remainder when {b} to the power {e} is divided by {m}?", {}, pow(b, e, m), {},
            _calc(f"{b} ** {e} % {m}"))


def _orders(p):
    rng = random.Random(p["s"])
    rows = [(i + 1, rng.choice(CUSTOMERS), rng.choice(ITEMS), _r(rng, 1, 20), rng.choice([0.5, 1.25, 2.0, 3.75]))
            for i in range(p["n"])]
    text = "order_id,customer,item,qty,unit_price\n" + "".join(f"{a},{b},{c},{d},{e}\n" for a, b, c, d, e in rows)
    parsed = list(csv.DictReader(io.StringIO(text)))
    cust, item = CUSTOMERS[p["s"] % 5], ITEMS[p["s"] % 5]
    if p["q"] == "qty":
        return (f"orders.csv in your workspace lists {p['n']} orders. What is the total qty ordered of item '{item}'?",
                {"orders.csv": text}, sum(r[3] for r in rows if r[2] == item), {},
                sum(int(r["qty"]) for r in parsed if r["item"] == item))
    if p["q"] == "spend":
        return (f"orders.csv in your workspace lists {p['n']} orders. How much did customer '{cust}' spend in total "
                f"(qty * unit_price)? Round to the cent.", {"orders.csv": text},
                round(sum(r[3] * r[4] for r in rows if r[1] == cust), 2), {"abs_tol": 0.011},
                round(sum(int(r["qty"]) * float(r["unit_price"]) for r in parsed if r["customer"] == cust), 2))
    return (f"orders.csv in your workspace lists {p['n']} orders. How many orders have a qty of more than 10?",
            {"orders.csv": text}, sum(r[3] > 10 for r in rows), {}, sum(int(r["qty"]) > 10 for r in parsed))


def _server_log(p):
    rng = random.Random(p["s"])
    levels = ["INFO", "INFO", "WARN", "ERROR"]
    lines = [(rng.choice(levels), rng.choice(SERVICES), _r(rng, 1, 900)) for _ in range(p["n"])]
    text = "".join(f"{lvl} service={svc} latency_ms={ms}\n" for lvl, svc, ms in lines)
    parsed = [dict(kv.split("=") for kv in line.split()[1:]) | {"level": line.split()[0]} for line in text.splitlines()]
    if p["q"] == "warn":
        return (f"server.log in your workspace has {p['n']} lines. How many of them are WARN lines?",
                {"server.log": text}, sum(lvl == "WARN" for lvl, _, _ in lines), {},
                sum(d["level"] == "WARN" for d in parsed))
    slow = max(lines, key=lambda x: x[2])[2]
    return (f"server.log in your workspace has {p['n']} lines. What is the largest latency_ms value in it?",
            {"server.log": text}, slow, {},
            max(int(d["latency_ms"]) for d in parsed))


def _scores(p):
    rng = random.Random(p["s"])
    names = rng.sample(WORDS, p["n"])
    scores = {name.capitalize(): _r(rng, 0, 100) for name in names}
    text = json.dumps({"scores": scores}, indent=1)
    loaded = json.loads(text)["scores"]
    if p["q"] == "total":
        return (f"scores.json in your workspace maps {p['n']} player names to scores under \"scores\". What is the sum "
                "of all the scores?", {"scores.json": text}, sum(scores.values()), {}, sum(loaded.values()))
    best = min(scores, key=lambda k: (-scores[k], k))
    return (f"scores.json in your workspace maps {p['n']} player names to scores under \"scores\". Which player "
            "has the highest score? If several tie, give the alphabetically first.", {"scores.json": text}, best, {},
            sorted(loaded.items(), key=lambda kv: (-kv[1], kv[0]))[0][0])


def _story(p):
    rng = random.Random(p["s"])
    words = [rng.choice(STORY_WORDS) for _ in range(p["n"])]
    lines = [" ".join(words[i:i + 10]).capitalize() + "." for i in range(0, len(words), 10)]
    text = "\n".join(lines) + "\n"
    target = STORY_WORDS[p["s"] % len(STORY_WORDS)]
    return (f"story.txt in your workspace has {p['n']} words. How many times does the word '{target}' occur in it "
            f"(ignoring case and punctuation)?", {"story.txt": text}, words.count(target), {},
            sum(w.strip(".").lower() == target for w in text.split()))


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"[: min(2, n)]
    for i in range(2, math.isqrt(n - 1) + 1 if n > 1 else 0):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return [i for i in range(n) if sieve[i]]


def _prime_sum(p):
    n = p["n"]
    trial = sum(k for k in range(2, n) if all(k % d for d in range(2, math.isqrt(k) + 1)))
    return (f"Use run_python to find the sum of all prime numbers below {n}.", {}, sum(_primes_below(n)), {}, trial)


def _div_count(p):
    n, a, b = p["n"], p["a"], p["b"]
    return (f"How many integers from 1 to {n} inclusive are divisible by {a} or by {b}? Use run_python if it helps.",
            {}, sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0), {},
            n // a + n // b - n // math.lcm(a, b))


def _draw_calc2(rng, lo, hi):
    return {"a": _r(rng, lo, hi), "b": _r(rng, lo, hi)}


# name, tier, key, held band, n, draw, render
_SPECS = [
    ("calc_add", "easy", "a", (40, 53), 30, lambda g: _draw_calc2(g, 10, 99), _calc_add),
    ("calc_mul", "easy", "a", (50, 66), 30, lambda g: _draw_calc2(g, 11, 99), _calc_mul),
    ("read_number", "easy", "locker", (120, 179), 30,
     lambda g: (lambda n: {"locker": n, "code": 1000 + n * 7919 % 9000})(_r(g, 1, 299)), _read_number),
    ("read_password", "easy", "w", (20, 25), 26,
     lambda g: (lambda w: {"w": w, "pw": f"{WORDS[(7 * w + 3) % 26]}{10 + 37 * w % 90}"})(_r(g, 0, 25)),
     _read_password),
    ("interest", "medium", "n", (4, 5), 22, lambda g: {"p": 100 * _r(g, 5, 200), "r": _r(g, 10, 80), "n": _r(g, 1, 10)},
     _interest),
    ("mean", "medium", "n", (8, 9), 20, lambda g: {"n": _r(g, 4, 10), "s": _r(g, 0, 10**6)}, _mean),
    ("modpow", "medium", "e", (30, 41), 20, lambda g: {"b": _r(g, 2, 19), "e": _r(g, 10, 60), "m": _r(g, 7, 97)},
     _modpow),
    ("orders", "medium", "n", (30, 34), 24, lambda g: {"n": _r(g, 15, 40), "s": _r(g, 0, 10**6),
                                                       "q": g.choice(["qty", "spend", "big"])}, _orders),
    ("server_log", "medium", "n", (40, 47), 22, lambda g: {"n": _r(g, 20, 60), "s": _r(g, 0, 10**6),
                                                           "q": g.choice(["warn", "slow"])}, _server_log),
    ("scores", "medium", "n", (9, 10), 22, lambda g: {"n": _r(g, 5, 14), "s": _r(g, 0, 10**6),
                                                      "q": g.choice(["total", "best"])}, _scores),
    ("story", "medium", "n", (50, 59), 22, lambda g: {"n": _r(g, 20, 80), "s": _r(g, 0, 10**6)}, _story),
    ("prime_sum", "medium", "n", (500, 799), 20, lambda g: {"n": 10 * _r(g, 10, 150)}, _prime_sum),
    ("div_count", "medium", "n", (400, 599), 20, lambda g: {"n": 10 * _r(g, 10, 100), "a": _r(g, 2, 9),
                                                            "b": _r(g, 10, 19)}, _div_count),
]
FAMILIES = [(Family(name, tier, key, held, n, draw), render) for name, tier, key, held, n, draw, render in _SPECS]
SEED = "tool-gen-0"


def _same(a, b, tol: dict) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return math.isclose(a, b, rel_tol=0, abs_tol=tol.get("abs_tol", 1e-9))


def generated() -> list[Task]:
    tasks = []
    for fam, render in FAMILIES:
        for i, params in enumerate(fam.params(SEED)):
            prompt, files, answer, tol, check = render(params)
            if not _same(answer, check, tol):
                raise AssertionError(f"{fam.name}-{i}: answer {answer!r} but recomputed {check!r}")
            payload = {"answer": answer, **tol, **({"files": files} if files else {}), **meta(fam, params)}
            tasks.append(Task(id=f"tool-gen-{fam.name}-{i}", domain="tool_use", prompt=prompt, payload=payload,
                              split=split_of(fam, params)))
    return tasks


def _hand_split(tid: str) -> str:
    """Hand-written tasks held out: the square-root problems and the log's top-user questions."""
    held = tid.startswith("calc-sqrt-") or (tid.startswith("log-") and tid.endswith("-user"))
    return "heldout" if held else "train"


def build() -> list[Task]:
    rng = random.Random("tool_use:0")
    items = [(i, q, a, tol, {}) for i, q, a, tol in calculator_tasks()] + data_tasks(rng)
    tasks = []
    for tid, question, answer, tol, files in items:
        payload = {"answer": answer, **tol}
        if files:
            payload["files"] = files
        tasks.append(Task(id=f"tool-{tid}", domain="tool_use", prompt=question, payload=payload,
                          split=_hand_split(tid)))
    return tasks + generated()


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
