"""Monitor sinks and alert rules; the report's plots."""
from __future__ import annotations

import json

import pytest

from megatron_rl.commands.report import main as report_main
from megatron_rl.monitoring import AlertConfig, Monitor, MonitorConfig


def _monitor(tmp_path, **alerts):
    return Monitor(MonitorConfig(tensorboard=False, alerts=AlertConfig(**alerts)), tmp_path)


def test_log_writes_jsonl_rows(tmp_path):
    m = _monitor(tmp_path)
    m.log("rl", 3, {"reward_mean": 0.5, "loss": 1.0})
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["kind"] == "rl" and row["step"] == 3 and row["reward_mean"] == 0.5


def test_nan_alert_stops_the_run(tmp_path, capsys):
    m = _monitor(tmp_path)
    assert m.check(0, {"loss": 1.0, "reward_mean": 0.1}) == [] and m.should_stop is None
    fired = m.check(1, {"loss": float("nan"), "reward_mean": 0.1})
    assert len(fired) == 1 and "non-finite" in fired[0] and m.should_stop.startswith("nan")
    assert "ALERT step 1: nan" in capsys.readouterr().err
    assert json.loads((tmp_path / "alerts.jsonl").read_text())["stop"] is True


def test_sandbox_errors_stall_and_mismatch_alert_without_stopping(tmp_path):
    m = _monitor(tmp_path, sandbox_error_rate=0.1, stall_s=10, mismatch_kl=0.01)
    fired = m.check(0, {"sandbox_error_rate": 0.5, "episodes_stalled_s": 11.0, "mismatch_kl": 0.2})
    assert len(fired) == 3 and m.should_stop is None
    assert m.check(1, {"sandbox_error_rate": 0.05, "episodes_stalled_s": 0.0, "mismatch_kl": 0.001}) == []


def test_reward_collapse(tmp_path):
    m = _monitor(tmp_path, reward_collapse_frac=0.5, reward_collapse_min_best=0.2, stop_on=["reward_collapse"])
    for step in range(5):
        assert m.check(step, {"reward_mean": 0.6}) == []
    assert m.check(5, {"reward_mean": 0.4}) == []
    assert "reward 0.100" in m.check(6, {"reward_mean": 0.1})[0] and m.should_stop


def test_inactive_monitor_writes_nothing(tmp_path):
    m = Monitor(MonitorConfig(), tmp_path, active=False)
    m.log("rl", 0, {"loss": 1.0})
    assert m.check(0, {"loss": float("nan")}) == [] and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_report_draws_pngs(tmp_path):
    m = _monitor(tmp_path)
    for s in range(4):
        m.log("rl", s, {"reward_mean": 0.1 * s, "response_len_mean": 10 + s, "time_train_s": 1.0,
                        "time_generate_s": 2.0, "trainer_idle_frac": 0.5})
    m.log("eval", 4, {"success_greedy": 0.3, "pass@4": 0.5})
    assert report_main([str(tmp_path)]) == 0
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["lengths.png", "rewards.png", "time.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000 for p in pngs)
    assert report_main([str(tmp_path / "missing")]) == 2


def test_report_of_a_warmup_only_run_draws_no_empty_figure(tmp_path):
    """A warm-up-only run (rl.steps=0) has no RL or eval rows: no figure of empty panels (matplotlib's import and
    three drawings were ~2.5 CPU-s of every such launch)."""
    from megatron_rl.commands.report import make_report

    m = _monitor(tmp_path)
    for s in range(3):
        m.log("sft", s, {"loss": 2.0 - s})
    assert make_report(tmp_path) == [] and list((tmp_path / "plots").iterdir()) == []


def test_prometheus_endpoint_serves_latest_metrics_and_alerts(tmp_path):
    import urllib.error
    import urllib.request

    cfg = MonitorConfig(tensorboard=False, prometheus_port=0, progress=False)
    m = Monitor(cfg, tmp_path)
    try:
        port = int((tmp_path / "prometheus_port").read_text())
        token_file = tmp_path / "prometheus_token"
        assert token_file.stat().st_mode & 0o777 == 0o600  # a scraper's credentials_file
        auth = {"Authorization": f"Bearer {token_file.read_text()}"}
        m.log("rl", 0, {"reward_mean": 0.25, "countdown/count": 16, "note": "text is not a metric"})
        m.log("rl", 1, {"reward_mean": 0.5, "countdown/count": 16})
        m.check(1, {"loss": float("nan")})
        m.check(2, {"loss": float("inf")})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=auth)
        text = urllib.request.urlopen(req, timeout=10).read().decode()
        assert "megatron_rl_rl_reward_mean 0.5\n" in text and "megatron_rl_rl_step 1.0\n" in text
        assert "megatron_rl_rl_countdown_count 16.0\n" in text and "note" not in text
        assert '# TYPE megatron_rl_alerts_total counter\nmegatron_rl_alerts_total{rule="nan"} 2.0\n' in text
        assert text.count("# TYPE megatron_rl_rl_reward_mean gauge\n") == 1
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/other", headers=auth), timeout=10)
        with pytest.raises(urllib.error.HTTPError, match="401"):  # no token
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    finally:
        m.close()


