"""The warm-up -> RL hand-off gives each virtual-pipeline chunk its own warm-up weights (issue 26 finding: the
RL policy used to load chunk 0's state into every chunk when vpp > 1)."""
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.loop.job import warm_init


def _warm_policy(n: int):
    """A stand-in for a warm-up Policy with `n` chunks, chunk v's weight filled with v."""
    chunks = []
    for v in range(n):
        m = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.constant_(m.weight, float(v))
        chunks.append(SimpleNamespace(module=m))
    return SimpleNamespace(chunks=chunks)


def test_each_vpp_chunk_gets_its_own_warmup_weights():
    init, built = warm_init(_warm_policy(3)), [torch.nn.Linear(2, 2, bias=False) for _ in range(3)]
    for m in built:  # Policy._build_chunks calls init once per chunk, in chunk order
        init(m)
    assert [m.weight.unique().tolist() for m in built] == [[0.0], [1.0], [2.0]]


def test_more_rl_chunks_than_warmup_chunks_is_refused():
    init = warm_init(_warm_policy(1))
    init(torch.nn.Linear(2, 2, bias=False))
    with pytest.raises(ValueError, match="pp/vpp"):
        init(torch.nn.Linear(2, 2, bias=False))
