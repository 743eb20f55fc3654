"""The flat weight file a separate rollout server loads (rollout/weight_file.py): bytes read straight into the
engine's parameters, exactly, and a file that does not fit is refused naming the tensor."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.weight_file import is_weight_file, read_weights_into, write_weights


def _named(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "c.empty": torch.empty(0, 4), "d.t": torch.randn(4, 6, generator=g).t(),  # non-contiguous source
            "e.half": torch.randn(2, 3, generator=g).half()}


def test_a_weight_file_is_read_into_the_parameters_in_place_exactly(tmp_path):
    src, path = _named(1), tmp_path / "w.bin"
    nbytes = write_weights(path, src.items())
    assert nbytes == sum(t.numel() * t.element_size() for t in src.values())
    assert is_weight_file(path) and not (tmp_path / "w.bin.tmp").exists()
    dest = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in src.items()}
    ptrs = {n: t.data_ptr() for n, t in dest.items()}
    got = dict(read_weights_into(path, dest))
    assert sorted(got) == sorted(src)
    for n, t in src.items():
        assert torch.equal(dest[n], t), n
        assert got[n].data_ptr() == ptrs[n]  # read into the parameter's own memory: no staging copy


@pytest.mark.slow
def test_a_parameter_that_does_not_fit_gets_a_new_tensor_and_a_truncated_file_is_refused(tmp_path):
    src, path = _named(2), tmp_path / "w.bin"
    write_weights(path, src.items())
    dest = {"a.weight": torch.zeros(5, 3), "b.bias": torch.zeros(7)}  # wrong shape, wrong dtype
    got = dict(read_weights_into(path, dest))
    assert torch.equal(got["a.weight"], src["a.weight"]) and got["b.bias"].dtype == torch.bfloat16
    assert not dest["a.weight"].any() and not dest["b.bias"].any()  # left alone: the engine's load rejects them
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"ends inside tensor 'e.half'"):
        list(read_weights_into(path, {}))
    torch.save({"x": torch.ones(1)}, tmp_path / "w.pt")
    assert not is_weight_file(tmp_path / "w.pt")