def test_progress_bar_in_a_log_prints_every_tenth(tmp_path):
    import io

    from megatron_rl.monitoring import Progress

    out = io.StringIO()
    bar = Progress("rl", 20, stream=out)
    for step in range(20):
        bar.update(step + 1, {"reward_mean": 0.5})
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("[rl] 20/20 [" + "=" * 24 + "] 100%")
    assert "reward_mean 0.5" in lines[0] and lines[0].startswith("[rl] 2/20 ")
    resumed = io.StringIO()
    bar = Progress("rl", 20, stream=resumed)
    bar.update(15)  # a resumed run: the first step seen is 15 of 20 (no decile crossed yet)
    bar.update(16)
    (line,) = resumed.getvalue().splitlines()
    assert line.startswith("[rl] 16/20 [" + "=" * 19 + " " * 5 + "]  80%")


class _FakeTB:
    def __init__(self):
        self.tags: list[str] = []

    def add_scalar(self, tag, value, step):
        self.tags.append(tag)

    def flush(self):
        pass


def _domain_row(names: list[str], reward: dict[str, float], flat: set[str]) -> dict:
    row = {"reward_mean": 0.5, "loss": 1.0}
    for d in names:
        row.update({f"{d}/reward_mean": reward[d], f"{d}/count": 4.0, f"{d}/weight": 1 / len(names),
                    f"{d}/no_gradient_frac": 1.0 if d in flat else 0.5})
    return row


def test_many_domains_summary_on_console_and_tb_full_rows_in_jsonl(tmp_path, capsys):
    names = [f"reasoning_gym/g{i:03d}" for i in range(120)]  # names with '/' (the pattern domains')
    m = Monitor(MonitorConfig(tensorboard=False, progress=False, domain_movers=2), tmp_path)
    m.tb = tb = _FakeTB()
    m.set_domains(names)
    m.log("rl", 0, _domain_row(names, {d: 0.5 for d in names}, set()))
    reward = {d: 0.5 for d in names}
    reward.update({names[3]: 0.9, names[7]: 0.8, names[5]: 0.1})
    flat = {names[10], names[42], names[99]}
    m.log("rl", 1, _domain_row(names, reward, flat))
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("[megatron-rl] domains rl step 1:")][0]
    assert "no gradient (3): reasoning_gym/g010, reasoning_gym/g042, reasoning_gym/g099" in line
    assert "up: reasoning_gym/g003 +0.400, reasoning_gym/g007 +0.300; down: reasoning_gym/g005 -0.400" in line
    assert "no gradient (0): -" in [x for x in out if "domains rl step 0:" in x][0]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(f"{d}/reward_mean" in rows[1] and f"{d}/weight" in rows[1] for d in names)  # in full
    assert rows[1]["domains/no_gradient"] == sorted(flat) and rows[1]["domains/no_gradient_count"] == 3
    assert not any("/g0" in t for t in tb.tags)  # TensorBoard: the summary, not 120 x 4 curves
    assert {"rl/domains/reward_mean_mean", "rl/domains/no_gradient_count", "rl/reward_mean",
            "rl/domains/weight_max"} <= set(tb.tags)
    assert line.endswith(f"; weights {1 / 120:.3f}..{1 / 120:.3f} (max: reasoning_gym/g119)")


def test_few_domains_keep_their_scalars(tmp_path):
    m = Monitor(MonitorConfig(tensorboard=False, progress=False, domain_summary=False), tmp_path)
    m.tb = tb = _FakeTB()
    m.set_domains(["a", "b"])
    m.log("rl", 0, _domain_row(["a", "b"], {"a": 0.1, "b": 0.2}, {"a"}))
    assert {"rl/a/reward_mean", "rl/b/weight", "rl/domains/no_gradient_count"} <= set(tb.tags)


def test_report_writes_the_per_domain_table_and_heat_map(tmp_path, capsys):
    names = [f"d{i:03d}" for i in range(110)]
    m = Monitor(MonitorConfig(tensorboard=False, progress=False), tmp_path)
    m.set_domains(names)
    for step, lift in ((0, 0.0), (2, 0.1), (4, 0.3)):
        row = {"success_greedy": 0.2, "pass@1": 0.2, "pass@4": 0.4, "tasks": 3 * len(names)}
        for i, d in enumerate(names):  # d000 improves most, d109 gets worse, the rest in between
            row.update({f"{d}/pass@1": min(1.0, max(0.0, 0.2 + lift * (1 - i / 50))), f"{d}/tasks": 3,
                        f"{d}/success_greedy": 0.2, f"{d}/pass@4": 0.4})
        m.log("eval", step, row)
    for step in range(4):
        m.log("rl", step, {"reward_mean": 0.1, **{f"{d}/groups": 2.0 for d in names},
                           **{f"{d}/no_gradient_frac": 1.0 if d in ("d005", "d077") else 0.5 for d in names}})
    assert report_main([str(tmp_path)]) == 0
    md = (tmp_path / "domains.md").read_text()
    table = json.loads((tmp_path / "domains.json").read_text())
    assert len(table["domains"]) == 110 and table["no_gradient"] == ["d005", "d077"]
    assert table["improved"] == 50 and table["worse"] == 59 and table["unchanged"] == 1 and table["steps"] == [0, 4]
    lines = md.splitlines()
    assert lines[0].startswith("Held-out success per domain, step 0 -> 4:") and "50 improved" in lines[0]
    assert lines[4].startswith("| d000 | 3 | 0.200 | 0.500 | +0.300 |") and "| d109 |" in lines[-1]
    assert "| d005 |" in md and [x for x in lines if x.startswith("| d077 |")][0].endswith("| yes |")
    png = tmp_path / "plots" / "domains_heldout.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20000
    assert str(png) in capsys.readouterr().out
