"""Warm-up rows go through the run's `Monitor` (issue 26: one Monitor for both phases), so they reach
metrics.jsonl in the same form as before and TensorBoard too (the private logger never wrote TensorBoard)."""
import json

from megatron_rl.commands.warmup import _Rows
from megatron_rl.monitoring import Monitor, MonitorConfig


def test_warmup_rows_reach_metrics_jsonl_and_tensorboard(tmp_path, capsys):
    monitor = Monitor(MonitorConfig(tensorboard=True, progress=False), tmp_path, active=True)
    rows = _Rows(monitor, print_every=2)
    rows.write("sft", 0, {"loss": 1.5, "tokens": 8.0, "grad_norm": 0.25, "lr": 1e-3})
    rows.write("sft", 1, {"loss": 1.25, "tokens": 8.0, "grad_norm": None, "lr": 1e-3})
    rows.note("resumed", kind="resume", step=1, phase="warmup", checkpoint="x")
    monitor.close()
    monitor.close()  # idempotent: the RL phase and the rank's entry point both close the shared Monitor
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in got] == [("sft", 0), ("sft", 1), ("resume", 1)]
    assert got[0]["loss"] == 1.5 and got[1]["grad_norm"] is None and "time_s" in got[0]
    assert got[2]["phase"] == "warmup" and got[2]["checkpoint"] == "x"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "warm-up rows must reach TensorBoard"
    out = capsys.readouterr().out
    assert "sft   step    0 loss 1.5000 grad_norm 0.250" in out and "step    1" not in out and "resumed" in out


def test_other_ranks_write_and_print_nothing(tmp_path, capsys):
    rows = _Rows(Monitor(MonitorConfig(), tmp_path, active=False))
    rows.write("sft_eval", 0, {"loss": 1.0, "tokens": 4.0})
    rows.note("hello", kind="resume", step=0)
    assert not (tmp_path / "metrics.jsonl").exists() and capsys.readouterr().out == ""
