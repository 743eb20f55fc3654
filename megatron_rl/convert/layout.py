"""Canonical names <-> Megatron: the shards a rank holds, and the keys of a dist_checkpointing checkpoint.

Both are read from Megatron's own `sharded_state_dict()`: each ShardedTensor says which region of which
global tensor a rank holds (TP/EP slices, the GLU halves and the stacked layer/expert axes included).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import replace as dc_replace

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass
class Shard:
    """A region of one canonical tensor held by this rank, and the local tensor (view) holding it."""

    global_shape: tuple[int, ...]
    """Unsharded shape of the canonical tensor."""
    region: tuple[slice, ...]
    """This rank's region of it."""
    data: torch.Tensor
    """The local tensor (a view of a parameter)."""


@dataclass(frozen=True)
class CkptEntry:
    """Where one canonical tensor (pattern) lives in a checkpoint."""

    template: str
    """Canonical name with {l} for the layer and {e} for the expert."""
    key: str
    """dist_checkpointing key: layers stacked along a prepended axis, or `{l}` in the key where the layers
    differ (mixed dense/MoE layers); experts stacked along a prepended axis."""
    prepend: int
    """Number of prepended axes: 0 (global, or a layer named in the key), 1 (layer or expert), 2 (both)."""
    shape: tuple[int, ...]
    """Shape of one canonical tensor (without the prepended axes)."""
    layers: tuple[int, ...] | None = None
    """Layers holding this tensor when they differ (mixed dense/MoE); None: every layer (or not a layer's)."""

    @property
    def per_layer(self) -> bool:
        return "{l}" in self.template

    @property
    def layer_axis(self) -> bool:
        return self.per_layer and "{l}" not in self.key

    def keys(self, n_layers: int) -> list[str]:
        """Every checkpoint key of this entry."""
        if "{l}" not in self.key:
            return [self.key]
        return [self.key.format(l=i) for i in (self.layers if self.layers is not None else range(n_layers))]

    def has_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


def build_model(cfg, extra: dict, ctx, num_layers: int | None = None):
    """This rank's GPTModel chunk for `cfg` with TransformerConfig overrides `extra`.

    With `num_layers` (a stand-in for reading checkpoint keys): that many layers, or with mixed dense/MoE
    layers one layer of each kind present.
    """
    from megatron_rl.models.gpt import build_gpt

    if num_layers is not None:
        pattern = cfg.moe.layer_pattern
        if pattern is not None:
            pattern = sorted(set(pattern))
            num_layers = len(pattern)
        cfg = dc_replace(cfg, num_layers=num_layers, sliding_window_layers=None,
                         moe=dc_replace(cfg.moe, layer_pattern=pattern))
    pp_rank, pp_size = torch.distributed.get_rank(ctx.pgs.pp), ctx.parallel.pp
    return build_gpt(cfg, ctx.parallel, ctx.pgs, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1,
                     config_overrides=extra)


def _shards(item) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        built = item.build()
        return [t for t in (built if isinstance(built, list) else [built]) if isinstance(t, ShardedTensor)]
    return [item] if isinstance(item, ShardedTensor) else []


def _axes(sd_key: str, sh) -> tuple[int | None, int | None]:
    """(global layer, global expert) of a sharded-state-dict entry: the layer from a stacked axis or from
    the checkpoint key (mixed dense/MoE layers name each layer), the expert from the next stacked axis."""
    axis, layer, expert = 0, None, None
    named = _LAYER.match(sh.key)
    if named:
        layer = int(named.group(1))
    elif _LAYER.match(sd_key) and sh.prepend_axis_num >= 1:
        layer, axis = sh.global_offset[0], 1
    if _EXPERT.search(sd_key) and sh.prepend_axis_num > axis:
        expert = sh.global_offset[axis]
    return layer, expert


def canonical_name(sd_key: str, sh) -> str:
    """Canonical name of a sharded-state-dict entry: local layer/expert indices made global."""
    layer, expert = _axes(sd_key, sh)
    name = sd_key if layer is None else _LAYER.sub(f"decoder.layers.{layer}.", sd_key)
    return name if expert is None else _EXPERT.sub(f".local_experts.{expert}.", name)


def model_shards(model) -> dict[str, list[Shard]]:
    """canonical name -> the regions this rank holds (tied output_layer copies included)."""
    out: dict[str, list[Shard]] = {}
    for key, item in model.sharded_state_dict().items():
        for sh in _shards(item):
            n = sh.prepend_axis_num
            region = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.data.shape))
            out.setdefault(canonical_name(key, sh), []).append(Shard(tuple(sh.global_shape[n:]), region, sh.data))
    return out


