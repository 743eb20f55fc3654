"""Continuous-batching scheduler: which sequences run how many tokens in the next engine step.

Every step (a) the running sequences, oldest first, get their next chunk: 1 token when decoding, up to
the remaining budget when (re)prefilling; (b) waiting sequences are admitted while the per-step token
budget (`max_tokens_per_step`), the running limit and the free KV blocks allow. Long prompts are
prefilled in chunks across steps. When a running sequence cannot get a block, the youngest other running
sequence is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed
(prompt + tokens generated so far) later; new requests are only admitted when blocks are free. The pool
is never over-committed, so generation never runs out of memory.

The schedule is a deterministic function of the requests added and the tokens sampled, so every tensor
parallel rank computes the same plan from the same inputs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from megatron_rl.rollout.kv_cache import BlockTable, PagedKVCache
from megatron_rl.rollout.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    """One sample being generated: its tokens, its KV blocks and what has been computed."""

    seq_id: int
    """Engine-wide id (admission order; larger = younger)."""
    request_id: str
    """The request it belongs to."""
    index: int
    """Sample index within the request (0..n-1)."""
    tokens: list[int]
    """Prompt followed by the generated tokens."""
    prompt_len: int
    """Tokens of the prompt."""
    params: SamplingParams
    """Sampling parameters of the request."""
    generator: torch.Generator
    """This sample's random stream."""
    table: BlockTable = field(default_factory=BlockTable)
    """Its KV blocks."""
    num_computed: int = 0
    """Leading tokens whose K/V are in the cache (the last token is computed in the step that samples)."""
    logprobs: list[float] = field(default_factory=list)
    """Log-prob of each generated token under its sampling distribution."""
    versions: list[int] = field(default_factory=list)
    """Policy version that produced each generated token."""
    finish_reason: str | None = None
    """None while running; then 'stop', 'length' or 'abort'."""
    pending_forks: int = 0
    """Siblings still to fork from this sequence once its prompt is prefilled (n > 1)."""
    routes: object = None
    """Routing replay: int16 [num_computed, L_moe, k] experts of its computed tokens, read when it finishes."""

    @property
    def needed(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Scheduler:
    """Waiting queue + running set over one paged KV cache."""

    def __init__(self, cache: PagedKVCache, max_tokens_per_step: int, max_running: int, prefix_cache: bool = True):
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.prefix_hit_tokens = 0
        """Prompt tokens whose K/V came from the prefix cache instead of a prefill."""
        self.max_tokens_per_step = max_tokens_per_step
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling: already holds (shared) blocks; admitting its first sequence counted it against
        `max_running`."""
        self.running.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's plan: (sequence, tokens to run) pairs; empty when nothing can run."""
        plan: list[tuple[Sequence, int]] = []
        budget = self._schedule_running(plan, self.max_tokens_per_step)
        self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: list, budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            chunk = min(seq.needed, budget)
            if self._grow(seq, chunk, plan):
                plan.append((seq, chunk))
                budget -= chunk
        return budget

    def _grow(self, seq: Sequence, chunk: int, plan: list) -> bool:
        """Allocate blocks for `chunk` more tokens of a running sequence, preempting younger ones if needed."""
        start = seq.num_computed
        while not self.cache.ensure(seq.table, start, start + chunk):
            scheduled = {id(s) for s, _ in plan}
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if not victims:
                return False
            self.preempt(max(victims, key=lambda s: s.seq_id))
        return True

    def _admit_waiting(self, plan: list, budget: int) -> None:
        occupied = len(self.running) + sum(s.pending_forks for s in self.running)  # siblings run once forked
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if occupied + 1 + seq.pending_forks > self.max_running:
                break
            hit, hashes = self.cache.lookup(seq.tokens) if self.prefix_cache and not seq.table.blocks else ([], [])
            start = max(seq.num_computed, len(hit) * self.cache.block_size)
            chunk = min(len(seq.tokens) - start, budget)
            reserve = occupied + seq.pending_forks  # a block per running sequence for its decode growth
            idle = sum(self.cache.allocator.refcount[b] == 0 for b in hit)  # cached blocks taken out of the pool
            new = max(0, -(-(start + chunk) // self.cache.block_size) - len(hit)) if hit else \
                self.cache.blocks_needed(seq.table, start + chunk)
            if new + idle + reserve > self.cache.num_free:
                break
            if hit:
                self.cache.adopt(seq.table, hit, hashes)
                seq.num_computed = start
                self.prefix_hit_tokens += start
            self.cache.ensure(seq.table, seq.num_computed, seq.num_computed + chunk)
            self.waiting.popleft()
            self.running.append(seq)
            occupied += 1 + seq.pending_forks
            plan.append((seq, chunk))
            budget -= chunk

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it (first) for recomputation."""
        self.cache.release(seq.table)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        """Recompute every in-flight sequence (after a weight update), keeping their order."""
        for seq in sorted(self.running, key=lambda s: s.seq_id, reverse=True):
            self.preempt(seq)
        for seq in self.waiting:
            if seq.num_computed:
                self.cache.release(seq.table)
                seq.num_computed = 0

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (its computed full blocks stay cached)."""
        if self.prefix_cache:
            self.cache.register(seq.table, seq.tokens, seq.num_computed)
        self.cache.release(seq.table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
