"""The rollout worker's generators: where an episode's model turns come from (an OpenAI-style HTTP server, or a
scripted test policy of `dispatch/testing.py`), behind one Protocol."""
from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from megatron_rl.dispatch.spec import EpisodeSpec, GeneratorConfig
from megatron_rl.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Generator(Protocol):
    """Token in, token out: `generate(prompt_ids, sampling, episode, turn) -> (token_ids, logprobs, versions)`,
    `versions` the policy version of each token (or one int for all of them); with MoE routing replay a 4th
    item, (the tokens the engine ran, their experts [len - 1, L_moe, k]) (`parse_routes`).

    `episode` is passed for context; a real model ignores it (only the scripted test policy reads it).
    Raises `GenerationError` for a failed request.
    """

    def generate(self, prompt_ids: list[int], sampling: dict, episode: EpisodeSpec | None = None, turn: int = 0
                 ) -> tuple[list[int], list[float], int | list[int]]: ...


class GenerationError(RuntimeError):
    """A generation request failed. `retryable` (server unreachable, timed out, 5xx after the client's
    retries): the episode is not published and the dispatcher re-runs it. Otherwise (4xx, a malformed
    answer) re-running cannot help: the episode is published with `status` and the reason."""

    def __init__(self, message: str, status: str = "error", retryable: bool = False):
        super().__init__(message)
        self.status, self.retryable = status, retryable


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "max_tokens", "stop_token_ids", "seed")


class HttpGenerator:
    """The rollout engine over HTTP (`megatron_rl.rollout.client.RolloutClient`, `/v1/completions` with
    token ids in and token ids, behaviour log-probs and per-token policy versions out).

    One sample per request; the seed is the episode's (or `sampling['seed']`) plus the turn, so a retried
    episode asks for the same draws. EOS always stops a turn; a turn never asks for more tokens than the
    worker's token budget has left. The answer is checked before it is used (lengths, finite log-probs <= 0,
    versions >= 0): a malformed answer fails the episode, never the worker.
    """

    def __init__(self, config: GeneratorConfig, tokenizer: Tokenizer, max_tokens: int = 1 << 30):
        from megatron_rl.rollout.client import RolloutClient

        self.config, self.tok, self.max_tokens = config, tokenizer, max_tokens
        try:
            self.client = RolloutClient(config.url, timeout=config.timeout_s, retries=config.retries,
                                        backoff=config.backoff_s, token_file=config.token_file or None)
        except (OSError, ValueError) as e:
            raise GenerationError(f"generator.token_file {config.token_file}: cannot read the rollout server's "
                                  f"token ({e}); the driver writes it in the run folder, which this worker must "
                                  "see") from e

    def request(self, prompt_ids: list[int], sampling: dict, episode: EpisodeSpec | None, turn: int) -> dict:
        """The sampling fields of the /v1/completions body."""
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise GenerationError(f"episode sampling has unknown keys {unknown}; use {list(SAMPLING_KEYS)}")
        want = int(sampling.get("max_new_tokens", sampling.get("max_tokens", self.config.max_new_tokens)))
        seed = sampling.get("seed", episode.seed if episode is not None else 0)
        body = {"max_tokens": max(1, min(want, self.max_tokens - len(prompt_ids))),
                "stop_token_ids": sorted({*self.tok.stop_ids, *sampling.get("stop_token_ids", [])}),
                "seed": int(seed) + turn, "n": 1}
        body.update({k: sampling[k] for k in ("temperature", "top_p", "top_k") if k in sampling})
        if self.config.routed_experts:  # MoE routing replay
            body["return_routed_experts"] = True
        return body

    def generate(self, prompt_ids, sampling, episode=None, turn=0):
        from megatron_rl.rollout.client import RolloutError

        try:
            body = self.request(prompt_ids, sampling, episode, turn)
        except (TypeError, ValueError) as e:
            raise GenerationError(f"bad episode sampling {sampling!r}: {e}") from e
        try:
            out = self.client.complete(list(prompt_ids), **body)
        except RolloutError as e:
            transient = e.status is None or e.status >= 500 or e.status == 429
            status = "timeout" if "timed out" in str(e).lower() else "error"
            raise GenerationError(f"rollout server {self.config.url}: {e}", status, retryable=transient) from e
        except ValueError as e:  # a 200 whose body is not JSON
            raise GenerationError(f"rollout server {self.config.url}: answer is not JSON: {e}") from e
        ids, lps, versions = parse_completion(out)
        if not self.config.routed_experts:
            return ids, lps, versions
        return ids, lps, versions, parse_routes(out, prompt_ids, ids)


def parse_routes(out, prompt_ids: list[int], ids: list[int]) -> tuple[list[int], np.ndarray]:
    """(the tokens the request ran: its prompt as the server saw it + the completion, their experts int16
    [len - 1, L_moe, k]) of a /v1/completions answer asked with return_routed_experts; GenerationError if
    malformed."""
    from megatron_rl.data.routes import decode_routes

    try:
        routes = decode_routes(out["choices"][0]["routed_experts"])
    except (KeyError, TypeError, ValueError) as e:
        raise GenerationError(f"malformed completion from the rollout server: routed_experts: {e}") from e
    seen = [*(out.get("prompt_token_ids") or prompt_ids), *ids]
    if len(routes) != len(seen) - 1:
        raise GenerationError(f"malformed completion: routed_experts covers {len(routes)} tokens, the request "
                              f"ran {len(seen) - 1}")
    return seen, routes


def parse_completion(out) -> tuple[list[int], list[float], list[int]]:
    """(token_ids, logprobs, policy_versions) of a /v1/completions answer; GenerationError if malformed."""
    try:
        (choice,) = out["choices"]
        ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        versions = choice["policy_versions"]
        ids, lps, versions = [int(t) for t in ids], [float(x) for x in lps], [int(v) for v in versions]
    except (KeyError, TypeError, ValueError) as e:
        raise GenerationError(f"malformed completion from the rollout server ({type(e).__name__}: {e}); need "
                              "one choice with token_ids, logprobs.token_logprobs and policy_versions") from e
    if not len(ids) == len(lps) == len(versions):
        raise GenerationError(f"malformed completion: {len(ids)} token ids, {len(lps)} log-probs, "
                              f"{len(versions)} policy versions")
    if not all(np.isfinite(x) and x <= 1e-4 for x in lps) or any(v < 0 for v in versions):
        raise GenerationError("malformed completion: log-probs must be finite and <= 0, policy versions >= 0")
    return ids, lps, versions


def build_generator(config: GeneratorConfig, tokenizer: Tokenizer, max_tokens: int = 1 << 30) -> Generator:
    config.validate()
    if config.kind == "scripted":
        from megatron_rl.dispatch.testing import ScriptedGenerator

        return ScriptedGenerator(config, tokenizer)
    return HttpGenerator(config, tokenizer, max_tokens)
