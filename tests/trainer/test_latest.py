"""The run's one "latest checkpoint" pointer (trainer/latest.py): both phases write it, every reader reads it,
and a run folder with the warm-up's old pointer (checkpoints/warmup/latest) still resumes."""
from megatron_rl.commands.train import _latest_checkpoint, _resume_or_start
from megatron_rl.commands.warmup import warmup_latest
from megatron_rl.config import load
from megatron_rl.loop.state import latest as rl_latest
from megatron_rl.run_config import RunConfig
from megatron_rl.trainer.latest import latest, write_latest


def _ckpt(run, rel):
    (run / "checkpoints" / rel).mkdir(parents=True)
    return run / "checkpoints" / rel


def test_one_pointer_names_the_warmup_then_the_rl_checkpoint(tmp_path):
    assert latest(tmp_path) is None and warmup_latest(tmp_path) is None and rl_latest(tmp_path) is None
    warm = _ckpt(tmp_path, "warmup/step-000030")
    write_latest(tmp_path, warm)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "warmup/step-000030\n"
    assert latest(tmp_path) == warm and warmup_latest(tmp_path) == warm and rl_latest(tmp_path) is None
    rl = _ckpt(tmp_path, "step-000002")
    write_latest(tmp_path, rl)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-000002\n"
    assert latest(tmp_path) == rl == rl_latest(tmp_path) and warmup_latest(tmp_path) is None
    assert not (tmp_path / "checkpoints" / "warmup" / "latest").exists()  # the warm-up wrote no pointer of its own


def test_an_old_run_folder_with_the_warmup_pointer_still_resumes(tmp_path, capsys):
    cfg = load(RunConfig, "configs/demo_cpu.yaml", [f"output_dir={tmp_path}", "train.steps=0"])
    run = tmp_path / "demo"
    old = _ckpt(run, "warmup/step-000010")
    (run / "checkpoints" / "warmup" / "latest").write_text("step-000010\n")  # the pre-shared-pointer layout
    assert warmup_latest(run) == old and rl_latest(run) is None and _latest_checkpoint(run) == old
    assert _resume_or_start(cfg, run) == old
    assert "resuming the warm-up from" in capsys.readouterr().out
    new = _ckpt(run, "warmup/step-000020")
    write_latest(run, new)  # the resumed warm-up's next save: the shared pointer only
    assert warmup_latest(run) == new and not (run / "checkpoints" / "warmup" / "latest").exists()
