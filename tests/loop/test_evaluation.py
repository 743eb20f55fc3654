"""Held-out eval (loop/evaluation.py): greedy requests go to the engine shortest prompt first, then the sampled ones
longest first; results come back per task."""
from __future__ import annotations

from types import SimpleNamespace

from megatron_rl.envs.types import Task
from megatron_rl.loop.evaluation import by_prompt_length, heldout_run
from megatron_rl.run_config import RunConfig


class FakeRollouts:
    """Records what run_now was asked; a task is solved greedily when its payload says so, and by the sampled
    episodes listed in its payload (the sampled request must carry the task's own seed)."""

    is_scorer = True
    tok = SimpleNamespace(stop_ids=[2])

    def __init__(self):
        self.asked = []

    @staticmethod
    def prompt_fn(task):
        return list(range(len(task.prompt)))

    @staticmethod
    def params(gid, n):
        return SimpleNamespace(temperature=1.0, n=n, seed=gid)

    def run_now(self, tasks, params, tag):
        self.asked = [(t.id, p.temperature, getattr(p, "seed", None)) for t, p in zip(tasks, params)]
        out = []
        for t, p in zip(tasks, params):
            solved = [t.payload["greedy"]] if p.temperature == 0.0 else t.payload["sampled"][p.seed]
            out.append(SimpleNamespace(task=t, rewards=[(float(c), {"correct": float(c)}, "ok") for c in solved],
                                       turns=[1] * len(solved)))
        return out


def _task(i, prompt, greedy, sampled):
    return Task(f"t{i}", "arithmetic", prompt, payload={"greedy": greedy, "sampled": {10**7 + i: sampled}})


def test_greedy_requests_go_shortest_prompt_first_sampled_longest_first_and_results_come_back_per_task():
    tasks = [_task(0, "x" * 50, 1, [1, 0]), _task(1, "x" * 5, 0, [0, 0]), _task(2, "x" * 20, 0, [1, 1]),
             _task(3, "x" * 5, 1, [1, 1])]
    cfg = RunConfig()
    cfg.eval.k = 2
    rollouts = FakeRollouts()
    metrics, rows = heldout_run(rollouts, tasks, cfg, tag="ev")
    order = ["t1", "t3", "t2", "t0"]  # by prompt length, ties in their order
    assert rollouts.asked == [(t, 0.0, None) for t in order] + [(t, 1.0, 10**7 + int(t[1])) for t in order[::-1]]
    assert [(r["task"], r["greedy"], r["solved"], r["pass@1"]) for r in rows] == [
        ("t0", 1, 1, 0.5), ("t1", 0, 0, 0.0), ("t2", 0, 2, 1.0), ("t3", 1, 2, 1.0)]
    assert metrics["success_greedy"] == 0.5 and metrics["pass@1"] == 0.625 and metrics["pass@2"] == 0.75
    assert metrics["cpu_s"] >= 0.0 and metrics["time_s"] >= 0.0


def test_by_prompt_length_keeps_ties_in_order():
    tasks = [_task(i, p, 0, []) for i, p in enumerate(["aaa", "a", "aa", "b", "ccc"])]
    assert by_prompt_length(tasks, FakeRollouts.prompt_fn) == [1, 3, 2, 0, 4]


def test_eval_takes_eval_tasks_among_the_prompts_that_fit_and_names_domains_with_fewer(monkeypatch, capsys):
    """The first eval.tasks held-out tasks of each domain are taken AFTER the too-long prompts are dropped (a
    domain whose first held-out prompts are too long still gets its tasks); fewer, or none, are said by name."""
    import megatron_rl.loop.job as J

    monkeypatch.setattr(J, "prompt_ids", lambda tok, task: list(range(len(task.prompt))))
    cfg = RunConfig()
    cfg.model.max_seq_length, cfg.rl.max_new_tokens, cfg.eval.tasks = 100, 20, 2  # room: 80 prompt tokens
    long, short = "x" * 81, "x" * 80

    def tasks(domain, prompts):
        return [Task(f"{domain}{i}", domain, p, split="heldout") for i, p in enumerate(prompts)]

    heldout = (tasks("a", [long, long, short, short, short]) + tasks("b", [long, short]) + tasks("c", [long, long])
               + tasks("d", [short, short, short]))
    out = J.fitting({"rl": {}, "eval": heldout}, None, cfg, say=True)["eval"]
    assert [t.id for t in out] == ["a2", "a3", "b1", "d0", "d1"]
    said = capsys.readouterr().out
    assert "b: eval on 1 of eval.tasks=2 held-out tasks (of its 2" in said
    assert "WARNING: no held-out prompt of c fits 80 tokens" in said and "heldout_tasks" in said
    assert "a: eval on" not in said and "d: eval on" not in said
    assert J.fitting({"rl": {}, "eval": heldout}, None, cfg)["eval"] == out  # deterministic; quiet without say
    assert capsys.readouterr().out == ""
