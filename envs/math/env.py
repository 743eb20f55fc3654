"""Math environment: single turn; the final answer goes in \\boxed{} (or on an 'Answer:' line) and is checked
against the task's answer with math-verify (LaTeX and plain expressions, fractions, sets, intervals).

Task payload: `answer` (a LaTeX or plain expression). Reward: `correct` (weight 1) math-verify equality;
`format` (weight 0.1) whether the response has a \\boxed{} answer or an 'Answer:' line.
"""
from __future__ import annotations

from megatron_rl.envs.base import ENVIRONMENTS, RewardComponent, RewardSpec, SingleTurnEnvironment


@ENVIRONMENTS.register("math")
class MathEnv(SingleTurnEnvironment):
    name = "math"
    instructions = "Reason step by step, then put your final answer within \\boxed{}."

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("correct", "math_verify", 1.0),
                           RewardComponent("format", "format", 0.1, {"kind": "boxed_or_line"})])
