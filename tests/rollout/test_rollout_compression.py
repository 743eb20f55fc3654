"""Context compression of multi-turn prompts: the function, the engine's per-request field and the server field."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, undocumented_fields
from megatron_rl.rollout import EngineConfig, RolloutEngine, SamplingParams
from megatron_rl.rollout.compression import CompressionConfig, CompressionRecord, compress_turns, restore
from tests.rollout.test_rollout_engine import _init_single, make_model

# 6 turns after a 1-token header: turn i = [10*i + 1, ..., 10*i + len_i]
LENS = [3, 5, 4, 6, 2, 3]


def _prompt():
    ids, bounds = [257], []
    for i, n in enumerate(LENS):
        bounds.append(len(ids))
        ids += [10 * i + 1 + j for j in range(n)]
    return ids, bounds


def test_keeps_first_and_last_turns_and_marks_the_middle():
    ids, bounds = _prompt()
    cfg = CompressionConfig(keep_first=1, keep_last=2, marker_token_ids=[300, 301])
    out, rec = compress_turns(ids, bounds, cfg)
    turn = lambda i: ids[bounds[i]:(bounds + [len(ids)])[i + 1]]  # noqa: E731
    assert out == [257] + turn(0) + [300, 301] + turn(4) + turn(5)
    assert rec.dropped_turns == [1, 2, 3] and rec.dropped_spans == [(bounds[1], bounds[4])]
    assert rec.inserted_at == 1 + LENS[0] and rec.inserted_token_ids == [300, 301]
    assert (rec.original_num_tokens, rec.num_tokens, rec.num_turns) == (len(ids), len(out), 6)
    assert restore(out, rec, ids) and not restore(out[:-1], rec, ids)


def test_short_contexts_are_left_alone():
    ids, bounds = _prompt()
    out, rec = compress_turns(ids, bounds, CompressionConfig(keep_first=3, keep_last=3))
    assert out == ids and rec.dropped_spans == [] and rec.num_tokens == len(ids)
    out, rec = compress_turns(ids, bounds, CompressionConfig(keep_first=1, keep_last=1, min_prompt_tokens=len(ids)))
    assert out == ids and rec.dropped_turns == []


def test_summarize_mode_uses_the_callback_on_the_dropped_turns():
    ids, bounds = _prompt()
    seen = []

    def summarize(turns):
        seen.append(turns)
        return [sum(len(t) for t in turns)]  # one "summary" token: the dropped length

    out, rec = compress_turns(ids, bounds, CompressionConfig(keep_first=2, keep_last=1, mode="summarize"), summarize)
    assert seen == [[ids[bounds[i]:bounds[i + 1]] for i in (2, 3, 4)]]
    assert rec.inserted_token_ids == [LENS[2] + LENS[3] + LENS[4]] and restore(out, rec, ids)
    with pytest.raises(ValueError, match="summarizer"):
        compress_turns(ids, bounds, CompressionConfig(mode="summarize", keep_first=0, keep_last=0))


@pytest.mark.parametrize("bounds,reason", [([], "non-empty"), ([0, 5, 5], "strictly increasing"),
                                           ([0, 99], r"\[0, 24\)"), ([0, 2.5], "integers")])
def test_bad_boundaries_are_rejected_with_a_reason(bounds, reason):
    ids, _ = _prompt()
    with pytest.raises(ValueError, match=reason):
        compress_turns(ids, bounds, CompressionConfig())


def test_config_is_documented_and_validated():
    assert undocumented_fields(CompressionConfig) == [] and undocumented_fields(CompressionRecord) == []
    with pytest.raises(ConfigError, match="keep_first"):
        CompressionConfig(keep_first=-1).validate()
    ids, bounds = _prompt()
    assert CompressionConfig(keep_first=0, keep_last=1).build()(ids, bounds)[0] == [257] + ids[bounds[5]:]


@pytest.fixture(scope="module")
def model():
    return make_model(_init_single(), seed=3), _init_single()


def test_engine_generates_from_the_compressed_prompt_and_reports_it(model):
    model, pgs = model
    ids, bounds = _prompt()
    cfg = CompressionConfig(keep_first=1, keep_last=2, marker_token_ids=[300])
    eng = RolloutEngine(model, EngineConfig(num_blocks=64, block_size=4), pgs.tp, pgs.cp)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    out = eng.generate([ids, ids], params, turn_boundaries=[bounds, None], compression=cfg)
    expected, rec = compress_turns(ids, bounds, cfg)
    assert out[0].prompt_token_ids == expected and out[0].compression == rec
    assert out[1].prompt_token_ids == ids and out[1].compression is None
    plain = eng.generate([expected], params)[0]  # the model saw exactly the compressed ids
    assert out[0].samples[0].token_ids == plain.samples[0].token_ids
    torch.testing.assert_close(out[0].samples[0].logprobs, plain.samples[0].logprobs, atol=1e-5, rtol=0)
    # ... and that changed the distributions it sampled from
    assert max(abs(a - b) for a, b in zip(out[0].samples[0].logprobs, out[1].samples[0].logprobs)) > 1e-3
    with pytest.raises(ValueError, match="turn_boundaries"):
        eng.add_request(ids, params, compression=cfg)
    with pytest.raises(ValueError, match="compression"):
        eng.add_request(ids, params, turn_boundaries=bounds)


@pytest.mark.slow
def test_server_compression_field(model):
    from megatron_rl.rollout.client import RolloutClient, RolloutError
    from megatron_rl.rollout.server import ServerThread

    model, pgs = model
    ids, bounds = _prompt()
    srv = ServerThread(RolloutEngine(model, EngineConfig(num_blocks=64, block_size=4), pgs.tp, pgs.cp)).start()
    try:
        client = RolloutClient(srv.url, timeout=60, retries=0, token=srv.token)
        out = client.complete(ids, max_tokens=4, temperature=0, turn_boundaries=bounds,
                              compression={"keep_first": 1, "keep_last": 1, "marker_token_ids": "[.]"})
        expected, rec = compress_turns(ids, bounds, CompressionConfig(1, 1, marker_token_ids=list(b"[.]")))
        assert out["prompt_token_ids"] == expected and out["compression"] == rec.to_dict()
        assert out["usage"]["prompt_tokens"] == len(expected)
        with pytest.raises(RolloutError, match="keep_lst") as err:
            client.complete(ids, max_tokens=2, turn_boundaries=bounds, compression={"keep_lst": 1})
        assert err.value.status == 400
        with pytest.raises(RolloutError, match="strictly increasing"):
            client.complete(ids, max_tokens=2, turn_boundaries=[3, 1], compression={})
    finally:
        srv.stop()
