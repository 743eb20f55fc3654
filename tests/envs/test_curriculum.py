"""The online curriculum across domains (envs/curriculum.py) and the sampler that draws with it (envs/sampler.py):
weights move toward domains with mixed outcomes on a scripted policy, never below the floor, scale to 100+
domains, and resume exactly (same weights, same sampled sequence) from a JSON round trip of the state."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.envs.base import EnvError, Task
from megatron_rl.envs.curriculum import DomainCurriculumConfig
from megatron_rl.envs.mixture import MixtureConfig
from megatron_rl.envs.sampler import DomainSampler


def _tasks(domains: list[str], n: int = 5) -> dict[str, list[Task]]:
    return {d: [Task(f"{d}-{i}", d, "p") for i in range(n)] for d in domains}


def _scripted(domain: str, draw: int, group: int = 4) -> list[float]:
    """A scripted policy: 'solved*' always 1, 'failed*' always 0, anything else mixed outcomes."""
    if domain.startswith("solved"):
        return [1.0] * group
    if domain.startswith("failed"):
        return [0.0] * group
    return [float((draw + i) % 2) for i in range(group)]


def _run(sampler: DomainSampler, groups: int) -> list[str]:
    ids = []
    for _ in range(groups):
        task = sampler.next()
        ids.append(task.id)
        sampler.record_group(task, _scripted(task.domain, sampler.draws))
    return ids


def test_weights_move_toward_mixed_domains_and_respect_the_floor():
    cfg = DomainCurriculumConfig(enabled=True, floor=0.2, decay=0.8)
    s = DomainSampler(_tasks(["failed", "mixed", "solved"]), {"failed": 1, "mixed": 1, "solved": 2}, seed=3,
                      curriculum=cfg)
    base = {"failed": 0.25, "mixed": 0.25, "solved": 0.5}
    assert s.probabilities() == pytest.approx(base)
    _run(s, 300)
    p = s.probabilities()
    assert p["mixed"] > 0.7 and p["failed"] < base["failed"] and p["solved"] < base["solved"]
    for d in base:  # the floor: never below floor x the configured share
        assert p[d] >= 0.2 * base[d] - 1e-12
    assert p["solved"] == pytest.approx(0.2 * 0.5, abs=0.01) and p["failed"] == pytest.approx(0.2 * 0.25, abs=0.01)
    tail = _run(s, 400)  # the draws follow the weights
    assert sum(i.startswith("mixed") for i in tail) > 0.6 * len(tail)
    assert sum(i.startswith("failed") for i in tail) > 0  # not forgotten
    m = s.metrics.summary()
    assert m["solved/no_gradient_frac"] == 1.0 and m["failed/no_gradient_frac"] == 1.0
    assert m["mixed/no_gradient_frac"] == 0.0 and m["mixed/groups"] > 0


def test_disabled_or_floor_one_keeps_the_configured_weights():
    weights = {"failed": 1, "mixed": 3}
    fixed = DomainSampler(_tasks(["failed", "mixed"]), weights, seed=1)
    floor1 = DomainSampler(_tasks(["failed", "mixed"]), weights, seed=1,
                           curriculum=DomainCurriculumConfig(enabled=True, floor=1.0))
    assert _run(fixed, 200) == _run(floor1, 200)
    assert floor1.probabilities() == pytest.approx({"failed": 0.25, "mixed": 0.75})
    assert "curriculum" not in fixed.state_dict() and "curriculum" in floor1.state_dict()


def test_hundred_twenty_domains_learnable_ones_rise():
    names = [f"failed{i:03d}" for i in range(100)] + [f"mixed{i:02d}" for i in range(10)] + \
            [f"solved{i:02d}" for i in range(10)]
    cfg = DomainCurriculumConfig(enabled=True, floor=0.1, decay=0.5)
    s = DomainSampler(_tasks(names, 3), None, seed=0, curriculum=cfg)
    _run(s, 3000)
    p = s.probabilities()
    assert sum(p.values()) == pytest.approx(1.0)
    top = sorted(p, key=p.get, reverse=True)[:10]
    assert sorted(top) == [f"mixed{i:02d}" for i in range(10)]
    assert sum(p[d] for d in top) > 0.8
    assert min(p.values()) >= 0.1 / 120 - 1e-12  # every domain keeps its floor


def test_state_round_trip_resumes_the_exact_sequence():
    names = [f"failed{i}" for i in range(30)] + [f"mixed{i}" for i in range(5)] + [f"solved{i}" for i in range(5)]
    cfg = DomainCurriculumConfig(enabled=True, floor=0.15, decay=0.7, prior=0.6)
    weights = {d: 1.0 + (i % 3) for i, d in enumerate(names)}
    ref = DomainSampler(_tasks(names, 4), weights, seed=11, curriculum=cfg)
    head = _run(ref, 250)
    state = json.loads(json.dumps(ref.state_dict()))  # the driver checkpoint stores it as JSON
    assert state["curriculum"]["domains"]["mixed0"]["groups"] > 0
    resumed = DomainSampler(_tasks(names, 4), weights, seed=999, curriculum=cfg)
    resumed.load_state_dict(state)
    assert resumed.probabilities() == ref.probabilities()  # exactly, not approximately
    cont_ref, cont = _run(ref, 400), _run(resumed, 400)
    assert cont == cont_ref and resumed.probabilities() == ref.probabilities()
    fresh = DomainSampler(_tasks(names, 4), weights, seed=11, curriculum=cfg)
    assert _run(fresh, 250) == head and fresh.state_dict() == state  # and the same as an unbroken run
    uncurried = DomainSampler(_tasks(names, 4), weights, seed=11)
    uncurried_state = uncurried.state_dict()
    with pytest.raises(EnvError, match="no curriculum state but envs.curriculum is enabled"):
        resumed.load_state_dict(uncurried_state)


def test_config_documents_fields_and_refuses_bad_input():
    from megatron_rl.config import undocumented_fields

    assert undocumented_fields(DomainCurriculumConfig) == []
    m = from_dict(MixtureConfig, {"curriculum": {"enabled": True, "floor": 0.3}})
    assert m.curriculum.enabled and m.curriculum.floor == 0.3
    with pytest.raises(ConfigError, match=r"unknown config key 'envs.curriculum.flor'"):
        from_dict(MixtureConfig, {"curriculum": {"flor": 0.1}}, prefix="envs")
    with pytest.raises(ConfigError, match=r"envs.curriculum: floor=0.0 \(need 0 < floor <= 1\)"):
        from_dict(MixtureConfig, {"curriculum": {"floor": 0.0}}, prefix="envs")
    with pytest.raises(ConfigError, match=r"decay=1.0"):
        DomainCurriculumConfig(decay=1.0).build({"a": 1.0})


class _Clock:
    def summary(self) -> dict:
        return {"time_step_s": 1.0}


def test_loop_step_metrics_and_console_summary_over_120_domains(tmp_path, capsys):
    """The loop's hook points at 120 domains: `Rollouts.batch` records each group (`record_group`), `step_metrics`
    logs every domain's weight, count and no-gradient fraction, the monitor prints the summary naming the domains
    with no gradient and keeps them all in metrics.jsonl."""
    from types import SimpleNamespace

    from megatron_rl.loop.metrics import step_metrics
    from megatron_rl.monitoring import Monitor, MonitorConfig

    names = [f"failed{i:03d}" for i in range(100)] + [f"mixed{i:02d}" for i in range(20)]
    s = DomainSampler(_tasks(names, 3), None, seed=5, curriculum=DomainCurriculumConfig(enabled=True))
    for _ in range(60):  # one step's groups, as Rollouts.batch records them
        t = s.next()
        rewards = _scripted(t.domain, s.draws)
        s.record_group(t, rewards)
        for r in rewards:
            s.record(t, r)
    parts = SimpleNamespace(sampler=s, engine=SimpleNamespace(version=1), runner=None, sync_stats={})
    m = step_metrics(parts, None, None, {"loss": 0.1}, {}, _Clock())
    assert all(f"{d}/weight" in m and f"{d}/count" in m for d in names)
    assert sum(m[f"{d}/weight"] for d in names) == pytest.approx(1.0)
    flat = sorted(d for d in names if m.get(f"{d}/no_gradient_frac") == 1.0)
    assert flat and all(d.startswith("failed") for d in flat)
    assert max(m[f"{d}/weight"] for d in flat) < min(m[f"{d}/weight"] for d in names if d not in flat)
    monitor = Monitor(MonitorConfig(tensorboard=False, progress=False), tmp_path)
    monitor.set_domains(names)
    monitor.log("rl", 0, m)
    line = [x for x in capsys.readouterr().out.splitlines() if "domains rl step 0:" in x][0]
    assert f"no gradient ({len(flat)}): {', '.join(flat[:12])}" in line
    assert (f" (+{len(flat) - 12} more)" in line) == (len(flat) > 12)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["domains/no_gradient"] == flat and all(f"{d}/weight" in row for d in names)


# --- difficulty levels within a domain ---------------------------------------------------------------------------

def _levels(domain: str, n_levels: int = 3, n: int = 4) -> list[list[Task]]:
    return [[Task(f"L{lv}-{domain}-{i}", domain, f"level {lv} task {i}") for i in range(n)] for lv in range(n_levels)]


def _leveled(seed: int = 3, **cfg) -> DomainSampler:
    curriculum = DomainCurriculumConfig(level_up_at=0.75, level_groups=3, **cfg)
    return DomainSampler(_tasks(["climb", "flat"]), {"climb": 1.0, "flat": 1.0}, seed=seed, curriculum=curriculum,
                         levels={"climb": _levels("climb")})


def _level_run(sampler: DomainSampler, groups: int, reward) -> list[tuple[str, int]]:
    """(task id, the domain's level when drawn) per group; `reward(level)`: the group's reward (all samples)."""
    out = []
    for _ in range(groups):
        task = sampler.next()
        level = sampler.level.get(task.domain, -1)
        out.append((task.id, level))
        sampler.record_group(task, [reward(level)] * 3 if task.domain == "climb" else [0.0, 1.0, 0.0])
    return out


def test_a_domain_climbs_its_levels_when_it_solves_them_and_stays_when_it_does_not():
    solved = _leveled()
    drawn = _level_run(solved, 60, lambda level: 1.0)  # solves every level: climbs to the last, never past
    climb = [(i, lv) for i, lv in drawn if lv >= 0]
    assert [lv for _, lv in climb][:3] == [0, 0, 0] and solved.level == {"climb": 2}
    assert all(i.startswith(f"L{lv}-") for i, lv in climb)  # drawn from the level it was at
    assert {lv for _, lv in climb} == {0, 1, 2}
    assert solved.level_metrics() == {"climb/level": 2.0}
    stuck = _leveled()
    _level_run(stuck, 60, lambda level: 1.0 if level == 0 else 0.5)  # 0.5 < level_up_at: stays at level 1
    assert stuck.level == {"climb": 1}
    failing = _leveled()
    _level_run(failing, 60, lambda level: 0.0)
    assert failing.level == {"climb": 0} and all(t.startswith("L0-") for t, lv in _level_run(failing, 10,
                                                                                            lambda lv: 0.0) if lv == 0)


def test_levels_resume_exactly_from_the_sampler_state():
    def reward(level):
        return 1.0 if level < 2 else 0.0

    ref = _leveled(seed=5)
    _level_run(ref, 17, reward)
    state = json.loads(json.dumps(ref.state_dict()))  # the driver checkpoint stores it as JSON
    assert state["levels"]["climb"]["level"] == ref.level["climb"]
    resumed = _leveled(seed=5)
    resumed.load_state_dict(state)
    assert resumed.level == ref.level and _level_run(resumed, 40, reward) == _level_run(ref, 40, reward)
    fresh = _leveled(seed=5)
    _level_run(fresh, 17, reward)
    assert fresh.state_dict() == state  # an unbroken run reaches the same state


def test_level_settings_are_refused_when_bad():
    with pytest.raises(ConfigError, match=r"level_up_at=0.0"):
        DomainCurriculumConfig(level_up_at=0.0).validate()
    with pytest.raises(ConfigError, match=r"level_groups=0"):
        DomainCurriculumConfig(level_groups=0).validate()
    with pytest.raises(EnvError, match="difficulty level\\(s\\) without tasks: \\['climb level 1'\\]"):
        DomainSampler(_tasks(["climb"]), levels={"climb": [_levels("climb", 1)[0], []]})
