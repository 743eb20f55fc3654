"""The terminal domain's reward: the task's verifier over the final workspace (`envs.terminal.verifier` runs the
pristine unittest files; its threat model is in that module and in `envs.rewards`). Registered into
`envs.reward_spec.REWARDS` when `envs.terminal` is imported."""
from __future__ import annotations

import hashlib
import json

from megatron_rl.envs.reward_spec import RewardContext, reward
from megatron_rl.envs.terminal import verifier
from megatron_rl.envs.types import RewardOutput
from megatron_rl.envs.workspace import sandbox_problem


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


@reward("verifier", version="2")
def verifier_reward(ctx: RewardContext, verify_key: str = "verify") -> RewardOutput:
    """1 if the task's verifier passes over the final workspace, run in a sandbox of its own after the model's
    last command: the pristine unittest files under a harness that never imports the workspace
    (`envs.terminal.verifier`), or a custom command's exit status."""
    spec = ctx.task.payload.get(verify_key) or {}
    ws = ctx.state.get("workspace")
    if not spec.get("command") or ws is None:
        return RewardOutput(0.0, "task has no verifier or no workspace", status="error")
    if ctx.sandbox is None:
        return RewardOutput(0.0, "no sandbox available", status="sandbox_error")
    prov = {"sandbox": getattr(ctx.sandbox, "name", "?"),
            "verifier_sha256": _sha(json.dumps(spec, sort_keys=True))[:16]}
    if verifier.is_unittest_spec(spec):
        passed, reason, res = verifier.run_verifier(ctx.sandbox, ws.files, spec, ctx.state.get("limits"))
        problem = sandbox_problem(res)
        if problem and problem[1] != "ok":
            return RewardOutput(0.0, problem[0], prov, problem[1])
        return RewardOutput(float(passed), reason, prov)
    files = dict(ws.files)
    files.update(spec.get("files", {}))
    res = ctx.sandbox.run(spec["command"], files=files, limits=ctx.state.get("limits"))
    problem = sandbox_problem(res)
    if problem and problem[1] != "ok":
        return RewardOutput(0.0, problem[0], prov, problem[1])
    tail = (res.stdout + res.stderr)[-300:]
    return RewardOutput(float(res.exit_code == 0 and not res.violations),
                        f"verifier exit {res.exit_code} {res.violations or ''}: {tail}", prov)
