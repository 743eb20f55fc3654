"""`megatron-rl train configs/mixture_cpu.yaml rl.steps=3` with a tiny HF model built here: five domains (one of
them multi-turn tool use) in the RL loop with the online curriculum across domains (envs.curriculum), per-domain
metrics in every rl row (with each domain's sampling weight and no-gradient fraction) and a summary line on the
console, per-domain eval by each environment's own success definition, a per-domain before/after table in
summary.json and a heat map, multi-turn trajectories with observation tokens masked out, and an exact resume
after SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.hf_tiny import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")
DOMAINS = ("arithmetic", "countdown", "math", "code", "tool_use")
SHORT = ("rl.max_new_tokens=24", "model.max_seq_length=2560", "rl.trainer.packing.max_tokens=2560",
         "eval.tasks=2", "eval.k=2", "engine.num_blocks=2048", "engine.max_tokens_per_step=4096",
         "monitor.tensorboard=false", "rl.dynamic_sampling=false", "rl.prompts_per_step=6", "export.enabled=false")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    tiny_llama(folder, tiny_tokenizer(folder), max_positions=4096)
    return folder


def _rl_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == "rl"]


def _check_mixture_run(run: Path, stdout: str) -> None:
    """What a mixture run of every domain leaves: per-domain rows, curriculum weights, console summary, the
    before/after table, the heat map, per-domain eval and multi-turn trajectories with masked observations."""
    from megatron_rl.data.shards import read_shard

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["kind"] == "rl"]
    assert len(rl) == 3
    for r in rl:  # every domain of the mixture in every row (count 0 when a step drew none of its tasks)
        for d in DOMAINS:
            assert f"{d}/count" in r and f"{d}/reward_mean" in r and f"{d}/turns_mean" in r, (d, sorted(r))
        assert sum(r[f"{d}/count"] for d in DOMAINS) >= 6 * 4
    seen = {d for r in rl for d in DOMAINS if r[f"{d}/count"] > 0}
    assert len(seen) >= 3, seen
    for r in rl:  # the curriculum's weights of the next draws, every domain, each above its floor (0.2 x share)
        assert sum(r[f"{d}/weight"] for d in DOMAINS) == pytest.approx(1.0)
        assert min(r[f"{d}/weight"] / (2 if d == "arithmetic" else 1) for d in DOMAINS) >= 0.2 / 6 - 1e-9
        assert all(0.0 <= r[f"{d}/no_gradient_frac"] <= 1.0 for d in seen if r[f"{d}/count"] > 0)
        assert r["domains/no_gradient_count"] == len(r["domains/no_gradient"])
    if any(rl[0].get(f"{d}/no_gradient_frac", 0.0) > 0 for d in DOMAINS):  # a flat group: the weights move
        assert [rl[0][f"{d}/weight"] for d in DOMAINS] != pytest.approx([2 / 6, 1 / 6, 1 / 6, 1 / 6, 1 / 6])
    assert "[megatron-rl] domains rl step 1:" in stdout and "no gradient (" in stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["domains"] == sorted(DOMAINS)  # the mixture's, not data.domain alone
    table = summary["domain_table"]
    assert [row["domain"] for row in table["domains"]] == sorted(DOMAINS)
    assert all(row["tasks"] == 2 for row in table["domains"])
    assert (run / "domains.md").exists() and (run / "plots" / "domains_heldout.png").stat().st_size > 5000
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all(f"{d}/pass@1" in evals[0] and f"{d}/turns_mean" in evals[0] for d in DOMAINS)
    assert evals[0]["tasks"] == 2 * len(DOMAINS)
    trajs = [t for p in sorted((run / "rl_shards").glob("*.h5")) for t in read_shard(p)]
    multi = [t for t in trajs if t.env == "tool_use" and t.timings.get("turns", 1) > 1]
    for t in multi:  # observations (loss_mask 0) between the model's turns
        resp = np.asarray(t.loss_mask[t.prompt_len:])
        assert resp[0] == 1 and (resp == 0).any() and resp[-1] == 1
    assert {t.env for t in trajs} <= set(DOMAINS)


@pytest.mark.slow
@pytest.mark.multiproc
def test_mixture_trains_every_domain_and_its_curriculum_resumes_exactly_after_sigterm(tmp_path, tiny_hf):
    """The mixture config with the online curriculum trains every domain (`_check_mixture_run`); that run is also
    the unbroken one of a run SIGTERM'd after RL step 0 and rerun: every step's per-domain draws and curriculum
    weights equal the unbroken run's (the curriculum's state is in the sampler's part of the driver checkpoint)."""
    cmd = [EXE, "train", "configs/mixture_cpu.yaml", f"model.init=hf:{tiny_hf}", "envs.curriculum.enabled=true",
           "envs.curriculum.decay=0.5", *SHORT, "rl.steps=3", "monitor.progress=false"]
    unbroken = subprocess.run([*cmd, f"output_dir={tmp_path / 'a'}"], cwd=REPO, capture_output=True, text=True,
                              timeout=1500)
    assert unbroken.returncode == 0, unbroken.stdout[-3000:] + unbroken.stderr[-5000:]
    _check_mixture_run(tmp_path / "a" / "mixture_cpu", unbroken.stdout)
    run = tmp_path / "b" / "mixture_cpu"
    proc = subprocess.Popen([*cmd, f"output_dir={tmp_path / 'b'}"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:  # the stop lands after step 0 or 1, before the last (2)
        if (run / "metrics.jsonl").exists() and any(r["step"] >= 0 for r in _rl_rows(run)):
            os.kill(proc.pid, signal.SIGTERM)
            break
        time.sleep(0.2)
    assert proc.wait(timeout=600) == 3 and len(_rl_rows(run)) < 3
    resumed = subprocess.run([*cmd, f"output_dir={tmp_path / 'b'}"], cwd=REPO, capture_output=True, text=True,
                             timeout=1500)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-5000:]
    a, b = _rl_rows(tmp_path / "a" / "mixture_cpu"), _rl_rows(run)
    assert [r["step"] for r in b] == [0, 1, 2]
    keys = [f"{d}/{m}" for d in DOMAINS for m in ("count", "weight", "no_gradient_frac", "reward_mean")]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in keys} == {k: rb.get(k) for k in keys}, ra["step"]
    weights = [tuple(r[f"{d}/weight"] for d in DOMAINS) for r in a]
    assert len(set(weights)) > 1, weights  # the weights really moved during the run
