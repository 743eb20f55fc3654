"""MoE routing replay (R3): the rollout engine records each token's experts, the trainer replays them.

    replays = attach(model, moe_layer_ids(cfg))   # one replay hook per router of this model chunk
    record(replays)                               # engine: the next forward records [T, k] per MoE layer
    routes = recorded(replays)                    # [T, L_moe, k] int16 (layer axis: MoE layers, global order)
    set_targets(replays, routes_mb, tp_rank, tp_size, sp)   # trainer: replay [b, s, L_moe, k] (-1: own routing)

Megatron-Core 0.16's `TopKRouter.routing` asks its `router_replay` (a `RouterReplay`, moe/router_replay.py)
for the top-k. Megatron's own instances register in one process-wide list (`moe_enable_routing_replay`); the
engine and the trainer's policy and reference models live in one process here, so each router gets a
`TokenReplay` of its own instead (a `RouterReplay` subclass, not registered) and callers address them through
the list `attach` returns, per model.

`TokenReplay` extends Megatron's forward replay in two ways: a row of -1 (a token the engine did not compute
in this context, e.g. a sample without recorded routes) keeps the trainer's own top-k, and every replayed or
compared forward counts the (token, layer) pairs whose own expert SET differs from the recorded one
(`disagreement`): the metric of how often trainer and engine would route differently. Replayed weights are
the trainer's own scores of the replayed experts (Megatron: `scores.gather`), so gradients still reach the
router. No activation recompute runs the router twice here (Megatron's REPLAY_BACKWARD is not needed).

Over HTTP (dispatched and fleet workers): a /v1/completions request with "return_routed_experts": true gets
each choice's routes in the shards' compact scheme, and the worker keeps them for its row when the latest request
ran the whole trajectory, as the in-process loop does (`megatron_rl.data.routes`: numpy only, so a rollout worker
never imports torch or Megatron for it).

Token order: the router flattens its input [s, b, E] s-major (token s * b + j); with sequence parallelism each
TP rank routes its contiguous s-chunk, so targets [b, s] are transposed, then cut to this rank's chunk.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

MODES = ("off", "logprobs", "everywhere")
"""off: the trainer routes by itself; logprobs: forward-only log-prob passes (recomputed old log-probs, the
reference model) replay the engine's routing, the training forward routes by itself; everywhere: every
trainer forward, the one computing the loss and gradients included, replays it."""


class TokenReplay(RouterReplay):
    """One router's replay hook (not in Megatron's global list); see the module docstring."""

    def __init__(self, moe_index: int):  # noqa: D107 -- RouterReplay.__init__ would register globally
        self.moe_index = moe_index
        self.target_topk_idx: Tensor | None = None
        self.recorded_topk_idx: Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[Tensor] = []
        self.compare_only = False
        self.counts = torch.zeros(2, dtype=torch.float64)  # [differing (token, layer) pairs, compared pairs]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        own_vals, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)  # [N, k]
        target = self.target_topk_idx.to(device=scores.device, dtype=own.dtype)  # [N, k], -1 = not recorded
        if target.shape != own.shape:
            raise ValueError(f"routing replay: MoE layer {self.moe_index} routes {tuple(own.shape)} tokens x experts,"
                             f" the replayed routes are {tuple(target.shape)}")
        known = (target >= 0).all(-1)  # [N]
        differ = (own.sort(-1).values != target.sort(-1).values).any(-1) & known  # [N]
        # on the scores' device: no host sync per layer
        self.counts = self.counts.to(differ.device) + torch.stack([differ.sum(), known.sum()]).double()
        if self.compare_only:
            return own_vals, own
        idx = torch.where(known[:, None], target, own)  # [N, k]
        return scores.gather(1, idx), idx


def moe_layer_ids(cfg) -> list[int]:
    """Global (0-based) indices of the MoE layers of a `ModelConfig`, in order ([] for a dense model)."""
    if not cfg.moe.num_experts:
        return []
    pattern = cfg.moe.layer_pattern
    return [i for i in range(cfg.num_layers) if pattern is None or pattern[i]]


def attach(model, moe_layers: list[int]) -> list[TokenReplay]:
    """A `TokenReplay` on every router of `model` (a GPTModel chunk, or DDP around one), in layer order;
    idempotent (a router keeps its hook)."""
    module = getattr(model, "module", model)
    out = []
    for layer in module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        if not isinstance(router.router_replay, TokenReplay):
            router.router_replay = TokenReplay(moe_layers.index(layer.layer_number - 1))
        out.append(router.router_replay)
    return out


def record(replays: list[TokenReplay]) -> None:
    """The next forward records each router's top-k indices."""
    for r in replays:
        r.set_router_replay_action(RouterReplayAction.RECORD)


def recorded(replays: list[TokenReplay]) -> Tensor:
    """[T, L_moe, k] int16: the experts of each token of the last recorded forward, per MoE layer."""
    return torch.stack([r.recorded_topk_idx for r in replays], dim=1).to(torch.int16)


def set_targets(replays: list[TokenReplay], routes: Tensor, tp_rank: int = 0, tp_size: int = 1,
                sequence_parallel: bool = False, compare_only: bool = False) -> None:
    """Replay `routes` [b, s, L_moe, k] (global MoE-layer axis, -1 = own routing) in the next forward; with
    `compare_only` the routers keep their own choice and only count disagreements."""
    b, s = routes.shape[:2]
    flat = routes.transpose(0, 1).reshape(s * b, *routes.shape[2:])  # [s*b, L_moe, k], the router's order
    if sequence_parallel and tp_size > 1:
        n = flat.shape[0] // tp_size
        flat = flat[tp_rank * n:(tp_rank + 1) * n]  # this rank's sequence chunk
    for r in replays:
        r.target_topk_idx = flat[:, r.moe_index].long()  # [N, k]
        r.compare_only = compare_only
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear(replays: list[TokenReplay]) -> None:
    """Back to plain routing (keeps the counts)."""
    for r in replays:
        r.clear_router_replay_action()
        r.target_topk_idx = r.recorded_topk_idx = None


def take_counts(replays: list[TokenReplay]) -> Tensor:
    """[2] float64 (differing, compared) (token, layer) pairs summed over `replays` since the last call; resets."""
    total = torch.zeros(2, dtype=torch.float64)
    for r in replays:
        total += r.counts.cpu()
        r.counts = torch.zeros(2, dtype=torch.float64)
    return total
