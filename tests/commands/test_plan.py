"""`megatron-rl plan`: parameter counts against published figures, memory terms, fit verdicts, search, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, undocumented_fields
from megatron_rl.parallel import ParallelConfig
from megatron_rl.tools.plan import main
from megatron_rl.tools.plan.count import Arch
from megatron_rl.tools.plan.memory import plan_layout, rank_chunks, resolve_layout
from megatron_rl.tools.plan.search import search
from megatron_rl.tools.plan.spec import PlanConfig, load_plan_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "plan"


def _load(name: str, *overrides: str) -> tuple[PlanConfig, Arch]:
    cfg = load_plan_config(CONFIGS / f"{name}.yaml", list(overrides))
    return cfg, Arch(cfg.model, cfg.arch)


def _plan(cfg: PlanConfig, arch: Arch, recompute: str | None = None):
    return plan_layout(cfg, arch, resolve_layout(cfg, arch, cfg.parallel, recompute or cfg.train.recompute))


# ------------------------------------------------------------------------------------------ counts
@pytest.mark.parametrize("name, total, active, tol", [
    ("llama3_8b", 8.03e9, None, 0.01),
    ("llama3_70b", 70.6e9, None, 0.01),
    ("deepseek_v3_671b", 671e9, 37e9, 0.01),
    ("kimi_k2_1t", 1.04e12, 32e9, 0.02),
    ("qwen3_235b_a22b", 235e9, 22e9, 0.01),
    ("glm45_355b_a32b", 355e9, None, 0.01),
])
def test_parameter_counts_match_published(name, total, active, tol):
    _, arch = _load(name)
    assert abs(arch.total_params / total - 1) < tol, arch.total_params
    if active is not None:
        # active = matmul parameters per token (input-embedding lookup excluded); published figures are
        # rounded to the nearest billion, so DeepSeek-V3's 36.6B reads "37B" (1.0% off, inside the rounding).
        assert abs(arch.active_params / active - 1) < max(tol, 0.5e9 / active), arch.active_params


def test_glm45_active_is_its_decoder_layers():
    """GLM-4.5's "32B active" counts the decoder layers' per-token parameters (top-8 + shared expert),
    without the output layer (32.08B); with it the matmul figure is 32.86B."""
    _, arch = _load("glm45_355b_a32b")
    assert abs((arch.active_params - arch.embedding) / 32e9 - 1) < 0.01, arch.active_params
    assert arch.layer_kinds()[:4] == ("dense", "dense", "dense", "moe") and arch.layer_kinds()[-1] == "mtp"


def test_model_head_dim_is_honoured():
    cfg, arch = _load("qwen3_235b_a22b")
    assert arch.head_dim == 128 != cfg.model.hidden_size // cfg.model.num_attention_heads
    narrow, _ = _load("qwen3_235b_a22b", "model.head_dim=null")
    assert Arch(narrow.model, narrow.arch).total_params < 0.99 * arch.total_params   # 231.7B: the old bug
    with pytest.raises(ConfigError, match="arch.kv_channels=64 contradicts model.head_dim=128"):
        _load("qwen3_235b_a22b", "arch.kv_channels=64")


def test_deepseek_v3_mtp_is_counted_separately():
    _, arch = _load("deepseek_v3_671b")
    # one MoE layer (11.5B) + the 2h->h projection; 671B + MTP + its HF copies of embedding/head ~ 685B
    assert 11.5e9 < arch.mtp_params < 11.7e9
    assert abs((arch.total_params + arch.mtp_params + 2 * arch.embedding) / 685e9 - 1) < 0.01


def test_dense_active_equals_total_minus_embedding_lookup():
    _, arch = _load("llama3_8b")
    norms = arch.norm * (2 * arch.model.num_layers + 1)
    assert arch.active_params == arch.total_params - arch.embedding - norms


# --------------------------------------------------------------------------------------------- fit
def test_deepseek_v3_fits_on_1024_h100_at_the_nemo_layout():
    cfg, arch = _load("deepseek_v3_671b")
    p = cfg.parallel
    assert (cfg.cluster.gpus, cfg.cluster.gpu, p.tp, p.pp, p.vpp, p.ep) == (1024, "h100", 2, 8, 4, 64)
    plan = _plan(cfg, arch)
    assert plan.fits, plan.reason
    assert plan.total_gb <= 80 * (1 - cfg.cluster.margin)
    assert plan.layout.dp == 64 and plan.layout.expert_dp == 2


def test_deepseek_v3_pipeline_split_is_megatrons_layout():
    cfg, arch = _load("deepseek_v3_671b")
    assert cfg.parallel.pipeline_layout == "Et|(tt|)*30mL"
    for par in (cfg.parallel, ParallelConfig(pp=8, vpp=4)):  # the config's layout, and the refused even split
        ranks = rank_chunks(arch.layer_kinds(), par)
        sizes = [len(c) for r in range(4) for c in (ranks[i][r] for i in range(8))]
        assert sizes == [1] + [2] * 30 + [1]                   # "Et|(tt|)*30mL"
        assert ranks[7][3] == ("mtp",) and ranks[0][0] == ("dense",)


def test_deepseek_v3_published_layout_is_accepted_by_the_trainer(capsys):
    """The plan no longer notes a refusal: the trainer builds 61 layers over pp 8 x vpp 4 with the layout."""
    cfg, arch = _load("deepseek_v3_671b")
    plan = _plan(cfg, arch)
    assert plan.trainer_error is None and plan.fits
    assert main([str(CONFIGS / "deepseek_v3_671b.yaml")]) == 0
    text = capsys.readouterr().out
    assert "stages=Et|(tt|)*30mL" in text and "refuses" not in text
    # without the layout: refused, naming the reason and proposing exactly that layout
    cfg.parallel = ParallelConfig(tp=2, pp=8, vpp=4, ep=64, etp=1, sequence_parallel=True)
    err = _plan(cfg, arch).trainer_error
    assert "model.num_layers=61 is not divisible by parallel.pp*vpp = 32" in err and "'Et|(tt|)*30mL'" in err


def test_plan_places_layers_as_the_trainer_does():
    """An MTP model at an even split: the decoder layers evenly, the MTP module added to the last chunk."""
    cfg, arch = _load("deepseek_v3_671b", "model.num_layers=64", "parallel.pipeline_layout=null")
    ranks = rank_chunks(arch.layer_kinds(), cfg.parallel)
    assert [len(c) for r in ranks for c in r[:-1]] == [2] * 24 and ranks[7][3][-1] == "mtp" and len(ranks[7][3]) == 3
    par = ParallelConfig(pp=4, first_stage_layers=10, last_stage_layers=12)
    ranks = rank_chunks(arch.layer_kinds(), par)
    assert [len(r[0]) for r in ranks] == [10, 21, 21, 13]   # + MTP on the last


def test_too_small_layout_does_not_fit_and_names_the_term():
    cfg, arch = _load("deepseek_v3_671b", "parallel.pp=1", "parallel.vpp=null", "parallel.pipeline_layout=null",
                      "parallel.ep=8", "cluster.gpus=64",
                      "train.global_batch_size=512")
    plan = _plan(cfg, arch)
    assert not plan.fits
    assert "does not fit" in plan.reason and "largest term: gradients" in plan.reason
    assert plan.memory_gb["gradients"] > plan.usable_gb


def test_activations_too_big_is_the_reason():
    cfg, arch = _load("llama3_8b", "train.seq_length=131072", "model.max_seq_length=131072")
    plan = _plan(cfg, arch, "none")
    assert not plan.fits and "largest term: activations" in plan.reason
    assert _plan(cfg, arch, "full").memory_gb["activations"] < plan.memory_gb["activations"] / 4


# ---------------------------------------------------------------------------------- memory scaling
def test_doubling_tp_halves_dense_weights():
    cfg, arch = _load("llama3_70b", "parallel.tp=4", "parallel.pp=1", "parallel.vpp=null", "cluster.gpus=64")
    w4 = _plan(cfg, arch).memory_gb
    cfg8, _ = _load("llama3_70b", "parallel.tp=8", "parallel.pp=1", "parallel.vpp=null", "cluster.gpus=64")
    w8 = _plan(cfg8, arch).memory_gb
    norms_gb = arch.norm * (2 * arch.model.num_layers + 1) * 2 / 1e9   # replicated over tp
    assert (w8["weights"] - norms_gb) == pytest.approx((w4["weights"] - norms_gb) / 2, rel=1e-9)
    assert w8["gradients"] == pytest.approx(w4["gradients"] * w8["weights"] / w4["weights"], rel=1e-9)


def test_distributed_optimizer_divides_optimizer_state_by_dp():
    cfg, arch = _load("llama3_8b", "cluster.gpus=8")     # tp 2 -> dp 4
    sharded = _plan(cfg, arch)
    cfg.train.distributed_optimizer = False
    full = _plan(cfg, arch)
    assert sharded.layout.dp == 4
    assert sharded.memory_gb["optimizer"] == pytest.approx(full.memory_gb["optimizer"] / 4, rel=1e-9)
    assert full.memory_gb["optimizer"] == pytest.approx(6 * full.memory_gb["weights"], rel=1e-9)  # 12 B vs 2 B


def test_expert_optimizer_state_divided_by_expert_dp():
    cfg, arch = _load("deepseek_v3_671b")
    base = _plan(cfg, arch).memory_gb["optimizer"]
    cfg2, _ = _load("deepseek_v3_671b", "cluster.gpus=2048", "train.global_batch_size=16384")
    doubled = _plan(cfg2, arch)
    assert doubled.layout.expert_dp == 4
    assert doubled.memory_gb["optimizer"] < 0.55 * base      # experts dominate: ~halved


def test_interleaving_adds_in_flight_activations():
    cfg, arch = _load("llama3_70b")          # pp 4, vpp 5
    inter = _plan(cfg, arch).memory_gb["activations"]
    cfg1, _ = _load("llama3_70b", "parallel.vpp=null")
    plain = _plan(cfg1, arch).memory_gb["activations"]
    assert plain < inter < plain * (1 + 3 / 4 / 5 + 0.05)  # factor 1 + (pp-1)/(pp*vpp) on the first stage


# ---------------------------------------------------------------------------------------- search
def test_search_returns_only_fitting_layouts_sorted():
    cfg, arch = _load("llama3_70b")
    plans, tried = search(cfg, arch)
    assert plans and tried > len(plans)
    assert all(p.fits and p.total_gb <= p.usable_gb for p in plans)
    times = [p.step["step_seconds"] for p in plans]
    assert times == sorted(times)
    assert {p.layout.recompute for p in plans} >= {"selective", "full"}


def test_search_proposes_only_layouts_the_trainer_accepts():
    """94 layers: where pp * vpp does not divide 94 (pp=4, pp=8) the candidate carries the uneven layout the
    trainer proposes; every candidate is one the trainer accepts."""
    from megatron_rl.tools.plan.search import candidate_layouts

    cfg, arch = _load("qwen3_235b_a22b")
    uneven = []
    for par in candidate_layouts(cfg, arch):
        cfg.model.check_parallel(par)                  # raises if the trainer would refuse it
        if par.pipeline_layout:
            uneven.append(par)
    assert any(p.pp in (4, 8) for p in uneven)
    plans, _ = search(cfg, arch, "selective")
    assert plans
    for p in plans:
        cfg.model.check_parallel(p.layout.parallel)    # raises if the trainer would refuse it
        assert p.trainer_error is None
        even = 94 % (p.layout.parallel.pp * p.layout.vpp) == 0
        assert even == (p.layout.parallel.pipeline_layout is None), p.layout.label()
    assert any(p.layout.parallel.pipeline_layout for p in plans)  # uneven pp x vpp offered, with its layout


def test_search_pins_recompute(capsys):
    assert main([str(CONFIGS / "tiny_cpu.yaml"), "--search", "--recompute", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plans"] and all(p["layout"]["recompute"] == "full" and p["fits"] for p in out["plans"])


# ----------------------------------------------------------------------------------------- CLI
def test_cli_deepseek_text_and_json(capsys):
    assert main([str(CONFIGS / "deepseek_v3_671b.yaml")]) == 0
    text = capsys.readouterr().out
    assert "671.03B params" in text and "fits:" in text and "weight sync" in text
    assert main([str(CONFIGS / "deepseek_v3_671b.yaml"), "--gpus", "1024", "--gpu", "h100",
                 "--layout", "tp=2,pp=8,vpp=4,ep=64,etp=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["fits"] and out["plan"]["layout"]["dp"] == 64
    assert set(out["plan"]["memory_gb"]) == {"weights", "gradients", "optimizer", "activations", "overhead"}
    assert out["rollout"]["kv_bytes_per_token"] == (512 + 64) * 61 * 2           # MLA latent cache
    assert out["rollout"]["weight_sync_gb"] == pytest.approx(2 * out["model"]["total_params"] / 1e9)


def test_readme_deepseek_example_fits_and_keeps_the_degrees(capsys):
    """`--layout tp=2,pp=8,vpp=4,ep=64` (README): etp=1 and sequence parallel kept from the config."""
    argv = [str(CONFIGS / "deepseek_v3_671b.yaml"), "--gpus", "1024", "--gpu", "h100", "--json"]
    assert main([*argv, "--layout", "tp=2,pp=8,vpp=4,ep=64"]) == 0
    out = json.loads(capsys.readouterr().out)["plan"]
    assert out["fits"] and out["layout"]["etp"] == 1 and out["layout"]["sequence_parallel"] is True
    assert out["trainer_accepts"] and out["layout"]["pipeline_layout"] == "Et|(tt|)*30mL"  # the config's split kept
    assert out["layout"]["chunk_layers"][0] == [1, 2, 2, 2] and out["layout"]["chunk_layers"][7] == [2, 2, 2, 0]
    main([*argv, "--layout", "pp=16,vpp=2"])     # another pp x vpp drops the split: refused, with a proposal
    out = json.loads(capsys.readouterr().out)["plan"]
    assert out["layout"]["pipeline_layout"] is None and not out["trainer_accepts"]
    assert "pp*vpp = 32" in out["trainer_error"] and "pipeline_layout: 'Et|(tt|)*30mL'" in out["trainer_error"]
    main([*argv, "--layout", "tp=2,pp=8,vpp=4,ep=64,etp=2,sp=0"])
    out = json.loads(capsys.readouterr().out)["plan"]["layout"]
    assert (out["etp"], out["sequence_parallel"], out["vpp"]) == (2, False, 4)
    main([*argv, "--layout", "ep=32"])                      # the other degrees stay the config's
    out = json.loads(capsys.readouterr().out)["plan"]["layout"]
    assert (out["tp"], out["pp"], out["vpp"], out["ep"], out["etp"]) == (2, 8, 4, 32, 1)
    assert main([*argv, "--layout", "pp=4,sp=2"]) == 2 and "sp=2" in capsys.readouterr().err


def test_cli_not_fitting_exits_1(capsys):
    code = main([str(CONFIGS / "deepseek_v3_671b.yaml"), "--gpus", "64", "--layout", "tp=1,pp=1,ep=8",
                 "--global-batch-size", "512"])
    assert code == 1 and "does not fit" in capsys.readouterr().out


@pytest.mark.parametrize("argv, key", [
    (["--gpus", "1000"], "tp*cp*pp"),                     # 16 does not divide 1000
    (["--layout", "tp=2,pp=8,ep=3"], "parallel.ep=3"),    # 3 does not divide 256 experts
    (["--gpu", "a100"], "--gpu"),
    (["--layout", "tp=2,xp=4"], "'xp'"),
    (["--layout", "tp=3"], "parallel.tp=3"),
])
def test_bad_input_names_the_key(argv, key, capsys):
    assert main([str(CONFIGS / "deepseek_v3_671b.yaml"), *argv]) == 2
    err = capsys.readouterr().err
    assert key in err, err


def test_unknown_config_key_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "kimi_k2_1t.yaml").read_text().replace("mtp_layers:", "mtp_layerz:"))
    assert main([str(bad)]) == 2
    assert "arch.mtp_layerz" in capsys.readouterr().err


def test_run_config_is_accepted(capsys):
    assert main([str(CONFIGS.parent / "demo_cpu.yaml"), "--json"]) == 0  # a run config (configs/), not a plan spec
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 2 and out["plan"]["layout"]["tp"] == 2 and out["plan"]["fits"]


def test_plan_config_fields_documented():
    assert undocumented_fields(PlanConfig) == []


def test_cli_entry_wired(capsys):
    from megatron_rl.cli import main as cli_main

    assert cli_main(["plan", "--help"]) == 0
    assert "--search" in capsys.readouterr().out


def test_shipped_configs_fit():
    for name in ("tiny_cpu", "llama3_8b", "llama3_70b", "deepseek_v3_671b", "kimi_k2_1t", "qwen3_235b_a22b",
                 "glm45_355b_a32b"):
        cfg, arch = _load(name)
        assert _plan(cfg, arch).fits, name
    for name in ("qwen3_235b_a22b", "glm45_355b_a32b", "deepseek_v3_671b", "kimi_k2_1t"):  # layouts the trainer builds
        cfg, arch = _load(name)
        assert _plan(cfg, arch).trainer_error is None, name


def test_config_error_type():
    with pytest.raises(ConfigError, match="cluster.gpu"):
        _load("tiny_cpu", "cluster.gpu=v100")
