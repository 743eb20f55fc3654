"""Fused compute kernels for RL post-training.

Each sub-package pairs an exact, chunked PyTorch reference (runs everywhere, used as the test oracle) with
Triton kernels for GPUs, behind one dispatch function:

- `kernels.logprob`: per-token log-prob and entropy from hidden states and the vocab-parallel output layer,
  without materialising the `[tokens, vocab]` logits.
"""
