"""The engine's prefix cache: requests that share a token prefix with computed K/V (a task's repeated prompt,
the next turn of a multi-turn episode) skip its prefill and still generate exactly what a cold engine does;
weight updates clear it; a full pool evicts cached blocks instead of refusing work."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout import SamplingParams
from tests.rollout.test_rollout_engine import (
    _init_single,
    assert_pool_empty,
    engine,
    full_logits,
    make_model,
    recomputed_logprobs,
)

PROMPT = [257, *range(20, 49)]  # 30 tokens: 7 full blocks of 4


@pytest.fixture(scope="module")
def pgs():
    return _init_single()


@pytest.fixture(scope="module")
def model(pgs):
    return make_model(pgs, seed=3)


def _run(eng, prompt, **kw):
    (out,) = eng.generate([prompt], SamplingParams(**{"temperature": 0.0, "max_new_tokens": 6, **kw}))
    return out.samples[0]


def test_second_turn_prefills_only_its_new_tokens_and_matches_a_cold_engine(model, pgs):
    eng, cold = engine(model, pgs), engine(model, pgs, prefix_cache=False)
    first = _run(eng, PROMPT)
    hit0 = eng.stats()["prefix_hit_tokens"]
    context = PROMPT + first.token_ids + [30, 31, 32, 33, 34]  # the episode so far + an observation
    second = _run(eng, context, temperature=1.0, seed=5)
    hit = eng.stats()["prefix_hit_tokens"] - hit0
    # the first request's computed tokens (30 + 5: its last sampled token never ran) hold 8 full blocks
    assert hit0 == 0 and hit == 32
    ref = _run(cold, context, temperature=1.0, seed=5)
    assert second.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(second.logprobs), recomputed_logprobs(model, context, second.token_ids),
                               atol=1e-4, rtol=0)
    assert cold.stats()["prefix_hit_tokens"] == 0
    assert_pool_empty(cold)


def test_repeated_prompt_shares_its_blocks_and_a_weight_update_clears_them(model, pgs):
    eng = engine(model, pgs)
    a = _run(eng, PROMPT)
    b = _run(eng, PROMPT)
    assert a.token_ids == b.token_ids and eng.stats()["prefix_hit_tokens"] == 28
    assert int(full_logits(model, PROMPT)[-1].argmax()) == a.token_ids[0]
    eng.update_weights(1, model.named_parameters(), policy="continue")
    _run(eng, PROMPT)
    assert eng.stats()["prefix_hit_tokens"] == 28  # nothing shared across the update


def test_a_full_pool_evicts_cached_blocks(model, pgs):
    eng = engine(model, pgs, num_blocks=12)  # 48 token slots: one 30+6 sequence at a time
    outs = [_run(eng, [257, *range(60 + 3 * i, 89 + 3 * i)]) for i in range(4)]  # distinct prompts fill the cache
    assert all(len(o.token_ids) == 6 for o in outs)
    assert eng.cache.num_free == 12 and len(eng.cache.allocator.cached) > 0
    last = _run(eng, [257, *range(69, 98)])  # == the 4th prompt: still cached, 7 blocks shared
    assert last.token_ids == outs[3].token_ids and eng.stats()["prefix_hit_tokens"] == 28
