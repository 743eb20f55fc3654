"""The code domain's reward: the payload's unit tests against the response's code (`envs.code.verifier` runs them:
candidate and verifier in separate sandboxes; its threat model is in that module and in `envs.rewards`).
Registered into `envs.reward_spec.REWARDS` when `envs.code` is imported."""
from __future__ import annotations

from megatron_rl.envs.code.verifier import run_unit_tests as _run
from megatron_rl.envs.reward_spec import RewardContext, reward
from megatron_rl.envs.rewards import extract_code
from megatron_rl.envs.sandbox.base import Limits
from megatron_rl.envs.types import RewardOutput


def run_unit_tests(sandbox, code: str, tests: list[str], limits: Limits | None = None,
                   per_test_s: float = 2.0, site: bool = False) -> tuple[list[tuple[bool, str]], str, str]:
    """Run `tests` against `code`: candidate and verifier in separate sandboxes (`envs.code.verifier`)."""
    return _run(sandbox, code, tests, limits, per_test_s, site)


@reward("unit_tests", version="2")
def unit_tests_reward(ctx: RewardContext, tests_key: str = "tests", per_test_s: float = 2.0,
                      site: bool = False) -> RewardOutput:
    """Fraction of the payload's unit tests that pass against the code extracted from the response (`site`:
    the solution may import site packages, as it always may in a domain image; else the standard library only)."""
    tests = list(ctx.task.payload.get(tests_key, []))
    code = ctx.state.get("code") if "code" in ctx.state else extract_code(ctx.response)
    if not tests:
        return RewardOutput(0.0, f"task has no {tests_key!r}", status="error")
    if not code:
        return RewardOutput(0.0, "no code found (put it in a ```python block)")
    if ctx.sandbox is None:
        return RewardOutput(0.0, "no sandbox available", status="sandbox_error")
    site = site or getattr(ctx.sandbox, "layer", None) is not None
    results, reason, status = run_unit_tests(ctx.sandbox, code, tests, ctx.state.get("limits"), per_test_s, site)
    passed = sum(p for p, _ in results)
    fails = "; ".join(dict.fromkeys(m for p, m in results if not p))[:300]
    prov = {"sandbox": getattr(ctx.sandbox, "name", "?"), "tests": len(tests)}
    return RewardOutput(passed / len(tests), f"{passed}/{len(tests)} tests passed. {reason} {fails}".strip(),
                        prov, status)
