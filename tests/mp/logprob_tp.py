"""Under torchrun (gloo, CPU): fused log-prob/entropy with the vocab split over tensor-parallel groups.

World of 2 * G ranks, TP groups {0, 1}, {2, 3}, ... passed explicitly (group rank, not global rank, picks the
vocab slice). Every rank builds the same full problem from a seed, keeps its rows of W, runs forward and
backward of loss = sum(ca * logprob + cc * entropy), and emits outputs and gradients for the test to
compare with the TP=1 naive computation (`make_case` is shared with the test).

    torchrun --nproc_per_node=2 tests/mp/logprob_tp.py torch [triton]

triton runs on the first TP group only (ranks 0 and 1), so one world-4 launch checks torch on two groups and
triton on one (with TRITON_INTERPRET=1 on a machine without a GPU).
"""
from __future__ import annotations

import sys

import torch

TP = 2
# name -> (tokens, hidden, padded vocab, real vocab, temperature)
CASES = {
    "temp0.7": (40, 24, 128, 128, 0.7),
    "padded": (33, 16, 128, 120, 1.3),  # rank 1 holds 8 padding rows
    "rank1_all_padding": (21, 16, 128, 60, 1.0),  # rank 1's slice is entirely padding
}


def make_case(name: str, seed: int = 0):
    """(hidden [T, H], weight [V, H], targets [T], ca [T], cc [T], vocab_size, temperature), fp32."""
    T, H, V, vocab_size, temperature = CASES[name]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)  # [T, H]
    weight = torch.randn(V, H, generator=g) / H ** 0.5 * 3  # [V, H]
    targets = torch.randint(0, vocab_size, (T,), generator=g)  # [T]
    mask = (torch.rand(T, generator=g) < 0.7).float()  # [T]
    ca, cc = torch.randn(T, generator=g) * mask, torch.randn(T, generator=g) * mask  # [T]
    return hidden, weight, targets, ca, cc, vocab_size, temperature


def run(name: str, impl: str, group, rank_in_group: int) -> dict:
    from megatron_rl.kernels.logprob import fused_logprob_entropy

    hidden, weight, targets, ca, cc, vocab_size, temperature = make_case(name)
    v_local = weight.shape[0] // TP
    w_local = weight[rank_in_group * v_local:(rank_in_group + 1) * v_local].clone().requires_grad_()  # [V/TP, H]
    hidden.requires_grad_()
    logprob, entropy = fused_logprob_entropy(hidden, w_local, targets, tp_group=group, temperature=temperature,
                                             chunk_tokens=8, chunk_vocab=24, impl=impl, vocab_size=vocab_size)
    (ca * logprob + cc * entropy).sum().backward()
    return {"case": name, "impl": impl, "tp_rank": rank_in_group, "logprob": logprob.tolist(),
            "entropy": entropy.tolist(), "grad_h": hidden.grad.tolist(), "grad_w": w_local.grad.tolist()}


def main(impls: list[str]) -> None:
    import torch.distributed as dist

    from tests.mp.launch import emit

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(s, s + TP))) for s in range(0, world, TP)]  # every rank creates all
    group = groups[rank // TP]
    for impl in impls:
        if impl == "triton" and rank >= TP:  # the interpreter is slow: the first TP group alone (a world of 2)
            continue
        for name in CASES:
            emit({"rank": rank, **run(name, impl, group, dist.get_rank(group))})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:] or ["torch"])
