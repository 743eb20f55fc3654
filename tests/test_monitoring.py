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


def test_prometheus_endpoint_serves_latest_metrics_and_alerts(tmp_path):
    import urllib.error
    import urllib.request

    cfg = MonitorConfig(tensorboard=False, prometheus_port=0, progress=False)
    m = Monitor(cfg, tmp_path)
    try:
        port = int((tmp_path / "prometheus_port").read_text())
        m.log("rl", 0, {"reward_mean": 0.25, "countdown/count": 16, "note": "text is not a metric"})
        m.log("rl", 1, {"reward_mean": 0.5, "countdown/count": 16})
        m.check(1, {"loss": float("nan")})
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "megatron_rl_rl_reward_mean 0.5\n" in text and "megatron_rl_rl_step 1.0\n" in text
        assert "megatron_rl_rl_countdown_count 16.0\n" in text and "note" not in text
        assert '# TYPE megatron_rl_alerts_total counter\nmegatron_rl_alerts_total{rule="nan"} 1.0\n' in text
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
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
