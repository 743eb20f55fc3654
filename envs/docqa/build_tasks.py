"""Build the shipped docqa suite: python -m megatron_rl.envs.docqa.build_tasks (writes tasks/train.jsonl, heldout.jsonl).

Three fictional companies' financial statements (two fiscal years, USD millions); ten questions each whose
answers are computed here from the same table the model reads. Every fifth task is held out.
"""
# ruff: noqa: E501  (task data tables)
from __future__ import annotations

from pathlib import Path

from megatron_rl.envs.base import Task
from megatron_rl.envs.tasks import write_splits

COMPANIES = {
    "Northwind Robotics": {
        "Revenue": (1240.0, 1488.0), "Cost of revenue": (706.8, 818.4), "Research and development": (148.8, 193.4),
        "Selling, general and administrative": (186.0, 208.3), "Interest expense": (12.5, 14.1),
        "Income tax expense": (40.1, 54.6), "Cash and equivalents": (210.4, 265.9),
        "Accounts receivable": (180.2, 214.7), "Inventory": (142.6, 160.3), "Property and equipment, net": (402.0, 455.8),
        "Current liabilities": (298.4, 331.0), "Long-term debt": (250.0, 275.0), "Other liabilities": (61.3, 66.2),
        "Shares outstanding (millions)": (84.0, 85.5),
    },
    "Bluefin Foods": {
        "Revenue": (3105.0, 3012.0), "Cost of revenue": (2204.6, 2168.6), "Research and development": (31.0, 30.1),
        "Selling, general and administrative": (512.3, 509.0), "Interest expense": (44.0, 47.5),
        "Income tax expense": (70.9, 55.4), "Cash and equivalents": (388.0, 301.2),
        "Accounts receivable": (402.5, 395.0), "Inventory": (611.9, 640.7), "Property and equipment, net": (1420.0, 1466.3),
        "Current liabilities": (905.1, 948.8), "Long-term debt": (880.0, 910.0), "Other liabilities": (120.4, 118.9),
        "Shares outstanding (millions)": (210.0, 207.2),
    },
    "Quartz Analytics": {
        "Revenue": (512.0, 701.4), "Cost of revenue": (143.4, 189.4), "Research and development": (168.9, 220.1),
        "Selling, general and administrative": (151.0, 188.6), "Interest expense": (2.1, 1.8),
        "Income tax expense": (9.6, 22.9), "Cash and equivalents": (640.3, 702.8),
        "Accounts receivable": (96.7, 131.2), "Inventory": (0.0, 0.0), "Property and equipment, net": (58.4, 66.0),
        "Current liabilities": (210.6, 262.4), "Long-term debt": (0.0, 50.0), "Other liabilities": (18.2, 20.5),
        "Shares outstanding (millions)": (120.4, 123.9),
    },
}
MONEY = ["USD millions", "USD million", "millions of USD", "million USD", "$ millions", "$ million", "$m", "USD m",
         "USD mn", "millions"]
PCT = ["%", "percent", "pct"]
RATIO = ["x", "times", "ratio"]
PER_SHARE = ["USD", "$", "USD per share", "$ per share", "dollars per share", "USD/share", "$/share"]
RUBRIC = ["The explanation names the line items of the document that the question needs.",
          "The explanation shows a lookup or calculation that is consistent with the reported value."]


def derived(d: dict, y: int) -> dict:
    """Statement lines computed from the reported ones, for year index y (0: FY2022, 1: FY2023)."""
    g = {k: v[y] for k, v in d.items()}
    gross = g["Revenue"] - g["Cost of revenue"]
    opex = g["Research and development"] + g["Selling, general and administrative"]
    op = gross - opex
    ni = op - g["Interest expense"] - g["Income tax expense"]
    cur_assets = g["Cash and equivalents"] + g["Accounts receivable"] + g["Inventory"]
    assets = cur_assets + g["Property and equipment, net"]
    liab = g["Current liabilities"] + g["Long-term debt"] + g["Other liabilities"]
    return dict(g, gross=gross, opex=opex, op=op, ni=ni, cur_assets=cur_assets, assets=assets, liab=liab,
                equity=assets - liab)


