"""Fast single-process tests of context parallelism's pieces: the load-balanced chunk split and merge, the
CP attention mask (emulating every CP rank in one process against full block-causal attention), CP packing
(per-sample padding to 2*cp, loss_mask 0 on pads, shares that merge back) and the refusals.

The Megatron-Core runs (CP=2, TP=2xCP=2, CP=2xDP=2 vs the one-process run) are in
tests/trainer/test_trainer_multiproc.py (test_cp2_matches_one_process,
test_world4_tp2_cp2_and_cp2_dp2_match_one_process).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.cp_attention import cp_attention_mask, cp_chunk_indices, cp_merge, cp_split
from megatron_rl.rl.config import LossConfig
from megatron_rl.trainer.packing import PackingConfig, attention_inputs, block_causal_mask, check_samples, pack
from megatron_rl.trainer.rl_step import RLConfig, check_cp_support
from tests.trainer.test_trainer import VOCAB, make_batch

CU = torch.tensor([0, 8, 12, 24, 32], dtype=torch.int32)  # segments 8, 4, 12, 8: multiples of 2*cp for cp=2


def test_chunk_indices_follow_megatron_load_balancing():
    # cp=2: 4 chunks per segment; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 of every segment
    assert cp_chunk_indices(CU, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23, 24, 25, 30, 31]
    assert cp_chunk_indices(CU, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20, 26, 27, 28, 29]
    one = torch.tensor([0, 12])
    assert cp_chunk_indices(one, 3, 1).tolist() == [2, 3, 8, 9]  # 6 chunks of 2: chunks 1 and 4


@pytest.mark.parametrize("cp", [1, 2])
def test_split_then_merge_is_identity_and_ranks_partition_the_slots(cp):
    x = torch.arange(3 * 32).view(3, 32)  # [b, S]
    parts = [cp_split(x, CU, cp, r) for r in range(cp)]
    assert all(p.shape == (3, 32 // cp) for p in parts)
    assert torch.equal(cp_merge(parts, CU), x)
    assert sorted(torch.cat([cp_chunk_indices(CU, cp, r) for r in range(cp)]).tolist()) == list(range(32))


def test_split_refuses_segments_not_multiple_of_2cp():
    with pytest.raises(ValueError, match="segment 1 has 6 slots, not a multiple of 2\\*cp = 4"):
        cp_chunk_indices(torch.tensor([0, 8, 14, 16]), 2, 0)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_mask_reproduces_block_causal_attention_on_every_rank(cp):
    """Each emulated CP rank: local queries x keys gathered in rank order under cp_attention_mask; the
    merged outputs equal full attention under the one-process block-causal mask."""
    cu = torch.tensor([0, 12, 18, 36, 48]) if cp == 3 else CU
    S, gen = int(cu[-1]), torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))  # [S, n, d]

    def attend(q, k, v, masked):  # q [sq, n, d], k/v [sk, n, d], masked [sq, sk]
        scores = torch.einsum("qnd,knd->nqk", q, k).masked_fill(masked, float("-inf"))
        return torch.einsum("nqk,knd->qnd", scores.softmax(-1), v)

    full = attend(q, k, v, block_causal_mask(cu, S)[0, 0])  # [S, n, d]
    k_all, v_all = (torch.cat([cp_split(t, cu, cp, r, dim=0) for r in range(cp)]) for t in (k, v))
    outs = []
    for r in range(cp):
        mask = cp_attention_mask(cu, cp, r)  # [S/cp, S]
        assert mask.shape == (S // cp, S)
        assert not mask.all(-1).any()  # every query sees at least itself
        outs.append(attend(cp_split(q, cu, cp, r, dim=0), k_all, v_all, mask))
    torch.testing.assert_close(cp_merge(outs, cu, dim=0), full, rtol=0, atol=1e-12)


def test_cp_mask_differs_from_a_plain_causal_mask_over_the_gathered_order():
    # a mask ignoring the load-balanced order (tril over the gathered keys) would be wrong: guard against it
    mask = cp_attention_mask(CU, 2, 1)
    naive = ~torch.ones(16, 32, dtype=torch.bool).tril(16)
    assert not torch.equal(mask, naive)
    # rank 1's first query (global slot 2, segment 0) sees global slots 0..2: rank 0's slots 0, 1 and itself
    assert (~mask[0]).nonzero()[:, 0].tolist() == [0, 1, 16]


def test_cp_packing_pads_samples_and_shares_merge_back():
    cols, cp = make_batch(), 2
    cfg = PackingConfig(max_tokens=16)
    keep, _ = check_samples(cols, VOCAB, cfg)
    full, _ = pack(cols, keep, cfg, 0, 1, cp_size=1)
    shares = [pack(cols, keep, cfg, 0, 1, cp_rank=r, cp_size=cp)[0] for r in range(cp)]
    assert len(shares[0]) == len(shares[1])
    loss_tokens = 0.0
    for mbs in zip(*shares):
        cu = mbs[0]["cu_seqlens"]
        assert all(torch.equal(mb["cu_seqlens"], cu) for mb in mbs)
        assert ((cu[1:] - cu[:-1]) % (2 * cp) == 0).all() and int(cu[-1]) == 16
        assert all(mb["tokens"].shape == (1, 8) and mb["cp_size"] == cp for mb in mbs)
        merged = {k: cp_merge([mb[k] for mb in mbs], cu) for k in ("tokens", "labels", "loss_mask",
                                                                    "sample_index", "position_ids")}
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            sid = int(merged["sample_index"][0, a])
            if sid < 0:  # trailing padding
                assert not merged["loss_mask"][0, a:b].any()
                continue
            s, e = cols.offsets[sid], cols.offsets[sid + 1]
            n = e - s - 1
            assert b - a == -(-n // 4) * 4  # padded to a multiple of 2*cp
            assert merged["position_ids"][0, a:b].tolist() == list(range(b - a))
            assert merged["tokens"][0, a:a + n].tolist() == cols.tokens[s:e - 1].tolist()
            assert merged["loss_mask"][0, a:a + n].tolist() == cols.loss_mask[s + 1:e].tolist()
            assert not merged["loss_mask"][0, a + n:b].any() and (merged["sample_index"][0, a + n:b] == -1).all()
        loss_tokens += float(sum(mb["loss_mask"].sum() for mb in mbs))
    assert loss_tokens == float(sum(mb["loss_mask"].sum() for mb in full))


def test_cp_microbatch_carries_whole_sample_token_counts_and_runs_as_thd():
    cols, cfg = make_batch(), PackingConfig(max_tokens=16)
    keep, _ = check_samples(cols, VOCAB, cfg)
    mb = pack(cols, keep, cfg, 0, 1, cp_rank=1, cp_size=2)[0][0]
    for sid in mb["sample_index"].unique().tolist():
        if sid >= 0:
            on = mb["sample_index"][0] == sid
            whole = float(np.count_nonzero(cols.loss_mask[cols.offsets[sid] + 1:cols.offsets[sid + 1]]))
            assert (mb["sample_num_tokens"][0, on] == whole).all()
    mask, params = attention_inputs(mb, "local")
    assert mask is None and params.qkv_format == "thd" and torch.equal(params.cu_seqlens_q, mb["cu_seqlens"])


def test_cp_refusals_name_the_setting():
    with pytest.raises(ConfigError, match="max_tokens=18 must be a multiple of 2\\*parallel.cp = 4"):
        check_cp_support(RLConfig(packing=PackingConfig(max_tokens=18)), 2)
    with pytest.raises(ConfigError, match="gspo"):
        check_cp_support(RLConfig(loss=LossConfig(name="gspo"), packing=PackingConfig(max_tokens=16)), 2)
    with pytest.raises(ConfigError, match="is_level='sequence'"):
        check_cp_support(RLConfig(loss=LossConfig(name="grpo", is_correction="tis", is_level="sequence"),
                                  packing=PackingConfig(max_tokens=16)), 2)
    check_cp_support(RLConfig(loss=LossConfig(name="gspo"), packing=PackingConfig(max_tokens=18)), 1)  # cp=1: all fine
    tis = LossConfig(name="grpo", is_correction="tis")
    check_cp_support(RLConfig(loss=tis, packing=PackingConfig(max_tokens=16)), 2)