def ckpt_entries(model, pattern: list[int] | None = None) -> list[CkptEntry]:
    """Checkpoint keys of every canonical tensor, from a model (a stand-in of one layer per kind is
    enough). `pattern`: the full model's MoE layer pattern (1 = MoE, 0 = dense) when layers differ."""
    stand_pattern = model.config.moe_layer_freq if isinstance(model.config.moe_layer_freq, list) else None
    entries: dict[str, CkptEntry] = {}
    kinds: dict[str, set] = {}
    for key, item in model.sharded_state_dict().items():
        for sh in _shards(item):
            layer, _ = _axes(key, sh)
            template = _EXPERT.sub(".local_experts.{e}.", _LAYER.sub("decoder.layers.{l}.", key))
            ck = _LAYER.sub("decoder.layers.{l}.", sh.key) if _LAYER.match(sh.key) else sh.key
            entries[template] = CkptEntry(template, ck, sh.prepend_axis_num,
                                          tuple(sh.global_shape[sh.prepend_axis_num:]))
            if layer is not None and stand_pattern is not None:
                kinds.setdefault(template, set()).add(stand_pattern[layer])
    if pattern is None or set(pattern) == {1} or stand_pattern is None:
        return list(entries.values())
    out = []
    for t, ent in entries.items():
        if t in kinds and kinds[t] != set(pattern):
            ent = dc_replace(ent, layers=tuple(i for i, k in enumerate(pattern) if k in kinds[t]))
        out.append(ent)
    return out


def merge_entries(parts: list[list[CkptEntry]]) -> list[CkptEntry]:
    """Entries gathered from several ranks (pipeline stages): one per template, their layers united."""
    out: dict[str, CkptEntry] = {}
    for ent in (e for part in parts for e in part):
        have = out.get(ent.template)
        if have is not None and have.layers is not None and ent.layers is not None:
            ent = dc_replace(ent, layers=tuple(sorted(set(have.layers) | set(ent.layers))))
        elif have is not None:
            ent = dc_replace(ent, layers=None)
        out[ent.template] = ent
    return list(out.values())


def load_canonical(ckpt: str, entries: list[CkptEntry], layer: int | None, counts: tuple[int, int],
                   dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Global tensors of one layer (or, with layer=None, the non-layer ones) read from a checkpoint.

    Reads through torch.distributed.checkpoint, one region per key ([layer] or [layer, all experts]):
    dist_checkpointing's own load cannot read a partial region in a single process. Entries sharing a key (the
    tied output layer of a last pipeline stage, stored as the embedding's key) share the one read.
    """
    n_layers, n_experts = counts
    picked = [e for e in entries if e.per_layer != (layer is None) and (layer is None or e.has_layer(layer))]
    bufs, state = {}, {}
    for ent in picked:
        key = ent.key.format(l=layer) if layer is not None else ent.key
        expert = "{e}" in ent.template
        lead = ((1,) if ent.layer_axis else ()) + ((n_experts,) if expert else ())
        if key in state:  # one buffer per key: a second one would stay unread (torch.empty)
            bufs[ent.template] = _shared_buffer(state[key][0], lead + ent.shape, ent.template, key)
            continue
        dtype = dtypes.get(key, dtypes.get(ent.key))
        buf = bufs[ent.template] = torch.empty(lead + ent.shape, dtype=dtype)  # [(1,) (E,) ...]
        offsets = ((layer,) if ent.layer_axis else ()) + (0,) * (buf.dim() - (1 if ent.layer_axis else 0))
        state[key] = (buf, offsets)
    if state:
        _read_regions(ckpt, state)
    out = {}
    for ent in picked:
        buf = bufs[ent.template]
        buf = buf[0] if ent.layer_axis else buf
        if "{e}" in ent.template:
            out.update({ent.template.format(l=layer, e=e): buf[e] for e in range(n_experts)})
        else:
            out[ent.template.format(l=layer) if layer is not None else ent.template] = buf
    return out


def _shared_buffer(buf: torch.Tensor, shape: tuple[int, ...], template: str, key: str) -> torch.Tensor:
    if tuple(buf.shape) != shape:
        raise ValueError(f"checkpoint key {key!r} is read as {tuple(buf.shape)} and, for {template!r}, as {shape}: "
                         f"canonical tensors stored under one key must have one shape")
    return buf


def _read_regions(ckpt: str, regions: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """Fill each buffer with the region of checkpoint tensor `key` starting at `offsets` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for key, (buf, offsets) in regions.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buf.shape)
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            buf = regions[read_item.dest_index.fqn][0]
            for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                buf = buf.narrow(dim, off, n)
            return buf

    dcp.load({k: b for k, (b, _) in regions.items()}, storage_reader=dcp.FileSystemReader(ckpt),
             planner=RegionPlanner())


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None



def load_model(model, ckpt) -> None:
    """Load `model`'s tensors from a dist_checkpointing checkpoint (a converted one, or an RL run's: its optimizer
    and trainer state are ignored), resharded to the model's layout."""
    from megatron.core import dist_checkpointing

    sd = model.sharded_state_dict()
    state = dist_checkpointing.load(sd, str(ckpt))
    model.load_state_dict({k: v for k, v in state.items() if k in sd})
