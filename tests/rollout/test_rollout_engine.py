"""Rollout engine on one CPU process: paged, continuously batched generation from the trainer's GPTModel.

References are computed with the same model's plain full forward (`GPTModel.forward`, no cache).
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.gpt import ModelConfig, build_gpt
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout import EngineConfig, RolloutEngine, SamplingParams
from megatron_rl.rollout.sampling import filtered_logprobs

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=384,
                    max_seq_length=128)
PROMPTS = [[257, *range(10 + 7 * i, 10 + 7 * i + n)] for i, n in enumerate([2, 9, 4, 17, 1, 12])]


def _init_single():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        from megatron_rl.distributed import init_distributed

        init_distributed(ParallelConfig(), source="single")
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return ProcessGroupCollection.use_mpu_process_groups()


def make_model(pgs, seed: int):
    from megatron_rl.compat.testing import init_weights_by_name

    model = build_gpt(MODEL, ParallelConfig(), pgs)
    init_weights_by_name(model, seed=seed)
    with torch.no_grad():  # sharper distributions than the default init: greedy ties would be meaningless
        model.embedding.word_embeddings.weight.mul_(3)
    return model.eval()


@pytest.fixture(scope="module")
def pgs():
    return _init_single()


@pytest.fixture(scope="module")
def model(pgs):
    return make_model(pgs, seed=3)


def engine(model, pgs, **kw) -> RolloutEngine:
    cfg = EngineConfig(**{"num_blocks": 64, "block_size": 4, "max_tokens_per_step": 24, **kw})
    return RolloutEngine(model, cfg, pgs.tp, pgs.cp)


@torch.no_grad()
def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits [L, V] of a plain no-cache forward."""
    ids = torch.tensor([tokens])  # [1, L]
    return model(ids, torch.arange(len(tokens))[None], attention_mask=None)[0].float()


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(full_logits(model, toks)[-1].argmax()))
    return toks[len(prompt):]


