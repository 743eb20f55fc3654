"""DeepSeek-V3 / Kimi-K2 in the trainer (one process, CPU): Megatron-Core's multi-latent attention with YaRN,
the sigmoid router with its expert bias, grouped top-k, routed scaling, shared experts and first-k dense layers,
on the local spec; the refusals of impossible settings and layouts (naming the key); model.init=hf:DIR of a
DeepseekV3ForCausalLM folder gives transformers' logits; the rollout engine serves MLA on the local spec
only, and `megatron-rl train` refuses it with TE up front.

Parallel layouts (TP2, EP2, PP2) are compared with this one-process run in tests/trainer/test_trainer_multiproc.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.gpt import MLAConfig, ModelConfig, MoEConfig, RopeScaling
from megatron_rl.parallel import ParallelConfig


def tiny_dsv3(**moe_changes) -> ModelConfig:
    """3 layers (the first dense), MLA with q/kv latents and YaRN, 8 sigmoid experts in 4 groups, top-4."""
    moe = dict(num_experts=8, topk=4, ffn_hidden_size=16, shared_expert_ffn_hidden_size=16, layer_pattern=[0, 1, 1],
               router_score_function="sigmoid", router_expert_bias=True, router_num_groups=4, router_group_topk=2,
               routed_scaling_factor=2.5)
    return ModelConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=128, max_seq_length=64,
        tie_embeddings=False, rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16,
                                                       mscale=1.0, mscale_all_dim=1.0),
        mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8),
        moe=MoEConfig(**{**moe, **moe_changes}))


@pytest.fixture(scope="module")
def ctx():
    from megatron_rl.convert.runtime import start

    return start()


def build(cfg: ModelConfig, ctx, bias_seed: int = 3):
    """The model with weights from their names (same across builds) and a random expert bias."""
    from megatron.core import tensor_parallel

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.models.gpt import build_gpt

    cfg.validate()
    cfg.moe.validate()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg, ctx.parallel, ctx.pgs)
    init_weights_by_name(model, 1234)
    g = torch.Generator().manual_seed(bias_seed)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            if name.endswith("router.expert_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.2)
    return model


def logits(model, ctx) -> torch.Tensor:
    from megatron_rl.convert.runtime import megatron_logits

    toks = torch.randint(128, (2, 48), generator=torch.Generator().manual_seed(0))
    return megatron_logits(model, toks, ctx)  # [b, s, V]


@pytest.mark.slow
def test_tiny_deepseek_v3_builds_and_trains_on_cpu(ctx):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    model = build(tiny_dsv3(), ctx)
    layers = model.decoder.layers
    assert all(isinstance(layer.self_attention, MLASelfAttention) for layer in layers)
    assert not hasattr(layers[0].mlp, "router") and layers[1].mlp.router.expert_bias.shape == (8,)
    assert layers[1].mlp.shared_experts is not None and model.config.moe_router_topk_scaling_factor == 2.5
    assert "decoder.layers.1.mlp.router.expert_bias" in model.sharded_state_dict()  # checkpointed
    model.train()
    toks = torch.randint(128, (2, 40), generator=torch.Generator().manual_seed(1))
    out = model(toks, torch.arange(40).expand(2, 40), None)  # [b, s, V]
    out.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert [n for n, g in grads.items() if g is None or not torch.isfinite(g).all()] == []
    assert [n for n, g in grads.items() if g.abs().max() == 0] == []  # every weight (latents, router...) learns


@pytest.mark.parametrize("change", [
    dict(routed_scaling_factor=None), dict(router_num_groups=None, router_group_topk=None), "expert_bias"])
def test_each_router_feature_changes_the_logits(change, ctx):
    """Megatron computes what the settings say: dropping any one of them changes the output."""
    base = logits(build(tiny_dsv3(), ctx), ctx)
    other = build(tiny_dsv3(), ctx, bias_seed=4) if change == "expert_bias" else build(tiny_dsv3(**change), ctx)
    assert (logits(other, ctx) - base).abs().max() > 1e-3


def test_yarn_changes_mla_logits(ctx):
    base = logits(build(tiny_dsv3(), ctx), ctx)
    plain = build(dataclasses.replace(tiny_dsv3(), rope_scaling=RopeScaling()), ctx)
    assert plain.config.rope_type == "rope" and (logits(plain, ctx) - base).abs().max() > 1e-3


@pytest.mark.parametrize("change, words", [
    (dict(num_query_groups=2), "model.num_query_groups=2 does not apply to multi-latent attention"),
    (dict(head_dim=16), "model.head_dim=16 does not apply"),
    (dict(qk_layernorm=True), "model.qk_layernorm=True does not apply"),
    (dict(sliding_window=8), "model.sliding_window=8 does not apply"),
    (dict(rope_scaling=RopeScaling(kind="linear", factor=2.0)), "model.rope_scaling.kind='linear' does not apply"),
    (dict(rope_scaling=RopeScaling(kind="yarn", factor=4.0, mscale_all_dim=1.0)), "mscale_all_dim without mscale"),
    (dict(mla=MLAConfig(kv_lora_rank=16, qk_pos_emb_head_dim=3)), "model.mla.qk_pos_emb_head_dim=3"),
])
def test_mla_settings_it_cannot_honour_are_refused(change, words):
    with pytest.raises(ConfigError, match=words):
        dataclasses.replace(tiny_dsv3(), **change).validate()


@pytest.mark.parametrize("change, words", [
    (dict(router_score_function="softmax"), "moe.router_expert_bias needs moe.router_score_function=sigmoid"),
    (dict(router_group_topk=None), "router_num_groups and moe.router_group_topk are set together"),
    (dict(router_num_groups=3), "router_num_groups=3 must divide num_experts=8"),
    (dict(router_group_topk=3, router_num_groups=4), "router_group_topk=3 must divide moe.topk=4"),
    (dict(router_bias_update_rate=-1.0), "router_bias_update_rate=-1.0 must be >= 0"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 must be > 0"),
    (dict(router_pre_softmax=True), "router_pre_softmax applies to softmax routing only"),
])
def test_router_settings_it_cannot_honour_are_refused(change, words):
    with pytest.raises(ConfigError, match=words):
        tiny_dsv3(**change).moe.validate()


@pytest.mark.parametrize("par, words", [
    (dict(tp=3), "num_attention_heads=4 is not divisible by parallel.tp=3"),
    (dict(cp=2), "parallel.cp=2 with multi-latent attention"),
    (dict(tp=2), "parallel.sequence_parallel=false with MoE at parallel.tp=2"),
])
def test_impossible_layouts_are_refused_naming_the_key(par, words):
    with pytest.raises(ConfigError, match=words):
        tiny_dsv3().check_parallel(ParallelConfig(**par))
        tiny_dsv3().check_training(ParallelConfig(**par))
    tiny_dsv3().check_training(ParallelConfig(tp=2, sequence_parallel=True))
    cfg = dataclasses.replace(tiny_dsv3(), num_attention_heads=6, mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24,
                                                                             qk_head_dim=8, qk_pos_emb_head_dim=6))
    with pytest.raises(ConfigError, match=r"kv_lora_rank \+ qk_pos_emb_head_dim=22 is not divisible by parallel.tp=3"):
        cfg.check_parallel(ParallelConfig(tp=3))


def test_mtp_is_served_at_pp2_and_refused_with_context_parallelism():
    mtp = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, mtp_num_layers=1)
    mtp.check_parallel(ParallelConfig(pp=2))  # parity: tests/trainer/test_trainer_multiproc.py (pp2_mtp)
    with pytest.raises(ConfigError, match="mtp_num_layers=1 with parallel.cp=2: the multi-token-prediction loss"):
        mtp.check_parallel(ParallelConfig(cp=2))


def test_expert_bias_update_runs_in_finalize_model_grads(ctx):
    """router_bias_update_rate > 0: Megatron's finalize_model_grads (the trainer's finalize_model_grads_func)
    moves each expert's bias by the rate towards balance; the default 0 keeps the loaded bias."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    for rate in (0.0, 0.01):
        model = build(tiny_dsv3(router_bias_update_rate=rate), ctx)
        ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(),
                                      module=model, pg_collection=ctx.pgs)
        before = model.decoder.layers[1].mlp.router.expert_bias.clone()
        toks = torch.randint(128, (2, 40), generator=torch.Generator().manual_seed(1))
        ddp(toks, torch.arange(40).expand(2, 40), None).float().mean().backward()
        finalize_model_grads([ddp], pg_collection=ctx.pgs)
        step = (model.decoder.layers[1].mlp.router.expert_bias - before).abs().tolist()
        assert all(v < 1e-7 or abs(v - rate) < 1e-6 for v in step) and (max(step) > rate / 2) == (rate > 0), step


