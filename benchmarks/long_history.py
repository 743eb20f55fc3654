"""Long histories: success and tokens per episode of each history strategy against the context budget.

A long-horizon Harbor task (built here): six log files of `--file-lines` noisy lines each, a code near the head
of each; the answer is the sum of the six codes, written to /app/answer. The episode runs through the product
path of agent episodes -- the shell agent in the bubblewrap sandbox, calling the policy through the gateway
socket (`envs.agents`), the task's tests in the verifier sandbox -- with each strategy of the agent
(`--history full | head-tail | drop-oldest | summary`; full keeps every output whole, the others cut each to
`--cut-chars`; summary asks for its summary 700 tokens before the budget) and each context budget (the
episode's token budget, which the gateway enforces, and the agent's --context-budget).

The policy is a scripted context reader, NOT a model: each turn it reads the codes present in its context (the
token ids it is given, decoded), restates them in its reply as notes, and cats the first file whose code it
cannot see; once it sees all six it writes their sum, then says it is done; asked for a summary, it replies with
its notes. So success measures what each strategy keeps of the history, and tokens what it costs; a model's
skill is not measured. Tokens are counted with the main job's tokenizer.

    .venv/bin/python benchmarks/long_history.py [--budgets 1024 2048 4096 8192 --file-lines 60 --cut-chars 400]

Prints one JSON object: per strategy and budget, success (0/1), the trained sequence's tokens, the prompt
tokens summed over calls (what the engine prefills without a prefix cache), calls, splits (drop-oldest edits the
history: each split is one more exact segment, trained as a row of the episode), the trained rows' tokens summed
over segments, and status.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
from pathlib import Path

from megatron_rl.envs.episode import drive, open_episode

FILES = 6


def build_task(root: Path, lines: int, seed: int = 0):
    """The task folder and its answer."""
    from megatron_rl.envs.harbor.loader import load_task_folder

    rng = random.Random(seed)
    d = root / "sum-the-codes"
    (d / "environment" / "logs").mkdir(parents=True)
    (d / "tests").mkdir()
    codes = [rng.randrange(10, 99) for _ in range(FILES)]
    for i, code in enumerate(codes, 1):
        noise = [f"{rng.randrange(10**5, 10**6)} worker-{rng.randrange(9)} ok t={rng.random():.4f}"
                 for _ in range(lines)]
        (d / "environment" / "logs" / f"f{i}.log").write_text("\n".join([noise[0], f"CODE_{i}={code}", *noise[1:]]))
    (d / "instruction.md").write_text(f"Each of logs/f1.log .. logs/f{FILES}.log holds one line CODE_<i>=<n>. "
                                      "Write the sum of the six codes to /app/answer.\n")
    (d / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 120.0\n')
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\nCOPY logs /app/logs/\n")
    (d / "tests" / "test.sh").write_text(f"#!/bin/bash\nif [ \"$(tr -d ' \\n' < /app/answer)\" = \"{sum(codes)}\" ]; "
                                         "then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    return load_task_folder(d), sum(codes)


class Reader:
    """The scripted context reader (see the module docstring)."""

    def __init__(self, tok):
        self.tok, self.prompt_tokens, self.calls = tok, 0, 0

    def __call__(self, tokens, turn):
        from megatron_rl.envs.agents.shell_agent import SUMMARY_ASK

        self.prompt_tokens, self.calls = self.prompt_tokens + len(tokens), self.calls + 1
        context = self.tok.decode(tokens)
        seen = dict(re.findall(r"CODE_(\d)=(\d+)", context))
        notes = "notes: " + " ".join(f"CODE_{k}={v}" for k, v in sorted(seen.items()))
        missing = [i for i in range(1, FILES + 1) if str(i) not in seen]
        write = f"echo {sum(map(int, seen.values()))} > answer"
        if SUMMARY_ASK[:40] in context[-800:]:
            text = notes
        elif missing or write not in context:
            cmd = f"cat logs/f{missing[0]}.log" if missing else write
            text = notes + '\n<tool_call>{"name": "shell", "arguments": {"command": "' + cmd + '"}}</tool_call>'
        else:
            text = notes + "\nDone."
        ids = self.tok.encode(text) + [self.tok.stop_ids[-1]]
        return ids, [-0.1] * len(ids), [0] * len(ids)


def run(strategy: str, budget: int, task, tok, sandbox, cut_chars: int) -> dict:
    from megatron_rl.envs.base import Budget, make_env

    chars = 1 << 16 if strategy == "full" else cut_chars  # full: every output whole
    soft = {"drop-oldest": budget, "summary": budget - 700}.get(strategy)
    args = f"--history {strategy} --max-output-chars {chars}" + (f" --context-budget {soft}" if soft else "")
    env = make_env("harbor", agent="shell", agent_args=args, sandbox=sandbox,
                   budget=Budget(max_turns=FILES + 4, max_tokens=budget))
    policy = Reader(tok)
    r = drive(open_episode(env, task, tok, budget), policy)
    return {"success": int(r.reward.total >= 1.0), "trained_tokens": len(r.tokens),
            "prompt_tokens": policy.prompt_tokens,
            "calls": int(r.timings["agent.calls"]), "splits": int(r.timings["agent.splits"]),
            "segment_tokens": len(r.tokens) + sum(len(s["tokens"]) for s in r.segments), "status": r.status}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--cut-chars", type=int, default=400, help="head-tail / drop-oldest: a tool output's length")
    ap.add_argument("--file-lines", type=int, default=60)
    ap.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct")
    args = ap.parse_args(argv)
    from megatron_rl.envs.sandbox import SandboxConfig
    from megatron_rl.tokenizer import HFTokenizer

    tok = HFTokenizer(args.tokenizer)
    out = {"policy": "scripted context reader (not a model)", "tokenizer": args.tokenizer, "results": {}}
    with tempfile.TemporaryDirectory() as tmp, SandboxConfig().build() as sandbox:
        task, answer = build_task(Path(tmp), args.file_lines)
        out["file_tokens"] = len(tok.encode((Path(tmp) / "sum-the-codes/environment/logs/f1.log").read_text()))
        for strategy in ("full", "head-tail", "drop-oldest", "summary"):
            for budget in args.budgets:
                out["results"][f"{strategy}@{budget}"] = run(strategy, budget, task, tok, sandbox, args.cut_chars)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
