"""Arithmetic environment: one turn; "What is 7 + 5?" answered in words, scored by the reply's final number.

A chat model answers such questions in prose ("7 + 5 = 12."), rarely as a bare number, so the answer is the
last integer of the reply (an explicit `Answer: N` line wins when there is one). The task suite is generated
(`build_tasks.py`): one-digit sums, differences and products and two-digit sums, with a held-out split of
disjoint questions. This is the main job's domain: SmolLM2-135M-Instruct starts partly competent on it.

Reward: `correct` (weight 1): the final number equals the task's `answer`. Threat model: the reward reads
text only (no code runs); the one forgery is to end with the right number, which is the skill itself. A reply
cut off by the token budget is scored on what it wrote so far.
"""
from __future__ import annotations

import re

from megatron_rl.envs.base import ENVIRONMENTS, RewardComponent, RewardContext, RewardSpec, SingleTurnEnvironment
from megatron_rl.envs.rewards import RewardOutput, reward

_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\$?\s*(-?\d+)", re.I)


def final_number(text: str) -> int | None:
    """The reply's answer: an `Answer: N` line if any, else its last integer; None when it has none."""
    m = _ANSWER.search(text)
    if m:
        return int(m.group(1))
    nums = re.findall(r"-?\d+", text.replace(",", ""))
    return int(nums[-1]) if nums else None


@reward("final_number")
def final_number_reward(ctx: RewardContext, answer_key: str = "answer") -> RewardOutput:
    gold = ctx.task.payload.get(answer_key)
    if gold is None:
        return RewardOutput(0.0, f"task has no {answer_key!r} in its payload", status="error")
    got = final_number(ctx.response[:4096])
    if got is None:
        return RewardOutput(0.0, "no number in the reply")
    return RewardOutput(float(got == int(gold)), f"final number {got}, expected {gold}")


@ENVIRONMENTS.register("arithmetic")
class ArithmeticEnv(SingleTurnEnvironment):
    name = "arithmetic"

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("correct", "final_number", 1.0)])
