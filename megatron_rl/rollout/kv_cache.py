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

Prefix cache: every full block whose K/V is computed is registered under the hash of all tokens up to its
end (a chain hash: the block's tokens and the previous block's hash; K/V at a position depend only on the
tokens up to it and the weights). A new sequence whose leading blocks match is admitted with those blocks
shared and their positions already computed: the greedy and the sampled requests of a task share its prompt,
and the next turn of a multi-turn episode (its whole context so far) prefills only the new tokens. A cached
block that no sequence holds any more stays cached until its slot is needed (oldest first). Weight updates
clear the cache (`clear_prefix`): K/V computed under older weights are never shared with new requests.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class BlockTable:
    """The physical blocks of one sequence, in position order (block i holds positions [i*bs, (i+1)*bs))."""

    blocks: list[int] = field(default_factory=list)
    """Physical block ids."""
    hashes: list[int] = field(default_factory=list)
    """Chain hashes of the leading full blocks already registered in the prefix cache."""


class BlockAllocator:
    """Free list and reference counts over `num_blocks` block ids."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()
        """Blocks nobody holds whose K/V stay in the prefix cache (oldest first); reused when the pool is dry."""
        self.block_hash: dict[int, int] = {}
        """Block -> its prefix-cache hash (registered blocks only)."""
        self.by_hash: dict[int, int] = {}
        """Prefix-cache hash -> block."""

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.cached)

    def allocate(self) -> int | None:
        """A fresh block with reference count 1 (evicting the oldest cached one when no block is free), or
        None when the pool is exhausted."""
        if self._free:
            block = self._free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_hash[self.block_hash.pop(block)]
        else:
            return None
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refcount[block] == 0:  # a cached block taken back into use
            del self.cached[block]
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise RuntimeError(f"KV block {block} freed twice")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.block_hash:
                self.cached[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, h: int) -> None:
        if h not in self.by_hash and block not in self.block_hash:
            self.by_hash[h], self.block_hash[block] = block, h

    def forget(self, block: int) -> None:
        """Drop a block from the prefix cache (before it is written)."""
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.by_hash[h]

    def clear_prefix(self) -> None:
        """Forget every cached prefix; blocks nobody holds return to the free list."""
        self._free.extend(self.cached)
        self.cached.clear()
        self.block_hash.clear()
        self.by_hash.clear()


class PagedKVCache:
    """The block pool of all layers plus the allocator that hands its blocks to sequences."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", parts: int = 2):
        self.block_size = block_size
        self.device = torch.device(device)
        """The device asked for (the rank's), where batches are built; `kv` lives there."""
        self.kv = torch.zeros(num_layers, parts, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                              device=device)  # [L, 2 (K, V) or 1 (MLA latent row), NB, bs, kvh, d]
        self.allocator = BlockAllocator(num_blocks)
        self.routes: Tensor | None = None
        """[NB, bs, L_moe, k] int16 experts chosen per cached token and MoE layer (routing replay), or None."""

    def enable_routes(self, moe_layers: int, topk: int) -> None:
        """Also keep each cached token's routed experts (shared, forked and copied with its K/V)."""
        nb, bs = self.kv.shape[2:4]
        self.routes = torch.full((nb, bs, moe_layers, topk), -1, dtype=torch.int16, device=self.kv.device)

    def write_routes(self, slots: Tensor, routes: Tensor) -> None:
        """Store routes [T, L_moe, k] of new tokens at flat `slots` [T]."""
        self.routes.flatten(0, 1)[slots] = routes.to(self.routes.dtype)

    def read_routes(self, table: BlockTable, n: int) -> Tensor:
        """[n, L_moe, k] routes of positions [0, n) of a table."""
        return self.routes.flatten(0, 1)[torch.tensor(self.slots(table, range(n)), dtype=torch.long)]

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
            self.allocator.forget(block)  # written: its cached prefix K/V would no longer hold
            return
        new = self.allocator.allocate()
        self.kv[:, :, new].copy_(self.kv[:, :, block])  # [L, 2, bs, kvh, d]
        if self.routes is not None:
            self.routes[new].copy_(self.routes[block])  # [bs, L_moe, k]
        self.allocator.decref(block)
        table.blocks[i] = new

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of `table`."""
        for b in table.blocks:
            self.allocator.incref(b)
        return BlockTable(list(table.blocks), list(table.hashes))

    def release(self, table: BlockTable) -> None:
        """Drop this table's references; blocks nobody references go back to the free list (or stay cached)."""
        for b in table.blocks:
            self.allocator.decref(b)
        table.blocks.clear()
        table.hashes.clear()

    # ------------------------------------------------------------------------------ prefix cache
    def _hashes(self, tokens: list[int], n: int, prev: list[int]) -> list[int]:
        """Chain hashes of the first n full blocks of `tokens` (extending the known `prev`)."""
        bs, out = self.block_size, list(prev)
        for i in range(len(out), n):
            out.append(hash((out[-1] if out else 0, tuple(tokens[i * bs:(i + 1) * bs]))))
        return out

    def register(self, table: BlockTable, tokens: list[int], computed: int) -> None:
        """Register the table's full blocks whose positions [0, computed) are all computed."""
        n = min(computed // self.block_size, len(table.blocks))
        if n > len(table.hashes):
            table.hashes = self._hashes(tokens, n, table.hashes)
            for b, h in zip(table.blocks[:n], table.hashes[:n]):
                self.allocator.register(b, h)

    def lookup(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """(blocks, hashes) of the longest cached prefix of `tokens`, leaving at least one token to compute."""
        hashes, blocks = self._hashes(tokens, (len(tokens) - 1) // self.block_size, []), []
        for h in hashes:
            b = self.allocator.by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, hashes[:len(blocks)]

    def adopt(self, table: BlockTable, blocks: list[int], hashes: list[int]) -> None:
        """Give an empty table the cached `blocks` (references + 1)."""
        for b in blocks:
            self.allocator.incref(b)
        table.blocks, table.hashes = list(blocks), list(hashes)

    def clear_prefix(self) -> None:
        self.allocator.clear_prefix()

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
