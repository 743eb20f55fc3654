"""Weighted, deterministic, resumable sampling of tasks across domains, and per-domain metrics.

Draw k picks its domain with a random generator seeded by (seed, k), so the sequence depends only on the
seed and the weights; within a domain, tasks come in a fresh seeded permutation per epoch. The state
(draw count and each domain's epoch and position) is a small dict that goes into the driver checkpoint;
after `load_state_dict` the sampler continues exactly where it stopped.

With a curriculum (`envs.curriculum.DomainCurriculum`) the weights of the draws are the curriculum's current
probabilities, which move with the groups recorded (`record_group`); its state is part of the sampler's, so a
resumed run draws the same sequence with the same weights. Per-domain metrics count groups and the groups with
no gradient (every valid sample got the same reward).

Difficulty levels within a domain (`levels`: domain -> its train tasks per level, easiest first; the mixture's
`level_tasks`): the domain draws from its current level's tasks; once its last `level_groups` groups there have a
mean reward >= `level_up_at`, it moves to the next level (a fresh permutation of that level's tasks). The level
and its window of group means are part of the state, so a resumed run climbs exactly as an unbroken one.
"""
from __future__ import annotations

import hashlib
import math
import random
from collections import defaultdict

from megatron_rl.envs.base import EnvError, RewardResult, Task


def _fingerprint(tasks: list[Task]) -> str:
    return hashlib.sha256("\n".join(t.id for t in tasks).encode()).hexdigest()[:16]


class DomainMetrics:
    """Accumulates reward statistics per domain between `summary(reset=True)` calls."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._n = defaultdict(int)
        self._sum = defaultdict(float)
        self._sq = defaultdict(float)
        self._comp = defaultdict(lambda: defaultdict(float))
        self._status = defaultdict(lambda: defaultdict(int))
        self._invalid = defaultdict(int)
        self._turns = defaultdict(int)
        self._groups = defaultdict(int)
        self._flat = defaultdict(int)

    def record_group(self, domain: str, rewards: list[float]) -> None:
        """One group's valid rewards: counted, and counted as having no gradient when they are all equal."""
        self._groups[domain] += 1
        self._flat[domain] += len(rewards) < 2 or max(rewards) - min(rewards) <= 1e-9

    def record(self, domain: str, reward: RewardResult | float, status: str = "ok", turns: int = 1) -> None:
        """One episode: its reward, its status (not ok: an infrastructure failure, whose reward is not a score
        and is left out of the reward statistics) and its turns."""
        total = reward.total if isinstance(reward, RewardResult) else float(reward)
        valid = reward.valid if isinstance(reward, RewardResult) else status == "ok"
        self._n[domain] += 1
        self._turns[domain] += turns
        self._status[domain][status] += 1
        self._invalid[domain] += not valid
        if not valid:
            return
        self._sum[domain] += total
        self._sq[domain] += total * total
        if isinstance(reward, RewardResult):
            for name, v in reward.components.items():
                self._comp[domain][name] += v

    def summary(self, reset: bool = False) -> dict[str, float]:
        """Flat metrics: '<domain>/reward_mean', '/reward_std', '/count', '/turns_mean', '/<component>_mean',
        '/status_<s>' (fraction), '/groups' and '/no_gradient_frac' (groups whose valid samples all got the same
        reward: GRPO learns nothing from them; when groups were recorded), '/infra_error_frac' (episodes whose
        status is not ok: sandbox errors, infrastructure timeouts, lost workers; never scored, dropped from
        training; alias '/invalid_frac')."""
        out = {}
        for d in sorted(set(self._groups) - set(self._n)):  # groups recorded without their episodes
            out[f"{d}/groups"] = float(self._groups[d])
            out[f"{d}/no_gradient_frac"] = self._flat[d] / self._groups[d]
        for d, n in sorted(self._n.items()):
            nv = max(n - self._invalid[d], 1)  # reward statistics over the valid episodes only
            mean = self._sum[d] / nv
            out[f"{d}/count"] = float(n)
            out[f"{d}/reward_mean"] = mean
            out[f"{d}/reward_std"] = math.sqrt(max(self._sq[d] / nv - mean * mean, 0.0))
            out[f"{d}/turns_mean"] = self._turns[d] / n
            out[f"{d}/infra_error_frac"] = out[f"{d}/invalid_frac"] = self._invalid[d] / n
            out.update({f"{d}/{c}_mean": v / nv for c, v in sorted(self._comp[d].items())})
            out.update({f"{d}/status_{s}": c / n for s, c in sorted(self._status[d].items())})
            if self._groups[d]:
                out[f"{d}/groups"] = float(self._groups[d])
                out[f"{d}/no_gradient_frac"] = self._flat[d] / self._groups[d]
        if reset:
            self.reset()
        return out


