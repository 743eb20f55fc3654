"""Megatron-Core's local DotProductAttention for multi-latent attention (local, non-TE layer spec).

Megatron-Core 0.16's MLASelfAttention builds its core attention with `k_channels` (qk_head_dim +
qk_pos_emb_head_dim) and `v_channels` (v_head_dim), which only TE's attention accepts; the local
`DotProductAttention` computes with any query/key and value head sizes (it reshapes with -1) but sizes its
output from `kv_channels`. This subclass takes the two sizes and sizes the output by `v_channels`; the
attention itself (scores, mask, softmax, dropout) is Megatron's, unchanged. No parameters of its own.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """DotProductAttention with MLA's query/key (`k_channels`) and value (`v_channels`) head sizes."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.k_channels = k_channels


# -- the key's RoPE part under tensor parallelism --------------------------------------------------------
# MLA's shared RoPE key (k_pos_emb, one head) is expanded to each rank's heads; its gradient is then the sum
# over all heads, i.e. over the TP ranks. Megatron-Core 0.16 never sums it (NVIDIA/Megatron-LM issue #1699,
# fix PR #6839): with the stock column-parallel kv down projection the gather's backward keeps each rank's
# partial share, so TP > 1 trains with wrong gradients (measured here: TP=2 losses off by 2e-5 after one
# step). The local spec therefore uses Megatron's replicated ("duplicated") down projection -- the branch TE's
# spec takes -- and, without sequence parallelism, sums the RoPE columns' gradient over TP with Megatron's
# a gradient all-reduce (what the upstream fix does to k_pos_emb). With sequence parallelism
# Megatron gathers k_pos_emb from the sequence-parallel region, whose backward already reduce-scatters it.
def replicated_linear():
    """The module class for MLA's kv down projection on the local spec (one copy per TP rank)."""
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


def fix_rope_key_grad(model, tp_group) -> int:
    """Give each replicated kv down projection of `model` the right gradient (see above); returns how many.

    Also draws the replicated weight with the config's init_method and makes it equal on all TP ranks."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    n = 0
    for module in model.modules():
        down = getattr(module, "linear_kv_down_proj", None)
        if not isinstance(module, MLASelfAttention) or isinstance(down, ColumnParallelLinear):
            continue
        _init_replicated(down, module.config, tp_group)
        if tp_group is not None and tp_group.size() > 1 and not module.config.sequence_parallel:
            down.register_forward_hook(_sum_rope_columns_grad(module.config.kv_lora_rank, tp_group))
        n += 1
    return n


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group. Megatron's
    copy_to_tensor_model_parallel_region does the same but all-reduces `grad.contiguous()` and returns the
    original: a non-contiguous gradient (here a slice of torch.cat's) would come back unreduced."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_rope_columns_grad(kv_lora_rank: int, tp_group):
    def hook(_module, _inputs, output):
        out, bias = output  # out [s, b, kv_lora_rank + qk_pos_emb_head_dim], on every TP rank
        latent, rope = out[..., :kv_lora_rank], out[..., kv_lora_rank:]
        return torch.cat([latent, _SumGradOverTP.apply(rope, tp_group)], dim=-1), bias

    return hook


@torch.no_grad()
def _init_replicated(linear, config, tp_group) -> None:
    import torch.distributed as dist

    if config.perform_initialization:
        config.init_method(linear.weight)
    if tp_group is not None and tp_group.size() > 1:
        dist.broadcast(linear.weight, dist.get_global_rank(tp_group, 0), group=tp_group)
