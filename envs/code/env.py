"""Code environment: single turn; the model writes a Python function in a ```python block and the reward is
the fraction of the task's hidden unit tests that pass, run in the sandbox (never in the worker).

Task payload: `entry_point` (function name), `tests` (Python statements, usually asserts, each one test),
`canonical_solution` (a reference solution; used by the suite's own tests, never shown).
Reward: `tests` (weight 1) the pass rate; `format` (weight 0, recorded) whether a fenced block was used.

THREAT MODEL of the reward (details in `envs.code.verifier`): trusted are the task's tests and the worker.
The solution runs in a candidate sandbox that is given only the arguments of the calls the tests make
(never the tests, expected values or assertions); the tests run after it in a separate verifier sandbox that
holds no model code (a child forked per verdict by a pristine verifier process, `envs.sandbox.zygote`),
against the candidate's serialised return values decoded into plain built-in types.
So reading the tests, forging output lines, `os._exit`, patching json/print/builtins and always-equal
objects score nothing. Not covered: the function sees its own arguments; tasks whose tests need non-plain
return values (objects, generators) or read a solution's constants need another verifier.
"""
from __future__ import annotations

from megatron_rl.envs.base import ENVIRONMENTS, RewardComponent, RewardSpec, SingleTurnEnvironment
from megatron_rl.envs.rewards import extract_code
from megatron_rl.envs.sandbox.base import Limits


@ENVIRONMENTS.register("code")
class CodeEnv(SingleTurnEnvironment):
    name = "code"
    success_component = "tests"
    instructions = "Write the complete function in Python 3 inside a single ```python code block."
    limits = Limits(wall_s=10.0, cpu_s=10.0, memory_mb=512)

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("tests", "unit_tests", 1.0),
                           RewardComponent("format", "format", 0.0, {"kind": "code_fence"})])

    def _reward_state(self) -> dict:
        return {"code": extract_code(self.last_action), "limits": self.limits}