def test_model_init_from_a_deepseek_v3_folder_gives_transformers_logits(tmp_path, ctx):
    """model.init=hf:DIR: MLA and router settings come from config.json; the initializer loads the weights
    (expert bias included) and the model's logits equal DeepseekV3ForCausalLM's."""
    from megatron.core import tensor_parallel

    from megatron_rl.convert.runtime import megatron_logits
    from megatron_rl.convert.source import initializer, resolve
    from megatron_rl.convert.verify import load_hf
    from megatron_rl.models.gpt import build_gpt
    from tests.mp.convert_models import make_hf_model

    hf = make_hf_model("deepseek_v3", tmp_path / "hf")
    cfg = ModelConfig(init=f"hf:{hf}", max_seq_length=64)
    resolve(cfg)
    assert cfg.mla == MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    assert (cfg.moe.router_num_groups, cfg.moe.router_group_topk, cfg.moe.layer_pattern) == (4, 2, [0, 1, 1])
    assert cfg.rope_scaling.kind == "yarn" and cfg.moe.routed_scaling_factor == 2.5
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg, ctx.parallel, ctx.pgs)
    initializer(cfg)(model)
    toks = torch.randint(cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = megatron_logits(model, toks, ctx)  # [b, s, V]
        ref = load_hf(hf)[0](toks).logits
    assert (mine - ref).abs().max().item() < 1e-4 and ref.std().item() > 0.1
    with pytest.raises(ConfigError, match=r"model.mla=.* disagrees with the checkpoint"):
        resolve(ModelConfig(init=f"hf:{hf}", max_seq_length=64, mla=MLAConfig(kv_lora_rank=32)))


def test_rollout_engine_serves_mla_on_the_local_spec_only():
    """The engine serves MLA with the local spec (tests/rollout/test_rollout_engine.py); with TE it is refused before
    any rank starts (checked by `megatron-rl train`'s config validation)."""
    from megatron_rl.rollout.model_runner import check_servable

    check_servable(tiny_dsv3())
    with pytest.raises(ConfigError, match="serves multi-latent attention with the local layer spec only"):
        check_servable(dataclasses.replace(tiny_dsv3(), transformer_impl="transformer_engine"))


def test_train_config_with_an_mla_model_it_cannot_serve_is_refused_before_any_rank_starts():
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    argv = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=24", "model.mla.qk_head_dim=8",
            "model.mla.qk_pos_emb_head_dim=4", "model.mla.v_head_dim=8", "data.domain=arithmetic",
            "curriculum.enabled=false", "launch.nproc_per_node=1", "train.steps=0", "export.enabled=false"]
    assert C.load(RunConfig, None, argv).model.mla.enabled  # served: accepted
    with pytest.raises(ConfigError, match="local layer spec only"):
        C.load(RunConfig, None, [*argv, "model.transformer_impl=transformer_engine"])