def recomputed_logprobs(model, prompt, generated, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Log-probs [G] of `generated` under one full forward over prompt + generated."""
    logits = full_logits(model, prompt + generated)[len(prompt) - 1:-1]  # [G, V]
    g = len(generated)
    lp = filtered_logprobs(logits, torch.full((g,), float(temperature)), torch.full((g,), top_k),
                           torch.full((g,), float(top_p)))  # [G, V]
    return lp.gather(1, torch.tensor(generated)[:, None])[:, 0]


def assert_pool_empty(eng: RolloutEngine):
    assert eng.cache.num_free == eng.cache.num_blocks
    assert all(r == 0 for r in eng.cache.allocator.refcount)


def test_greedy_equals_naive_no_cache_loop(model, pgs):
    eng = engine(model, pgs, max_tokens_per_step=8)  # forces chunked prefill mixed with decodes
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    for prompt, out in zip(PROMPTS, outs):
        s = out.samples[0]
        assert s.token_ids == naive_greedy(model, prompt, 10), prompt
        assert s.finish_reason == "length" and s.policy_versions == [0] * 10
        ref = recomputed_logprobs(model, prompt, s.token_ids)  # greedy reports plain log-softmax
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)
    assert len({tuple(o.samples[0].token_ids) for o in outs}) > 1  # not a degenerate constant model
    assert_pool_empty(eng)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 20, 0.9)])
def test_sampled_logprobs_equal_full_forward_recomputation(model, pgs, temperature, top_k, top_p):
    eng = engine(model, pgs)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=11)
    outs = eng.generate(PROMPTS[:4], params)
    for prompt, out in zip(PROMPTS, outs):
        s = out.samples[0]
        ref = recomputed_logprobs(model, prompt, s.token_ids, temperature, top_k, top_p)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)
        assert all(lp > -1e30 for lp in s.logprobs)  # every sampled token was inside the kept set


def test_plain_temperature_logprobs_equal_trainer_logprobs(model, pgs):
    from megatron_rl.trainer.logprobs import token_logprobs_and_entropy

    out = engine(model, pgs).generate([PROMPTS[3]], SamplingParams(temperature=0.8, max_new_tokens=20, seed=2))[0]
    gen = out.samples[0].token_ids
    logits = full_logits(model, PROMPTS[3] + gen)[len(PROMPTS[3]) - 1:-1]  # [G, V]
    ref, _ = token_logprobs_and_entropy(logits, torch.tensor(gen), None, temperature=0.8)
    torch.testing.assert_close(torch.tensor(out.samples[0].logprobs), ref.float(), atol=1e-5, rtol=0)


def test_top_k_top_p_filter_matches_brute_force():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3  # [3, 50]
    lp = filtered_logprobs(logits, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([5, 0, 0]),
                           torch.tensor([1.0, 1.0, 0.6]))
    assert (lp[0] > -float("inf")).sum() == 5
    torch.testing.assert_close(lp[1], torch.log_softmax(logits[1] / 0.5, -1))
    p = torch.softmax(logits[2], -1)
    order = p.argsort(descending=True)
    keep = int((p[order].cumsum(0) < 0.6).sum()) + 1  # smallest prefix reaching 0.6
    assert (lp[2] > -float("inf")).sum() == keep
    torch.testing.assert_close(lp[2][order[:keep]].exp().sum(), torch.tensor(1.0))


@pytest.mark.slow
def test_nearly_full_pool_queues_and_preempts_and_frees_every_block(model, pgs):
    prompts = [[257, *range(20 + i, 20 + i + 3 * (i % 5) + 1)] for i in range(12)]
    params = [SamplingParams(temperature=0, max_new_tokens=8 + 2 * (i % 4)) for i in range(12)]
    big = engine(model, pgs, num_blocks=256).generate(prompts, params)
    small = engine(model, pgs, num_blocks=14, max_tokens_per_step=32)  # one long sequence needs 7 blocks
    outs = small.generate(prompts, params)
    for a, b in zip(big, outs):
        assert a.samples[0].token_ids == b.samples[0].token_ids
        torch.testing.assert_close(b.samples[0].logprobs, a.samples[0].logprobs, atol=1e-5, rtol=0)
    assert small.scheduler.num_preemptions > 0
    assert_pool_empty(small)


def test_n_samples_share_prompt_blocks_without_corrupting_siblings(model, pgs):
    prompt = PROMPTS[3]  # 18 tokens: 4 full blocks + a shared partial block (copy-on-write)
    eng = engine(model, pgs)
    rid = eng.add_request(prompt, SamplingParams(temperature=3.0, max_new_tokens=12, seed=5, n=4))
    max_shared, outs = 0, []
    while eng.has_work:
        outs += eng.step()
        max_shared = max(max_shared, max(eng.cache.allocator.refcount))
    assert max_shared == 4  # the full prompt blocks were shared by all four samples
    (out,) = outs
    assert out.request_id == rid and [s.index for s in out.samples] == [0, 1, 2, 3]
    assert len({tuple(s.token_ids) for s in out.samples}) > 1
    for s in out.samples:
        params = SamplingParams(temperature=3.0, max_new_tokens=12, seed=5 + s.index)
        single = engine(model, pgs).generate([prompt], params)
        assert single[0].samples[0].token_ids == s.token_ids
        torch.testing.assert_close(single[0].samples[0].logprobs, s.logprobs, atol=1e-5, rtol=0)
    assert_pool_empty(eng)


def test_forked_samples_count_against_max_running(model, pgs):
    """max_running bounds the sequences decoding at once, forked siblings included (they were added past it:
    n=4 requests at max_running=6 ran 24 sequences together); a request of more samples than that is refused."""
    eng = engine(model, pgs, max_running=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1, n=4)
    for p in PROMPTS:
        eng.add_request(p, params)
    most, outs = 0, []
    while eng.has_work:
        outs += eng.step()
        most = max(most, len(eng.scheduler.running))
    assert most == 4 and len(outs) == len(PROMPTS)  # one request's 4 samples at a time: a second would be 8
    assert all(len(o.samples) == 4 for o in outs)
    assert_pool_empty(eng)
    with pytest.raises(ValueError, match="n=7 samples of one request exceed engine.max_running=6"):
        eng.add_request(PROMPTS[0], SamplingParams(n=7))
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    C.load(RunConfig, None, ["rl.group_size=8", "engine.max_running=8"])
    with pytest.raises(ConfigError, match=r"engine.max_running=4 is below .* set engine.max_running >= 8"):
        C.load(RunConfig, None, ["rl.group_size=8", "engine.max_running=4"])  # refused before any rank starts


def test_stop_tokens_and_stop_sequences(model, pgs):
    free = engine(model, pgs).generate([PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=12))[0]
    gen = free.samples[0].token_ids
    eng = engine(model, pgs)
    by_token, by_seq = eng.generate([PROMPTS[1]] * 2, [
        SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[gen[4]]),
        SamplingParams(temperature=0, max_new_tokens=12, stop=[gen[5:7]])])
    first = gen.index(gen[4])
    assert by_token.samples[0].token_ids == gen[:first + 1] and by_token.samples[0].finish_reason == "stop"
    assert by_seq.samples[0].token_ids[-2:] == gen[5:7] and by_seq.samples[0].finish_reason == "stop"
    assert_pool_empty(eng)


def _run_with_update(model, pgs, new_state, at_step: int, policy: str):
    eng = engine(model, pgs)
    eng.add_request(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=14))
    outs = []
    for _ in range(at_step):
        outs += eng.step()
    eng.update_weights(1, new_state.items(), policy=policy)
    while eng.has_work:
        outs += eng.step()
    return eng, outs[0].samples[0]


def test_weight_update_mid_stream_continue_and_abort(pgs):
    old, new = make_model(pgs, seed=3), make_model(pgs, seed=4)
    new_state = {k: v.detach().clone() for k, v in new.named_parameters()}
    eng, s = _run_with_update(make_model(pgs, seed=3), pgs, new_state, at_step=6, policy="continue")
    k = s.policy_versions.index(1)
    assert k == 6 and s.policy_versions == [0] * k + [1] * (14 - k)  # step 1 = prefill + first token
    assert s.token_ids[:k] == naive_greedy(old, PROMPTS[2], k)
    assert s.token_ids[k:] == naive_greedy(new, PROMPTS[2] + s.token_ids[:k], 14 - k)
    assert_pool_empty(eng)
    eng, s = _run_with_update(make_model(pgs, seed=3), pgs, new_state, at_step=3, policy="abort")
    assert s.finish_reason == "abort" and len(s.token_ids) == 3
    assert_pool_empty(eng)


def test_bad_input_is_rejected_with_a_reason(model, pgs):
    eng = engine(model, pgs, num_blocks=8)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 999], SamplingParams())
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request([1] * 20, SamplingParams(max_new_tokens=30))
    with pytest.raises(ConfigError, match="top_p"):
        eng.add_request([1], SamplingParams(top_p=0))
    with pytest.raises(KeyError, match="no parameter"):
        eng.update_weights(1, [("decoder.nope.weight", torch.zeros(1))])
    assert eng.abort("unknown") is False


@pytest.mark.parametrize("rope", [dict(kind="yarn", factor=4.0, original_max_position_embeddings=16),
                                  dict(kind="llama3", factor=8.0, original_max_position_embeddings=32),
                                  dict(kind="linear", factor=2.0)], ids=["yarn", "llama3", "linear"])
def test_rope_scaling_logprobs_equal_full_forward(pgs, rope):
    """Long-context RoPE (YaRN's concentration factor included) is applied in the engine as in training."""
    from dataclasses import replace

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.models.gpt import RopeScaling

    cfg = replace(MODEL, rope_scaling=RopeScaling(**rope))
    model = build_gpt(cfg, ParallelConfig(), pgs)
    init_weights_by_name(model, seed=3)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(3)
    model.eval()
    plain = make_model(pgs, seed=3)
    prompt = PROMPTS[3] * 3  # 54 tokens: past the original context of the scaled kinds
    assert (full_logits(model, prompt) - full_logits(plain, prompt)).abs().max() > 1e-3  # scaling in effect
    out = engine(model, pgs).generate([prompt], SamplingParams(temperature=0.9, max_new_tokens=12, seed=5))[0]
    ref = recomputed_logprobs(model, prompt, out.samples[0].token_ids, 0.9)
    torch.testing.assert_close(torch.tensor(out.samples[0].logprobs), ref, atol=1e-5, rtol=0)


def test_sliding_window_model_is_refused_by_the_engine(pgs):
    from dataclasses import replace

    model = build_gpt(replace(MODEL, sliding_window=8), ParallelConfig(), pgs)
    with pytest.raises(ValueError, match="sliding-window"):
        engine(model, pgs)


@pytest.mark.slow  # an MLA model's full forward against the engine's: ~10 s
def test_mla_model_logprobs_equal_full_forward(pgs):
    """DeepSeek-V3 in miniature (MLA with YaRN over the compressed-latent cache, sigmoid-routed MoE): sampled
    log-probs equal a full no-cache forward; shared prompt blocks (n=2) and continuous batching included."""
    from dataclasses import replace

    from megatron_rl.compat.testing import init_weights_by_name
    from tests.models.test_deepseek_v3 import tiny_dsv3

    cfg = replace(tiny_dsv3(), vocab_size=384, max_seq_length=128)
    model = build_gpt(cfg, ParallelConfig(), pgs)
    init_weights_by_name(model, seed=3)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(3)
    model.eval()
    eng = engine(model, pgs)
    assert eng.cache.kv.shape[1:] == (1, 64, 4, 1, 16 + 4)  # one latent + RoPE-key row per token
    prompts = [PROMPTS[3] * 2, PROMPTS[1], PROMPTS[4]]
    outs = eng.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=10, seed=5, n=2))
    for prompt, out in zip(prompts, outs):
        for sample in out.samples:
            ref = recomputed_logprobs(model, prompt, sample.token_ids, 0.9)
            torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=1e-5, rtol=0)
    assert_pool_empty(eng)


