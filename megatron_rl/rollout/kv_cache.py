"""Paged KV cache: fixed-size blocks from one preallocated pool, block tables per sequence.

    pool = PagedKVCache(num_layers=2, num_blocks=64, block_size=16, kv_heads=2, head_dim=16)
    table = BlockTable()
    pool.ensure(table, upto=37)          # allocate (and copy-on-write) the blocks for positions [0, 37)
    slots = pool.slots(table, positions) # flat slot ids for writing K/V of new tokens
    pool.fork(table) -> BlockTable       # shares every block (reference counts + 1)
    pool.release(table)                  # reference counts - 1; blocks at 0 return to the free list

Storage: one tensor `kv` of shape [layers, 2, num_blocks, block_size, kv_heads/tp, head_dim] (index 0 = K,
1 = V), i.e. per layer K and V each [num_blocks, block_size, kv_heads/tp, head_dim]. Multi-latent attention
(`parts=1`, kv_heads=1): one row per token instead, [layers, 1, ...], the normalised kv latent and the RoPE'd
shared key (kv_lora_rank + qk_pos_emb_head_dim values; DeepSeek's compressed cache), the same on all TP ranks.
Nothing is allocated after construction, so a full pool never runs out of memory: `ensure` returns False and
the scheduler queues or preempts. Shared blocks (the prompt of n samples) are copied on the first write into them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class BlockTable:
    """The physical blocks of one sequence, in position order (block i holds positions [i*bs, (i+1)*bs))."""

    blocks: list[int] = field(default_factory=list)
    """Physical block ids."""


class BlockAllocator:
    """Free list and reference counts over `num_blocks` block ids."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A fresh block with reference count 1, or None when the pool is exhausted."""
        if not self._free:
            return None
        block = self._free.popleft()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise RuntimeError(f"KV block {block} freed twice")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)


class PagedKVCache:
    """The block pool of all layers plus the allocator that hands its blocks to sequences."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", parts: int = 2):
        self.block_size = block_size
        self.kv = torch.zeros(num_layers, parts, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                              device=device)  # [L, 2 (K, V) or 1 (MLA latent row), NB, bs, kvh, d]
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def bytes_per_token(self) -> int:
        """KV bytes one cached token takes (all layers, K and V)."""
        return self.kv[:, :, 0, 0].numel() * self.kv.element_size()

    def blocks_needed(self, table: BlockTable, upto: int) -> int:
        """Blocks `ensure(table, upto)` would allocate (new blocks plus copy-on-write copies), upper bound."""
        new = max(0, -(-upto // self.block_size) - len(table.blocks))
        last = table.blocks[-1] if table.blocks else None
        shared_tail = last is not None and self.allocator.refcount[last] > 1
        return new + int(shared_tail)

    def ensure(self, table: BlockTable, start: int, upto: int) -> bool:
        """Make positions [start, upto) writable: allocate missing blocks, copy shared ones being written.

        Returns False (and changes nothing) when the pool cannot supply the blocks.
        """
        if self.blocks_needed(table, upto) > self.num_free:
            return False
        first, last = start // self.block_size, (upto - 1) // self.block_size
        for i in range(first, min(last + 1, len(table.blocks))):
            self._copy_on_write(table, i)
        while len(table.blocks) <= last:
            table.blocks.append(self.allocator.allocate())
        return True

    def _copy_on_write(self, table: BlockTable, i: int) -> None:
        block = table.blocks[i]
        if self.allocator.refcount[block] == 1:
            return
        new = self.allocator.allocate()
        self.kv[:, :, new].copy_(self.kv[:, :, block])  # [L, 2, bs, kvh, d]
        self.allocator.decref(block)
        table.blocks[i] = new

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of `table`."""
        for b in table.blocks:
            self.allocator.incref(b)
        return BlockTable(list(table.blocks))

    def release(self, table: BlockTable) -> None:
        """Drop this table's references; blocks nobody references go back to the free list."""
        for b in table.blocks:
            self.allocator.decref(b)
        table.blocks.clear()

    def slots(self, table: BlockTable, positions: range) -> list[int]:
        """Flat slot ids (block * block_size + offset) of `positions` in this table."""
        bs = self.block_size
        return [table.blocks[p // bs] * bs + p % bs for p in positions]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor | None) -> None:
        """Store k, v [T, kvh, d] of new tokens at flat `slots` [T] (v None: the one-part MLA cache)."""
        flat = self.kv[layer].flatten(1, 2)  # [parts, NB*bs, kvh, d]
        flat[0, slots] = k
        if v is not None:
            flat[1, slots] = v

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of padded block tables [S, nb] -> each [S, nb*bs, kvh, d] (padding blocks included)."""
        k = self.kv[layer, 0][tables]  # [S, nb, bs, kvh, d]
        v = self.kv[layer, 1][tables]  # [S, nb, bs, kvh, d]
        return k.flatten(1, 2), v.flatten(1, 2)
