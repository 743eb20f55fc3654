"""The `harbor_tests` reward: the task's tests over the final workspace in a verifier sandbox of their own.

Threat model: `envs.harbor.verifier` (pristine tests, a fresh sandbox, a result file the agent's workspace
cannot carry, read as a regular file only after every process the tests started is dead; what is not covered
is stated there)."""
from __future__ import annotations

import hashlib
import json

from megatron_rl.envs.base import RewardContext, RewardOutput
from megatron_rl.envs.rewards import reward


@reward("harbor_tests", version="1")
def harbor_tests_reward(ctx: RewardContext) -> RewardOutput:
    """The reward test.sh wrote (clamped to [0, 1]; none or unparsable: 0)."""
    from megatron_rl.envs.harbor.verifier import run_tests

    ws = ctx.state.get("workspace")
    if ws is None or not (ctx.task.payload.get("tests") or {}).get("text", {}).get("test.sh"):
        return RewardOutput(0.0, "task has no tests/test.sh or no workspace", status="error")
    if ctx.sandbox is None:
        return RewardOutput(0.0, "no sandbox available", status="sandbox_error")
    tests = json.dumps(ctx.task.payload["tests"], sort_keys=True)
    prov = {"sandbox": getattr(ctx.sandbox, "name", "?"),
            "tests_sha256": hashlib.sha256(tests.encode()).hexdigest()[:16]}
    score, reason, status, _ = run_tests(ctx.sandbox, ws.files, ctx.task.payload, ctx.state["limits"])
    return RewardOutput(score, reason[:600], prov, status)