class DomainSampler:
    """Samples tasks from several domains with weights; deterministic given the seed; resumable."""

    def __init__(self, tasks: dict[str, list[Task]], weights: dict[str, float] | None = None, seed: int = 0,
                 curriculum=None, levels: dict[str, list[list[Task]]] | None = None):
        """`curriculum`: an `envs.curriculum.DomainCurriculumConfig` (enabled: moving the weights; its level_up_at
        and level_groups: the climb through `levels`); None = fixed weights. `levels`: domain -> its tasks per
        difficulty level (they replace `tasks[domain]`, level 0 first)."""
        weights = {d: 1.0 for d in tasks} if not weights else dict(weights)
        unknown = sorted(set(weights) - set(tasks))
        if unknown:
            raise EnvError(f"sampler weights name unknown domain(s) {unknown}; domains: {sorted(tasks)}")
        bad = {d: w for d, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
        if bad:
            raise EnvError(f"sampler weights must be finite and >= 0, got {bad}")
        self.domains = sorted(d for d, w in weights.items() if w > 0)
        if not self.domains:
            raise EnvError(f"no domain has a positive weight: {weights}")
        empty = [d for d in self.domains if not tasks[d]]
        if empty:
            raise EnvError(f"domain(s) {empty} have weight > 0 but no tasks; check the task files and split")
        self.levels = {d: [list(ts) for ts in lv] for d, lv in (levels or {}).items() if d in self.domains and lv}
        empty = [f"{d} level {i}" for d, lv in self.levels.items() for i, ts in enumerate(lv) if not ts]
        if empty:
            raise EnvError(f"difficulty level(s) without tasks: {empty}")
        self.level = {d: 0 for d in self.levels}
        self._level_window: dict[str, list[float]] = {d: [] for d in self.levels}
        self.level_up_at = getattr(curriculum, "level_up_at", 0.8)
        self.level_groups = getattr(curriculum, "level_groups", 4)
        self.tasks = {d: list(self.levels[d][0] if d in self.levels else tasks[d]) for d in self.domains}
        self.weights = [float(weights[d]) for d in self.domains]
        self.seed = int(seed)
        self.draws = 0
        self.positions = {d: [0, 0] for d in self.domains}  # domain -> [epoch, index in the epoch's order]
        self._perm: dict[str, tuple[int, list[int]]] = {}
        self.metrics = DomainMetrics()
        self.sampled = defaultdict(int)
        self.curriculum = None
        if curriculum is not None and curriculum.enabled:
            self.curriculum = curriculum.build(dict(zip(self.domains, self.weights)))

    def _order(self, domain: str, epoch: int) -> list[int]:
        cached = self._perm.get(domain)
        if cached is None or cached[0] != epoch:
            idx = list(range(len(self.tasks[domain])))
            random.Random(f"{self.seed}:{domain}:{epoch}").shuffle(idx)
            cached = self._perm[domain] = (epoch, idx)
        return cached[1]

    def next_domain(self) -> str:
        return random.Random(f"{self.seed}:draw:{self.draws}").choices(self.domains, self._draw_weights())[0]

    def _draw_weights(self) -> list[float]:
        if self.curriculum is None:
            return self.weights
        p = self.curriculum.probabilities()
        return [p[d] for d in self.domains]

    def probabilities(self) -> dict[str, float]:
        """Domain -> its probability of the next draw (the curriculum's now, else the configured weights')."""
        w = self._draw_weights()
        total = sum(w)
        return {d: x / total for d, x in zip(self.domains, w)}

    def next(self) -> Task:
        domain = self.next_domain()
        epoch, i = self.positions[domain]
        task = self.tasks[domain][self._order(domain, epoch)[i]]
        i += 1
        self.positions[domain] = [epoch + 1, 0] if i == len(self.tasks[domain]) else [epoch, i]
        self.draws += 1
        self.sampled[domain] += 1
        return task

    def sample(self, n: int) -> list[Task]:
        return [self.next() for _ in range(n)]

    def __iter__(self):
        while True:
            yield self.next()

    def record(self, task: Task, reward: RewardResult | float, status: str = "ok", turns: int = 1) -> None:
        """Accumulate an episode's reward into the per-domain metrics."""
        self.metrics.record(task.domain, reward, status, turns)

    def record_group(self, task: Task, rewards: list[float]) -> None:
        """A finished group of `task`: its valid samples' rewards (metrics; the curriculum's weights move)."""
        self.metrics.record_group(task.domain, rewards)
        if self.curriculum is not None:
            self.curriculum.observe(task.domain, [float(r) for r in rewards])
        if task.domain in self.levels and rewards:
            self._climb(task.domain, sum(rewards) / len(rewards))

    def _climb(self, domain: str, mean: float) -> None:
        """One group of `domain` at its level: the next level once the last `level_groups` means reach
        `level_up_at` (tasks of a group drawn before the move still count for the level they were drawn at)."""
        window = self._level_window[domain]
        window.append(float(mean))
        del window[:-self.level_groups]
        last = len(self.levels[domain]) - 1
        if self.level[domain] < last and len(window) == self.level_groups and \
                sum(window) / len(window) >= self.level_up_at:
            self._set_level(domain, self.level[domain] + 1)

    def _set_level(self, domain: str, level: int) -> None:
        self.level[domain], self._level_window[domain] = level, []
        self.tasks[domain] = self.levels[domain][level]
        self.positions[domain] = [0, 0]
        self._perm.pop(domain, None)

    def level_metrics(self) -> dict[str, float]:
        """'<domain>/level' of every domain with difficulty levels."""
        return {f"{d}/level": float(lv) for d, lv in sorted(self.level.items())}

    def state_dict(self) -> dict:
        cur = {"curriculum": self.curriculum.state_dict()} if self.curriculum is not None else {}
        if self.levels:
            cur["levels"] = {d: {"level": lv, "window": list(self._level_window[d])} for d, lv in self.level.items()}
        return {"version": 1, "seed": self.seed, "draws": self.draws, **cur,
                "positions": {d: {"epoch": e, "index": i, "num_tasks": len(self.tasks[d]),
                                  "fingerprint": _fingerprint(self.tasks[d])}
                              for d, (e, i) in self.positions.items()}}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from `state`. A domain whose task list changed since is an error (strict) or restarts
        from its beginning (strict=False); a new domain starts from its beginning."""
        if state.get("version") != 1:
            raise EnvError(f"unsupported sampler state version {state.get('version')!r} (expected 1)")
        for d, lv in state.get("levels", {}).items():  # before the positions: they index the level's tasks
            if d in self.levels:
                self._set_level(d, min(int(lv["level"]), len(self.levels[d]) - 1))
                self._level_window[d] = [float(x) for x in lv["window"]]
        positions = {d: [0, 0] for d in self.domains}
        for d, p in state["positions"].items():
            if d not in self.positions:
                continue
            if p["fingerprint"] != _fingerprint(self.tasks[d]):
                if strict:
                    raise EnvError(f"task suite of domain {d!r} changed since the checkpoint ({p['num_tasks']} -> "
                                   f"{len(self.tasks[d])} tasks); pass strict=False to restart it from its beginning")
                continue
            positions[d] = [int(p["epoch"]), int(p["index"])]
        self.seed, self.draws, self.positions = int(state["seed"]), int(state["draws"]), positions
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
        elif self.curriculum is not None and strict:
            raise EnvError("the checkpoint's sampler has no curriculum state but envs.curriculum is enabled now; "
                           "resume with envs.curriculum.enabled=false, or start a new run (output name)")
        self._perm.clear()