# ------------------------------------------------------------------------------ multi-token prediction
def _mtp_policy(ctx):
    from megatron.core import tensor_parallel

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.trainer.policy import OptimConfig, Policy

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return Policy(dataclasses.replace(tiny_dsv3(), mtp_num_layers=1),
                  OptimConfig(lr=1e-2, distributed_optimizer=False), ctx, total_steps=8,
                  init=lambda m: init_weights_by_name(m, 1234))


def _mtp_trainer(policy, coeff: float, impl: str = "fused"):
    from megatron_rl.rl.config import LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer

    return RLTrainer(policy, RLConfig(loss=LossConfig(name="grpo"), packing=PackingConfig(max_tokens=48),
                                      logprob_impl=impl, mtp_loss_coeff=coeff))


@pytest.mark.slow
def test_mtp_layers_leave_the_main_logits_unchanged(ctx):
    """model.mtp_num_layers=1 builds Megatron's MTP block (eh_proj, norms, an MoE layer like the last); the
    forward's logits are those of the same model without it; under emit_mtp the depth's logits follow."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from megatron_rl.models.mtp import emit_mtp, split

    plain, model = build(tiny_dsv3(), ctx), build(dataclasses.replace(tiny_dsv3(), mtp_num_layers=1), ctx)
    assert isinstance(model.mtp, MultiTokenPredictionBlock) and len(model.mtp.layers) == 1
    assert hasattr(model.mtp.layers[0].transformer_layer.mlp, "router")  # DeepSeek-V3's MTP layer is MoE
    torch.testing.assert_close(logits(model, ctx), logits(plain, ctx), rtol=0, atol=0)
    toks = torch.randint(128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), emit_mtp(model):
        main, (depth,) = split(model(toks, torch.arange(40)[None], None), 40, 1)  # each [1, 40, V]
    torch.testing.assert_close(main, plain(toks, torch.arange(40)[None], None), rtol=0, atol=0)
    assert (depth - main).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["fused", "logits"])
def test_mtp_loss_trains_the_mtp_layers_only(impl, ctx):
    """rl.trainer.mtp_loss_coeff > 0: the MTP layers get gradients; every other gradient equals the coeff=0 run
    (the MTP loss reads detached trunk states: the policy gradient is the RL loss's alone)."""
    from tests.trainer.test_trainer import make_batch

    policy = _mtp_policy(ctx)
    grads = {c: _mtp_trainer(policy, c, impl).compute_gradients(make_batch())[1] for c in (0.0, 0.5)}
    mtp = [n for n in grads[0.5] if ".mtp." in n or n.startswith("mtp.")]
    assert mtp and all(grads[0.0][n].abs().max() == 0 for n in mtp)
    assert sum(grads[0.5][n].abs().max() > 0 for n in mtp) >= len(mtp) - 8  # (experts no token chose: none)
    for n, g in grads[0.5].items():
        if n not in mtp:
            torch.testing.assert_close(g, grads[0.0][n], rtol=0, atol=0, msg=n)


@pytest.mark.slow
def test_mtp_loss_is_logged_and_falls_over_rl_steps(ctx):
    from tests.trainer.test_trainer import make_batch

    trainer = _mtp_trainer(_mtp_policy(ctx), 1.0)
    losses = [trainer.step(make_batch())["mtp_loss"] for _ in range(4)]
    assert losses[0] > 1.0 and losses[-1] < losses[0] - 0.05, losses
    assert "mtp_loss" not in _mtp_trainer(_mtp_policy(ctx), 0.0).step(make_batch())
