"""The dispatch layer's test double: `ScriptedGenerator` (generator.kind=scripted), a test policy that lets
dispatch, workers and shards be tested without a model. Kept out of the product modules; the workers load it by
that config kind (they run in processes of their own, so it lives in the package, not under tests/)."""
from __future__ import annotations

import json
import time

import numpy as np

from megatron_rl.dispatch.spec import EpisodeSpec, GeneratorConfig
from megatron_rl.tokenizer import Tokenizer


class ScriptedGenerator:
    """A TEST POLICY, NOT A MODEL: answers from the task's hidden reference data (countdown's
    `payload['solution']`), or a deliberately wrong answer for a seeded fraction of episodes, after
    `tool_turns` turns of tool calls when asked (a multi-turn episode). Its log-probs are fixed made-up numbers.
    It exists so dispatch and shards can be tested without a GPU."""

    def __init__(self, config: GeneratorConfig, tokenizer: Tokenizer):
        self.config, self.tok = config, tokenizer

    def _wrong(self, episode: EpisodeSpec) -> bool:
        rng = np.random.default_rng([episode.seed, 7919])
        return bool(rng.random() < self.config.wrong_fraction)

    def answer_text(self, episode: EpisodeSpec) -> str:
        payload = episode.task.get("payload", {})
        answer = payload.get("solution") or payload.get("answer") or ""
        if self._wrong(episode) or not answer:
            return "<think>test policy: wrong on purpose</think><answer>0</answer>"
        return f"<think>test policy</think><answer>{answer}</answer>"

    def tool_call_text(self, episode: EpisodeSpec, turn: int) -> str:
        """Turn `turn`'s tool call (`tool_turns`): a file written on even turns, the workspace listed on odd ones."""
        if turn % 2:
            return '<tool_call>{"name": "list_files", "arguments": {}}</tool_call>'
        args = json.dumps({"path": f"notes/{turn}.txt", "content": f"{episode.episode_id} turn {turn}"})
        return f'<tool_call>{{"name": "write_file", "arguments": {args}}}</tool_call>'

    def generate(self, prompt_ids, sampling, episode=None, turn=0):
        if episode is None:
            raise ValueError("ScriptedGenerator (test policy) needs the episode to answer from")
        if self.config.turn_delay_s:
            time.sleep(self.config.turn_delay_s)
        text = self.tool_call_text(episode, turn) if turn < self.config.tool_turns else self.answer_text(episode)
        ids = self.tok.encode(text) + [self.tok.eos_id]
        logprobs = [-0.1 * (1 + i % 5) for i in range(len(ids))]  # made-up, deterministic
        return ids, logprobs, self.config.policy_version