def test_bf16_engine_serves_fp32_weights_with_fp32_logprobs(model, pgs):
    """`rollout.engine.dtype: bf16` (the run config key; loop/job.py builds the engine with it): bf16 weights
    and KV cache synced from an fp32 policy, log-softmax in fp32; log-probs close to the fp32 full forward's."""
    eng = RolloutEngine.build(MODEL, EngineConfig(num_blocks=64, block_size=4, max_tokens_per_step=24, dtype="bf16"),
                              ParallelConfig(), pgs)
    eng.update_weights(1, model.named_parameters(), complete=True)  # the weight sync casts fp32 -> bf16
    matrices = [p for p in eng.model.parameters() if p.dim() > 1]  # (the norms' weights stay fp32, as in training)
    assert {p.dtype for p in matrices} == {torch.bfloat16} and eng.cache.kv.dtype == torch.bfloat16
    outs = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, seed=5))
    diffs = []
    for prompt, out in zip(PROMPTS, outs):
        s = out.samples[0]
        ref = recomputed_logprobs(model, prompt, s.token_ids)  # the fp32 policy's
        diffs.append((torch.tensor(s.logprobs) - ref).abs())
    diffs = torch.cat(diffs)
    assert 0 < diffs.max() < 0.1, diffs.max()  # bf16 rounding, not fp32 (0) and not a wrong model (>> 0.1)
    assert diffs.mean() < 0.02, diffs.mean()
    assert_pool_empty(eng)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_tabulated_once_per_step_equals_megatrons_rope_bitwise(model, pgs, interleaved, monkeypatch):
    """The runner's (cos, sin) of a step, applied to every layer, give exactly Megatron's unfused RoPE
    (apply_rotary_pos_emb), also with a pass-through part (partial rotary)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_rl.rollout.model_runner import ModelRunner

    runner = ModelRunner(model, pgs.tp, pgs.cp)
    monkeypatch.setattr(model.config, "rotary_interleaved", interleaved)
    positions = torch.tensor([0, 5, 3, 77, 127])
    cos, sin = runner._rope(positions)  # each [5, 1, 1, 16]
    t = torch.randn(5, 1, 4, 16, generator=torch.Generator().manual_seed(0))  # [T, 1, n, d]
    for r in (16, 8):  # full, then half the head rotated
        want = apply_rotary_pos_emb(t, runner._freqs[positions][..., :r], config=model.config, cp_group=pgs.cp)
        got = runner._apply_rope(t, (cos[..., :r], sin[..., :r]))
        assert torch.equal(got, want) and not torch.equal(got, t)
