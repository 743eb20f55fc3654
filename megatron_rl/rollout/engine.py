"""Rollout engine: token ids in, token ids + log-probs + policy versions out, from the trainer's own model.

    engine = RolloutEngine.build(model_cfg, EngineConfig(num_blocks=256), parallel, pgs)
    rid = engine.add_request([257, 72, 105], SamplingParams(temperature=1.0, max_new_tokens=64, n=4, seed=1))
    while engine.has_work:
        for out in engine.step():        # finished requests of this step
            ...                           # out.samples[i].token_ids / .logprobs / .policy_versions
    engine.update_weights(version=7, named_tensors=trainer_model.named_parameters(), policy="continue")

Design: the `GPTModel` is built with `build_gpt` (same definition and parameter names as the trainer) and
run by `ModelRunner` with a paged KV cache (`kv_cache.py`). Each `step()` is one forward over the mixed
prefill/decode batch chosen by the `Scheduler` (continuous batching under `max_tokens_per_step`). The n
samples of a prompt share its KV blocks (copy-on-write), and a request whose leading tokens were computed
before (the same prompt again, a multi-turn episode's context so far) shares their blocks through the prefix
cache (`kv_cache.py`; `prefix_cache: false` turns it off) and prefills only the rest. Weight updates
happen between steps (and clear the prefix cache); with policy 'continue' in-flight samples keep going and
every token records the version that produced it (their cached K/V is recomputed under the new weights
unless `kv_on_update='keep'`); with 'abort' they end with finish reason 'abort'.

MoE routing replay (`build(..., record_routes=True)`): every forward records each token's top-k experts per MoE
layer (models/routing_replay.py) into a per-slot store beside the KV cache (`PagedKVCache.routes`), so
prefix-cache hits, forked samples and recomputed (preempted) sequences carry the routes of the very tokens
they hold; a finished sample returns them (`SampleOutput.routed_experts`).

Tensor parallel: every TP rank runs the same engine with the same requests in the same order; the
scheduler is deterministic, logits are gathered over TP, and the sampled tokens are broadcast from TP
rank 0 so that all ranks continue identically.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError
from megatron_rl.rollout.compression import CompressionConfig, CompressionRecord, Summarizer, compress_turns
from megatron_rl.rollout.model_runner import ModelRunner, build_batch
from megatron_rl.rollout.sampling import SamplingParams, sample
from megatron_rl.rollout.scheduler import Scheduler, Sequence
from megatron_rl.rollout.vllm_config import VLLMConfig

UpdatePolicy = Literal["continue", "abort"]


@dataclass
class EngineConfig:
    """Rollout engine settings."""

    num_blocks: int = 256
    """KV-cache blocks in the preallocated pool."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_tokens_per_step: int = 512
    """Token budget of one engine step (decode tokens + prefill chunks)."""
    max_running: int = 64
    """Sequences decoding at the same time at most (a request's n samples count n; n above it is refused)."""
    update_policy: Literal["continue", "abort"] = "continue"
    """Default for in-flight requests at a weight update: keep generating, or end them with 'abort'."""
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    """With 'continue': recompute in-flight K/V under the new weights, or keep the stale cache."""
    seed: int = 0
    """Seeds requests that bring no seed (same on every TP rank)."""
    prefix_cache: bool = True
    """Share the K/V of token prefixes already computed (a task's repeated prompt, a multi-turn episode's
    context so far) instead of prefilling them again; cleared at every weight update."""
    dtype: Literal["model", "fp32", "bf16"] = "model"
    """Parameter dtype of the engine's copy of the policy: the trainer's (model.params_dtype), or fp32 / bf16
    (a bf16 engine serving an fp32 trainer; weight syncs cast)."""
    backend: Literal["native", "vllm"] = "native"
    """native: this engine, in-process on the trainer ranks; vllm: a vLLM engine per rollout replica in a process
    of its own, from the environment `vllm` names (rollout/vllm_engine.py; made by scripts/setup_vllm.sh).
    With vllm, max_running is vLLM's max_num_seqs and seed its seed; num_blocks, block_size,
    max_tokens_per_step, kv_on_update and prefix_cache are the native engine's alone (vLLM recomputes in-flight
    K/V after an update, as kv_on_update='recompute', and always caches prefixes)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM backend's environment and engine settings (read only with backend=vllm)."""

    def validate(self) -> None:
        if self.backend not in ("native", "vllm"):
            raise ConfigError(f"engine.backend={self.backend!r} is not one of native, vllm")
        if self.backend == "vllm":
            self.vllm.validate()
        if self.dtype not in ("model", "fp32", "bf16"):
            raise ConfigError(f"rollout.dtype={self.dtype!r} is not one of model, fp32, bf16")
        for name in ("num_blocks", "block_size", "max_tokens_per_step", "max_running"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SampleOutput:
    """One generated continuation."""

    index: int
    """Sample index within the request."""
    token_ids: list[int]
    """Generated token ids (a stop token or stop sequence included)."""
    logprobs: list[float]
    """Per-token log-probs under the sampling distribution used."""
    policy_versions: list[int]
    """Policy version that produced each token."""
    finish_reason: str | None
    """'stop', 'length' or 'abort'."""
    routed_experts: object = None
    """Routing replay (engine built with `record_routes`): int16 numpy [P + G - 1, L_moe, k], the experts each
    MoE layer chose for every token the engine ran for this sample (prompt, then generated; the last token
    is sampled, never run), -1 where unknown; None when not recorded."""


@dataclass
class RequestOutput:
    """A finished request."""

    request_id: str
    """Id given to or returned by add_request."""
    prompt_token_ids: list[int]
    """The prompt."""
    samples: list[SampleOutput] = field(default_factory=list)
    """n continuations, by index."""
    compression: CompressionRecord | None = None
    """What context compression removed from the prompt as sent (None: not requested); `prompt_token_ids`
    are then the compressed ids the model saw."""


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    open: int
    compression: CompressionRecord | None = None


class RolloutEngine:
    """Paged, continuously batched generation from a Megatron GPTModel (see module docstring)."""

    def __init__(self, model, cfg: EngineConfig | None = None, tp_group=None, cp_group=None, version: int = 0,
                 summarizer: Summarizer | None = None, valid_vocab: int | None = None,
                 moe_layers: list[int] | None = None, device=None):
        self.cfg = cfg or EngineConfig()
        self.valid_vocab = valid_vocab  # ids >= this pad the model's vocab: never sampled, not in any log-prob
        self.summarizer = summarizer
        self.cfg.validate()
        self.runner = ModelRunner(model, tp_group, cp_group)
        if moe_layers is not None:  # routing replay: record every token's experts (models/routing_replay.py)
            self.runner.record_routes(moe_layers)
        self.cache = self.runner.make_cache(self.cfg.num_blocks, self.cfg.block_size, device)  # + batches
        self.scheduler = Scheduler(self.cache, self.cfg.max_tokens_per_step, self.cfg.max_running,
                                   self.cfg.prefix_cache)
        self.version = version
        self.lock = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._done: list[RequestOutput] = []
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(self.cfg.seed)
        self.counters = {"generated_tokens": 0, "prompt_tokens": 0, "steps": 0, "forward_s": 0.0}

    @classmethod
    def build(cls, model_cfg, cfg: EngineConfig | None = None, parallel=None, pgs=None, version: int = 0,
              valid_vocab: int | None = None, record_routes: bool = False, device=None):
        """Build the policy with `build_gpt` (the trainer's definition) and wrap it; `valid_vocab`: the
        tokenizer's size when the model's vocabulary is padded past it; `record_routes`: keep each token's
        experts (routing replay, `SampleOutput.routed_experts`); `device`: the rank's (ctx.device), where the KV
        cache and every batch live (None: the model's)."""
        import dataclasses

        from megatron_rl.models.gpt import build_gpt
        from megatron_rl.models.routing_replay import moe_layer_ids
        from megatron_rl.parallel import ParallelConfig

        cfg = cfg or EngineConfig()
        if cfg.dtype != "model":
            model_cfg = dataclasses.replace(model_cfg, params_dtype=cfg.dtype)
        # the runner feeds every layer the whole packed batch [T, 1, H]: no sequence-parallel split (the
        # trainer's MoE at TP > 1 needs one; the same parameters serve without it)
        parallel = dataclasses.replace(parallel or ParallelConfig(), sequence_parallel=False)
        model = build_gpt(model_cfg, parallel, pgs)
        return cls(model, cfg, getattr(pgs, "tp", None), getattr(pgs, "cp", None), version, valid_vocab=valid_vocab,
                   moe_layers=moe_layer_ids(model_cfg) if record_routes else None, device=device)

    @property
    def model(self):
        return self.runner.model

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, turn_boundaries: list[int] | None = None,
                    compression: CompressionConfig | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError naming the problem for bad input.

        With `compression` (and the token offsets where each turn starts, `turn_boundaries`) the prompt is
        compressed first (see compression.py); the output reports the compressed prompt and the record.
        """
        prompt, record = self.compress(prompt_token_ids, turn_boundaries, compression)
        return self.add_prepared(prompt, params, request_id, record)

    def compress(self, prompt_token_ids: list[int], turn_boundaries: list[int] | None = None,
                 compression: CompressionConfig | None = None) -> tuple[list[int], CompressionRecord | None]:
        """The prompt as ints, compressed when `compression` is given (then `turn_boundaries` is required)."""
        prompt = [int(t) for t in prompt_token_ids]
        if compression is None:
            if turn_boundaries is not None:
                raise ValueError("turn_boundaries given without a compression config; pass compression too")
            return prompt, None
        if turn_boundaries is None:
            raise ValueError("compression needs turn_boundaries: the token offset where each turn starts")
        if not prompt:
            raise ValueError("prompt_token_ids is empty; send at least one token id")
        try:
            return compress_turns(prompt, turn_boundaries, compression, self.summarizer)
        except ConfigError as e:
            raise ValueError(str(e)) from e

    def add_prepared(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                     compression: CompressionRecord | None = None) -> str:
        """Queue an already compressed (or uncompressed) prompt; see add_request."""
        params = params or SamplingParams()
        params.validate()
        if params.n > self.cfg.max_running:
            raise ValueError(f"n={params.n} samples of one request exceed engine.max_running={self.cfg.max_running} "
                             f"(its samples decode together); raise engine.max_running or ask for fewer samples")
        prompt = [int(t) for t in prompt]
        self._check_prompt(prompt, params)
        with self.lock:
            rid = request_id or f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in flight")
            seed = params.seed if params.seed is not None else int(torch.randint(2**31, (1,), generator=self._seed_gen))
            seqs = [self._new_seq(rid, i, prompt, params, seed) for i in range(params.n)]
            seqs[0].pending_forks = params.n - 1
            self._requests[rid] = _Request(prompt, params, seqs, params.n, compression)
            self.scheduler.add(seqs[0])
            self.counters["prompt_tokens"] += len(prompt)
        return rid

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        vocab, max_len = self.model.vocab_size, self.model.max_sequence_length
        if not prompt:
            raise ValueError("prompt_token_ids is empty; send at least one token id")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_new_tokens > max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
                             f"model's max_seq_length {max_len}; shorten the prompt or lower max_tokens")
        need = -(-(len(prompt) + params.max_new_tokens) // self.cfg.block_size)
        if need > self.cfg.num_blocks:
            raise ValueError(f"a sequence of {len(prompt)} + {params.max_new_tokens} tokens needs {need} KV blocks; "
                             f"the pool has {self.cfg.num_blocks} (raise rollout.num_blocks or lower max_new_tokens)")

    def _new_seq(self, rid: str, index: int, prompt: list[int], params: SamplingParams, seed: int) -> Sequence:
        gen = torch.Generator().manual_seed(seed + index)
        return Sequence(next(self._ids), rid, index, list(prompt), len(prompt), params, gen)

    def abort(self, request_id: str) -> bool:
        """End a request now (finish reason 'abort'), freeing its blocks; False if unknown or finished."""
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            for seq in req.seqs:
                if seq.finish_reason is None:
                    self._finish(seq, "abort")
            return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._done)

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled mixed batch; returns the requests that finished."""
        # inference_mode for the whole step; torch-function modes (the CPU compat layer's CUDA->CPU remap)
        # off: the mode's Python hook per op is pure overhead (on, under the CPU device check)
        from megatron_rl.compat.device_check import modes_off

        with self.lock, torch.inference_mode(), modes_off():
            plan = self.scheduler.schedule()
            if plan:
                t0 = time.perf_counter()
                batch = build_batch(plan, self.cache)
                logits = self.runner.forward(batch, self.cache)  # [R, V]
                if self.cache.routes is not None:
                    self.cache.write_routes(batch.slots, self.runner.last_routes)  # [T, L_moe, k]
                self.counters["forward_s"] += time.perf_counter() - t0
                self.counters["steps"] += 1
                self._advance(plan, logits)
            return self.pop_finished()

    def pop_finished(self) -> list[RequestOutput]:
        """Requests finished (or aborted) since the last call."""
        with self.lock:
            done, self._done = self._done, []
            return done

    def _advance(self, plan: list, logits: torch.Tensor) -> None:
        """Mark the chunks computed, fork pending siblings, sample, append and check stops."""
        samplers, rows, row = [], [], 0
        for seq, chunk in plan:
            seq.num_computed += chunk
            if self.scheduler.prefix_cache and seq.num_computed == seq.prompt_len:  # shareable by later requests
                self.cache.register(seq.table, seq.tokens, seq.num_computed)
            if seq.num_computed == len(seq.tokens):  # its last token ran: logits row `row` is its next token's
                for s in [seq, *self._fork(seq)]:
                    samplers.append(s)
                    rows.append(row)
                row += 1
        if not samplers:
            return
        logits = logits[rows] if self.valid_vocab is None else logits[rows, :self.valid_vocab]  # [R', V_valid]
        tokens, logps = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        tokens, logps = self._tp_broadcast(tokens, logps)
        for seq, tok, lp in zip(samplers, tokens.tolist(), logps.tolist()):
            self._append(seq, tok, lp)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Siblings of a prompt just prefilled, sharing its blocks."""
        if not seq.pending_forks:
            return []
        req = self._requests[seq.request_id]
        sibs = req.seqs[1:1 + seq.pending_forks]
        seq.pending_forks = 0
        for sib in sibs:
            sib.table = self.cache.fork(seq.table)
            sib.num_computed = seq.num_computed
            self.scheduler.add_running(sib)
        return sibs

    def _tp_broadcast(self, tokens: torch.Tensor, logps: torch.Tensor):
        """TP rank 0's sampled tokens and log-probs on every TP rank."""
        group = self.runner.tp_group
        if group is None:
            return tokens, logps
        both = torch.stack([tokens.double(), logps.double()])  # [2, R]
        dist.broadcast(both, src=dist.get_global_rank(group, 0), group=group)
        return both[0].long(), both[1].float()

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version)
        self.counters["generated_tokens"] += 1
        reason = self._stop_reason(seq)
        if reason:
            self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence) -> str | None:
        p, gen = seq.params, seq.generated
        if gen[-1] in p.stop_token_ids or any(gen[-len(s):] == list(s) for s in p.stop if len(gen) >= len(s)):
            return "stop"
        if len(gen) >= p.max_new_tokens or len(seq.tokens) >= self.model.max_sequence_length:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if self.cache.routes is not None:  # before its blocks go back to the pool
            n = min(seq.num_computed, len(seq.table.blocks) * self.cfg.block_size)
            seq.routes = self.cache.read_routes(seq.table, n).numpy()  # [n, L_moe, k]
        self.scheduler.finish(seq)
        req = self._requests[seq.request_id]
        if seq.pending_forks:  # aborted before its prompt was prefilled: the siblings end too
            for sib in req.seqs[1:1 + seq.pending_forks]:
                sib.finish_reason = reason
                req.open -= 1
            seq.pending_forks = 0
        req.open -= 1
        if req.open == 0:
            self._done.append(self._output(seq.request_id, self._requests.pop(seq.request_id)))

    @staticmethod
    def _output(rid: str, req: _Request) -> RequestOutput:
        samples = [SampleOutput(s.index, s.generated, s.logprobs, s.versions, s.finish_reason, s.routes)
                   for s in req.seqs]
        return RequestOutput(rid, req.prompt, samples, req.compression)

    # ------------------------------------------------------------------------------------- helpers
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 turn_boundaries: list[list[int]] | None = None, compression: CompressionConfig | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        bounds = turn_boundaries if turn_boundaries is not None else [None] * len(prompts)
        ids = [self.add_request(p, sp, turn_boundaries=b, compression=compression if b is not None else None)
               for p, sp, b in zip(prompts, plist, bounds)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       policy: UpdatePolicy | None = None, complete: bool = False) -> int:
        """Copy tensors into the parameters of the same names (between steps); returns how many.
        complete: every parameter of the engine must be written (else RuntimeError naming the missing ones)."""
        policy = policy or self.cfg.update_policy
        if policy not in ("continue", "abort"):
            raise ValueError(f"update policy {policy!r}: use 'continue' or 'abort'")
        with self.lock:
            written: set[str] = set()
            n = load_named_tensors(self.model, named_tensors, written)
            missing = sorted(set(dict(self.model.named_parameters())) - written) if complete else []
            if missing:
                raise RuntimeError(f"weight sync to policy version {version} left {len(missing)} engine parameters "
                                   f"unwritten (the trainer sent no tensor of that name): {missing[:8]}"
                                   f"{' ...' if len(missing) > 8 else ''}")
            self.version = version
            self._after_update(policy)
            return n

    def update_weights_from_broadcast(self, version: int, src: int, group=None, named_tensors=None,
                                      policy: UpdatePolicy | None = None, full_tensors: bool = True,
                                      bucket_bytes: int = 64 << 20) -> int:
        """Receive (name, tensor) pairs broadcast in buckets from global rank `src` over `group` and load them.

        The source passes `named_tensors` (it may be an engine rank itself); full (unsharded) tensors are
        cut to this rank's TP slice when `full_tensors`, otherwise they must already be this rank's shard.
        """
        from megatron_rl.rollout.weights import broadcast_named_tensors, shard_for_tp

        tp = self.runner.tp_group
        rank, size = (tp.rank(), tp.size()) if tp is not None else (0, 1)
        params = dict(self.model.named_parameters())

        def received():
            for name, t in broadcast_named_tensors(named_tensors, src, group, bucket_bytes, device=self.cache.device):
                p = params.get(name)
                yield name, shard_for_tp(t, p, rank, size) if full_tensors and p is not None else t

        return self.update_weights(version, received(), policy)

    def _after_update(self, policy: UpdatePolicy) -> None:
        self.cache.clear_prefix()  # K/V of the old weights are never shared with new requests
        if policy == "abort":
            for rid in list(self._requests):
                self.abort(rid)
        elif self.cfg.kv_on_update == "recompute":
            self.scheduler.preempt_all()

    def stats(self) -> dict:
        """Queue, KV-cache and throughput figures (for /metrics)."""
        with self.lock:
            s = self.scheduler
            return {"queue_length": len(s.waiting), "running": len(s.running),
                    "kv_blocks_total": self.cache.num_blocks,
                    "kv_blocks_used": self.cache.num_blocks - self.cache.num_free,
                    "preemptions": s.num_preemptions, "requests_in_flight": len(self._requests),
                    "prefix_hit_tokens": s.prefix_hit_tokens,
                    "policy_version": self.version, **self.counters}


@torch.no_grad()
def load_named_tensors(model, named_tensors: Iterable[tuple[str, torch.Tensor]], written: set | None = None) -> int:
    """Copy each (name, tensor) into `model`'s parameter (or weight buffer: the MoE expert bias) of that name;
    errors name the parameter; the names written are added to `written`."""
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    n = 0
    for name, tensor in named_tensors:
        if name not in params:
            raise KeyError(f"update_weights: the model has no parameter {name!r} (names must match the trainer's)")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                             f"the model's is {tuple(params[name].shape)} (same TP layout needed)")
        if tensor.data_ptr() != params[name].data_ptr():  # the sync may have received it in place already
            params[name].copy_(tensor.detach())
        if written is not None:
            written.add(name)
        n += 1
    return n
