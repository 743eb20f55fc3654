"""Rollouts for every trainer layout: the loop's engine is TP-only and its weight sync reshards PP, VPP and EP
(and TP x PP, and experts at etp != tp) into it. Greedy rollouts equal the one-copy loop's (TP=1, PP=EP=1:
every rank holds the whole model), the sync writes every engine parameter (and refuses a sync that misses
one, naming it), and with a separate rollout server at EP=2 the push carries every expert
(tests/mp/loop_layouts.py)."""
from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError

REPO_SCRIPT = "tests/mp/loop_layouts.py"


@pytest.mark.slow
@pytest.mark.multiproc
def test_loop_rollouts_at_pp_vpp_ep_and_tp_pp_equal_the_one_copy_loop(tmp_path):
    from tests.mp.launch import REPO, torchrun
    from tests.mp.loop_layouts import CASES

    recs = torchrun(REPO / REPO_SCRIPT, 4, ["--dir", str(tmp_path)], timeout=500)
    by = {(r["case"], r["rank"]): r for r in recs}
    assert len(by) == 4 * len(CASES), sorted(by)
    refs: dict[str, dict] = {}
    for name, _, _ in CASES:
        ref_name = "ref_" + name.split("_")[-2 if name.endswith("_separate") else -1]
        for rank in range(4):
            rec = by[(name, rank)]
            assert rec["version"] == 1 and rec["engine_layers"] == (2 if "moe" in name else 4), rec
            # a sync that misses one trainer tensor is refused, naming the engine parameter left unwritten
            assert "left 1 engine parameters unwritten" in rec["refused"], rec["refused"]
            assert "'decoder.final_layernorm.weight'" in rec["refused"]
            if name == ref_name:
                refs[(name, rank)] = rec
                continue
            ref = refs[(ref_name, rank)]
            assert rec["engine_params"] == ref["engine_params"]
            assert rec["tokens"] == ref["tokens"], (name, rank)
            for a, b in zip(rec["logprobs"], ref["logprobs"]):
                assert a == pytest.approx(b, abs=1e-5), (name, rank)
    # the models differ (else equal rollouts would prove nothing)
    assert by[("ref_tied", 0)]["tokens"] != by[("ref_untied", 0)]["tokens"] != by[("ref_moe", 0)]["tokens"]
    sep = by[("ep2_moe_separate", 0)]
    assert sep["pushed_experts"] == ["0", "1", "2", "3"]  # rank 0 used to push its own two experts only
    assert sep["server_tokens"] == by[("ref_moe", 0)]["tokens"]


def _cfg(**parallel):
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.run_config import RunConfig

    cfg = RunConfig(parallel=ParallelConfig(**parallel))
    cfg.launch.nproc_per_node = 4
    cfg.model.moe.num_experts = 4
    return cfg


def test_layouts_the_sync_cannot_reshard_are_refused_before_any_rank_starts():
    from megatron_rl.rollout.reshard import check_engine_layout

    cfg = _cfg(ep=2)
    cfg.model.moe.grouped_gemm = True
    with pytest.raises(ConfigError, match=r"model.moe.grouped_gemm with parallel.ep=2"):
        cfg.validate()
    for ok in (_cfg(tp=2, ep=2, sequence_parallel=True), _cfg(tp=2, ep=2, etp=1, sequence_parallel=True)):
        check_engine_layout(ok.parallel, ok.model)  # SequentialMLP experts at etp = tp, and resharded at etp != tp
        ok.validate()


def test_a_separate_server_needs_tp1_only():
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.run_config import RunConfig

    cfg = RunConfig(parallel=ParallelConfig(tp=2))
    cfg.episodes.runner, cfg.episodes.server = "dispatch", "separate"
    with pytest.raises(ConfigError, match=r"episodes.server=separate .* needs parallel.tp=1 \(got tp=2\)"):
        cfg.validate()
    cfg.parallel = ParallelConfig(pp=2)  # rank 0's engine holds the whole model: accepted now
    cfg.validate()


DP2 = ("parallel.tp=1", "train.steps=0", "data.train_tasks=16", "data.heldout_tasks=4", "eval.k=1", "eval.every=0",
       "eval.tasks=2", "rl.prompts_per_step=4", "rl.group_size=2", "rl.dynamic_sampling=false",
       "monitor.tensorboard=false", "rl.trainer.epochs=1", "export.enabled=false")


@pytest.mark.slow
@pytest.mark.multiproc
def test_dp2_replicas_generate_their_own_prompts_and_the_trained_batch_is_the_union(tmp_path):
    """`megatron-rl train` at TP=1 on 2 ranks: two engine replicas. Each generates (and its leader scores) every
    other group of a step, with staleness 1 (requests in flight across an update on both replicas); every rank
    trains on the union."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from megatron_rl.data.shards import read_shard
    from tests.mp.launch import REPO

    exe = str(Path(sys.executable).parent / "megatron-rl")
    proc = subprocess.run([exe, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", *DP2, "rl.steps=2",
                           "rl.max_staleness=1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "demo"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["kind"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        shard = read_shard(run / "rl_shards" / f"step-{r['step']:06d}.h5")
        by_replica: dict[str, set] = {}
        for t in shard:
            by_replica.setdefault(t.provenance["replica"], set()).add(t.group_id)
        assert sorted(by_replica) == ["0", "1"], by_replica  # both replicas generated part of the step
        assert not by_replica["0"] & by_replica["1"] and len(by_replica["0"] | by_replica["1"]) == 4
        assert all(g % 2 == int(k) for k, gs in by_replica.items() for g in gs)
        assert r["trained_samples"] == len(shard) == 8 == r["samples"]  # the trainer's batch is the union
