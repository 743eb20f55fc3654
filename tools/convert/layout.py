"""Canonical names <-> Megatron: the shards a rank holds, and the keys of a dist_checkpointing checkpoint.

Both are read from Megatron's own `sharded_state_dict()`: each ShardedTensor says which region of which
global tensor a rank holds (TP/EP slices, the GLU halves and the stacked layer/expert axes included).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

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
    """dist_checkpointing key (layers and experts stacked along prepended axes)."""
    prepend: int
    """Number of prepended axes: 0 (global), 1 (layer), 2 (layer, expert)."""
    shape: tuple[int, ...]
    """Shape of one canonical tensor (without the prepended axes)."""


def build_model(cfg, extra: dict, ctx, num_layers: int | None = None):
    """This rank's GPTModel chunk for `cfg` with TransformerConfig overrides `extra` (eps, head_dim...)."""
    from dataclasses import replace as dc_replace

    from megatron.core.models.gpt import GPTModel

    from megatron_rl.models.gpt import layer_spec, transformer_config

    if num_layers is not None:
        cfg = dc_replace(cfg, num_layers=num_layers)
    cfg.check_parallel(ctx.parallel)
    tcfg = dc_replace(transformer_config(cfg, ctx.parallel), **extra)
    pp_rank, pp_size = torch.distributed.get_rank(ctx.pgs.pp), ctx.parallel.pp
    return GPTModel(config=tcfg, transformer_layer_spec=layer_spec(cfg), vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_seq_length, pre_process=pp_rank == 0,
                    post_process=pp_rank == pp_size - 1, parallel_output=True,
                    share_embeddings_and_output_weights=cfg.tie_embeddings, position_embedding_type="rope",
                    rotary_base=cfg.rotary_base, pg_collection=ctx.pgs)


def _shards(item) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        built = item.build()
        return [t for t in (built if isinstance(built, list) else [built]) if isinstance(t, ShardedTensor)]
    return [item] if isinstance(item, ShardedTensor) else []


def canonical_name(sd_key: str, sh) -> str:
    """Canonical name of a sharded-state-dict entry: local layer/expert indices made global."""
    name = sd_key
    if sh.prepend_axis_num >= 1 and _LAYER.match(name):
        name = _LAYER.sub(f"decoder.layers.{sh.global_offset[0]}.", name)
    if sh.prepend_axis_num >= 2 and _EXPERT.search(name):
        name = _EXPERT.sub(f".local_experts.{sh.global_offset[1]}.", name)
    return name


def model_shards(model) -> dict[str, list[Shard]]:
    """canonical name -> the regions this rank holds (tied output_layer copies included)."""
    out: dict[str, list[Shard]] = {}
    for key, item in model.sharded_state_dict().items():
        for sh in _shards(item):
            n = sh.prepend_axis_num
            region = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.data.shape))
            out.setdefault(canonical_name(key, sh), []).append(Shard(tuple(sh.global_shape[n:]), region, sh.data))
    return out


def ckpt_entries(standin) -> list[CkptEntry]:
    """Checkpoint keys of every canonical tensor, from a one-layer stand-in model (EP=1, TP=1)."""
    entries: dict[str, CkptEntry] = {}
    for key, item in standin.sharded_state_dict().items():
        for sh in _shards(item):
            n = sh.prepend_axis_num
            template = _EXPERT.sub(".local_experts.{e}.", _LAYER.sub("decoder.layers.{l}.", key)) if n else key
            shape = tuple(sh.global_shape[n:])
            entries[template] = CkptEntry(template, sh.key, n, shape)
    return list(entries.values())


def load_canonical(ckpt: str, entries: list[CkptEntry], layer: int | None, counts: tuple[int, int],
                   dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Global tensors of one layer (or, with layer=None, the non-layer ones) read from a checkpoint.

    Reads through torch.distributed.checkpoint, one region per key ([layer] or [layer, all experts]):
    dist_checkpointing's own load cannot read a partial region in a single process.
    """
    n_layers, n_experts = counts
    picked = [e for e in entries if (e.prepend == 0) == (layer is None)]
    bufs, state = {}, {}
    for ent in picked:
        lead = ((1,) if ent.prepend else ()) + ((n_experts,) if ent.prepend == 2 else ())
        buf = bufs[ent.template] = torch.empty(lead + ent.shape, dtype=dtypes[ent.key])  # [1, (E,) ...]
        offsets = ((layer,) if ent.prepend else ()) + (0,) * (buf.dim() - (1 if ent.prepend else 0))
        state[ent.key] = (buf, offsets)
    if state:
        _read_regions(ckpt, state)
    out = {}
    for ent in picked:
        buf = bufs[ent.template]
        if ent.prepend == 2:
            out.update({ent.template.format(l=layer, e=e): buf[0, e] for e in range(n_experts)})
        else:
            out[ent.template.format(l=layer)] = buf[0] if ent.prepend else buf
    return out


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