def document(name: str, d: dict) -> str:
    a, b = derived(d, 0), derived(d, 1)
    rows = [("Revenue", "Revenue"), ("Cost of revenue", "Cost of revenue"), ("Gross profit", "gross"),
            ("Research and development", "Research and development"),
            ("Selling, general and administrative", "Selling, general and administrative"),
            ("Operating income", "op"), ("Interest expense", "Interest expense"),
            ("Income tax expense", "Income tax expense"), ("Net income", "ni")]
    bal = [("Cash and equivalents", "Cash and equivalents"), ("Accounts receivable", "Accounts receivable"),
           ("Inventory", "Inventory"), ("Total current assets", "cur_assets"),
           ("Property and equipment, net", "Property and equipment, net"), ("Total assets", "assets"),
           ("Current liabilities", "Current liabilities"), ("Long-term debt", "Long-term debt"),
           ("Other liabilities", "Other liabilities"), ("Total liabilities", "liab"),
           ("Shareholders' equity", "equity")]
    fmt = lambda rs: "\n".join(f"| {label} | {a[k]:,.1f} | {b[k]:,.1f} |" for label, k in rs)
    return (f"{name}: consolidated financial statements (USD millions, except shares)\n\n"
            f"Income statement\n\n| Line item | FY2022 | FY2023 |\n|---|---|---|\n{fmt(rows)}\n\n"
            f"Balance sheet (end of fiscal year)\n\n| Line item | FY2022 | FY2023 |\n|---|---|---|\n{fmt(bal)}\n\n"
            f"Shares outstanding (millions): FY2022 {d['Shares outstanding (millions)'][0]}, "
            f"FY2023 {d['Shares outstanding (millions)'][1]}")


def questions(d: dict) -> list[tuple[str, str, float, list[str], dict, str]]:
    """(qid, question, value, units, tolerance, how) for one company."""
    a, b = derived(d, 0), derived(d, 1)
    sh = d["Shares outstanding (millions)"][1]
    pct, money, ratio = {"rel_tol": 0.005, "abs_tol": 0.05}, {"rel_tol": 0.001, "abs_tol": 0.05}, {"abs_tol": 0.01}
    return [
        ("rev-growth", "By what percentage did revenue change from FY2022 to FY2023?",
         (b["Revenue"] / a["Revenue"] - 1) * 100, PCT, pct, "(Revenue FY2023 / Revenue FY2022 - 1) * 100"),
        ("gross-margin", "What was the gross margin in FY2023, in percent?", b["gross"] / b["Revenue"] * 100, PCT, pct,
         "Gross profit / Revenue * 100 for FY2023"),
        ("op-margin", "What was the operating margin in FY2023, in percent?", b["op"] / b["Revenue"] * 100, PCT, pct,
         "Operating income / Revenue * 100 for FY2023"),
        ("net-income", "What was net income in FY2023?", b["ni"], MONEY, money, "Net income line, FY2023"),
        ("opex", "What were total operating expenses (research and development plus selling, general and "
         "administrative) in FY2023?", b["opex"], MONEY, money, "R&D + SG&A for FY2023"),
        ("current-ratio", "What was the current ratio (total current assets / current liabilities) at the end of "
         "FY2023?", b["cur_assets"] / b["Current liabilities"], RATIO, ratio,
         "Total current assets / Current liabilities, FY2023"),
        ("debt-equity", "What was the ratio of long-term debt to shareholders' equity at the end of FY2023?",
         b["Long-term debt"] / b["equity"], RATIO, ratio, "Long-term debt / Shareholders' equity, FY2023"),
        ("eps", "What were earnings per share in FY2023 (net income divided by FY2023 shares outstanding)?",
         b["ni"] / sh, PER_SHARE, {"abs_tol": 0.01}, "Net income FY2023 / shares outstanding FY2023"),
        ("tax-rate", "What was the effective tax rate in FY2023 (income tax expense divided by operating income "
         "minus interest expense), in percent?", b["Income tax expense"] / (b["op"] - b["Interest expense"]) * 100,
         PCT, pct, "Income tax expense / (Operating income - Interest expense) * 100, FY2023"),
        ("cash-change", "By how much did cash and equivalents change from the end of FY2022 to the end of FY2023 "
         "(negative for a decrease)?", b["Cash and equivalents"] - a["Cash and equivalents"], MONEY, money,
         "Cash FY2023 - Cash FY2022"),
    ]


def build() -> list[Task]:
    tasks = []
    for name, d in COMPANIES.items():
        doc = document(name, d)
        slug = name.split()[0].lower()
        for qid, q, value, units, tol, how in questions(d):
            checks = [{"type": "required", "fields": ["value", "unit", "explanation"]},
                      {"type": "number", "field": "value", "expected": round(value, 4), **tol},
                      {"type": "unit", "field": "unit", "allowed": units}]
            payload = {"question": q, "reference": f"{value:.4f} {units[0]}; {how}", "checks": checks,
                       "rubric": RUBRIC}
            n = len(tasks)
            tasks.append(Task(id=f"docqa-{slug}-{qid}", domain="docqa", prompt=f"{doc}\n\nQuestion: {q}",
                              payload=payload, split="heldout" if n % 5 == 4 else "train"))
    return tasks


def main() -> None:
    write_splits(Path(__file__).parent / "tasks", build())


if __name__ == "__main__":
    main()
