"""What a person watching a run sees (outputs/console.py, issue 22): piped progress lines,
every evaluation, dated val_* in epoch lines, the right epoch count under max_steps, the resume
line, the fp16-on-CPU warning, and a CLI that answers --version and --help without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ironloop.config import LogConfig
from ironloop.outputs import console
from tests.conftest import REPO, run_cli


def plan(epochs=10, total_steps=160, steps_per_epoch=23):
    return console.RunPlan(total_steps, steps_per_epoch, epochs, window=64)


AT = SimpleNamespace(step=46, epoch=2, offset=64 * 5)  # 5 steps into epoch 3


ROW = {"epoch": 2, "step": 46, "train_loss": 0.5, "val_loss": 0.25, "val_acc": 0.9, "lr": 1e-3,
       "seconds": 1.0, "samples_per_s": 100.0}


def test_the_epoch_count_is_where_max_steps_ends_the_run():
    assert plan(epochs=10, total_steps=160).planned_epochs == 7  # ceil(160/23)
    assert plan(epochs=3, total_steps=69).planned_epochs == 3
    assert console.epoch_line(ROW, plan(), {}).startswith("epoch 2/7  step 46")


def test_epoch_lines_date_val_figures_from_an_earlier_evaluation():
    fresh = console.epoch_line(ROW, plan(), {"step": 46})
    assert "val_loss 0.2500  " in fresh and "(step" not in fresh
    stale = console.epoch_line(ROW, plan(), {"step": 40})
    assert "val_loss 0.2500 (step 40)" in stale and "val_acc 90.00% (step 40)" in stale


def test_resume_line_names_checkpoint_step_redone_steps_and_changes():
    event = {"from": "run/checkpoints/step-00000046.pt", "step": 46, "last_logged_step": 50,
             "steps_redone": 4}
    line = console.resume_line(event, AT, plan(), [("train.max_steps", 100, 160)])
    assert line.startswith("resumed from run/checkpoints/step-00000046.pt at step 46/160")
    assert "(epoch 3, 5/23 steps into it)" in line and "redoing steps 47-50" in line
    assert line.endswith("config changed: train.max_steps 100 -> 160")
    quiet = console.resume_line({**event, "steps_redone": 0}, AT, plan(), [])
    assert "logged no step past it" in quiet and quiet.endswith("config unchanged")


def test_resuming_a_finished_run_says_its_last_epoch_finished_not_one_past_it(tmp_path,
                                                                             capsys):
    import ironloop
    from tests.conftest import blobs, cfg, tiny_mlp

    conf = cfg(tmp_path, train__epochs=2)  # 200 samples in batches of 32: 7 steps an epoch
    ironloop.fit(tiny_mlp(), blobs(), config=conf)
    capsys.readouterr()
    ironloop.fit(tiny_mlp(), blobs(), config=conf, resume=True)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resumed")]
    assert "at step 14/14 (epoch 2 finished, the run's last)" in line, line  # not epoch 3
    assert "Nothing to train: the run is already complete at step 14 of 14" in line


def test_a_resume_at_an_epochs_end_names_the_finished_epoch_and_the_next():
    at = SimpleNamespace(step=46, epoch=2, offset=0)
    line = console.resume_line({"from": "last.pt", "step": 46}, at, plan(), [])
    assert "at step 46/160 (epoch 2 finished; epoch 3 next)" in line


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_do_not_import_torch(flag):
    code = ("import sys; from ironloop import cli\n"
            f"try:\n    cli.main([{flag!r}])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("no torch") and "ironloop" in res.stdout


@pytest.mark.slow
def test_a_piped_max_steps_run_shows_progress_every_evaluation_and_its_resume(tmp_path):
    """Overrides only, no config file; stdout is a pipe: plain lines, no bar."""
    run_dir = tmp_path / "lm"
    args = ["train", "data.name=digits", "model.name=mlp", f"run.dir={run_dir}",
            "train.max_steps=12", "eval.every_steps=4", "eval.max_batches=2",
            "log.progress_every_steps=3", "log.progress_every_s=0", "checkpoint.every_steps=4",
            "log.every_steps=1"]
    first = run_cli(*args, "fault.crash_at_step=6")
    assert first.returncode == 1, first.stderr
    out = first.stdout.splitlines()
    assert out[0].startswith(f"ironloop train: mlp on digits from the defaults, run.dir {run_dir}")
    assert out[1].startswith("preflight: ") and re.match(r"doctor: .*\(\d+\.\d+ s; ", out[2])
    # The progress line follows its step's log line (it shows that step's own loss and LR), and
    # fault.crash_at_step=6 dies right after step 6 is counted, before that line: 3 only.
    assert [x.split()[1] for x in out if x.startswith("step ")] == ["3/12"]
    assert "epoch 1/1" in first.stdout  # 23 steps an epoch: max_steps ends the run in epoch 1
    second = run_cli(*args, "--resume", "doctor.preflight=false")
    assert second.returncode == 0, second.stderr
    line = next(x for x in second.stdout.splitlines() if x.startswith("resumed from"))
    # fault.crash_at_step exits right after step 6, before its metrics line: 5 was logged
    assert "at step 4/12" in line and "redoing step 5, which" in line
    assert "config changed: fault.crash_at_step 6 -> 0" in line  # the resume's own override
    steps = [x.split()[1] for x in second.stdout.splitlines() if x.startswith("step ")]
    assert steps == ["7/12", "10/12"]  # every 3 steps from the resumed step
    evals = [x for x in first.stdout.splitlines() + second.stdout.splitlines()
             if x.startswith("eval at step")]
    assert [e.split()[3] for e in evals] == ["4/12", "8/12", "12/12"]
    logged = [json.loads(x)["step"] for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert logged == [4, 8, 12]
    assert "\r" not in first.stdout + second.stdout + first.stderr + second.stderr


# -- the averaged weights, in words (issue 44) --------------------------------------------------

def test_eval_and_epoch_lines_say_whether_the_average_beats_the_raw_weights():
    row = {"step": 46, "epoch": 2, "val_loss": 0.1636, "val_avg_loss": 0.1081, "seconds": 0.1}
    assert console.eval_line(row, 160).endswith("; averaged weights better than raw")
    worse = {**row, "val_avg_loss": 2.212}
    assert console.eval_line(worse, 160).endswith("; averaged weights worse than raw")
    same = {**row, "val_avg_loss": 0.16361}  # equal to the 4 figures shown
    assert console.eval_line(same, 160).endswith("; averaged weights as good as raw")
    epoch = {**ROW, "val_avg_loss": 0.2, "val_avg_acc": 0.95}  # ROW's val_loss is 0.25
    assert console.epoch_line(epoch, plan(), {}).endswith("; averaged weights better than raw")


def test_a_loss_and_an_accuracy_that_disagree_are_named_apart():
    """Early in a run the average's loss is often higher while its accuracy is already
    better (digits, epoch 1: 1.672 against 1.514, 78.27% against 60.17%)."""
    row = {"step": 23, "epoch": 1, "val_loss": 1.514, "val_acc": 0.6017, "val_f1": 0.5,
           "val_avg_loss": 1.672, "val_avg_acc": 0.7827, "val_avg_f1": 0.7, "seconds": 0.1}
    assert console.eval_line(row, 46).endswith(
        "; averaged weights worse on val_loss, better on val_acc")


def test_named_sets_are_judged_on_the_first_sets_loss():
    row = {"step": 4, "epoch": 1, "val_clean_loss": 0.5, "val_noisy_loss": 0.9,
           "val_avg_clean_loss": 0.6, "val_avg_noisy_loss": 0.7, "seconds": 0.1}
    assert console.eval_line(row, 10).endswith("; averaged weights worse than raw")


def test_lines_without_an_average_say_nothing_of_one():
    row = {"step": 46, "epoch": 2, "val_loss": 0.25, "val_acc": 0.9, "seconds": 0.1}
    assert "averaged" not in console.eval_line(row, 160)
    assert "averaged" not in console.epoch_line(ROW, plan(), {})
    nan = {**row, "val_avg_loss": float("nan")}  # no verdict on a non-finite loss
    assert "averaged weights" not in console.eval_line(nan, 160)


def test_epoch_lines_show_tokens_per_s_fp16_skips_and_the_guards_totals_when_nonzero():
    row = {**ROW, "tokens_per_s": 51200.0, "skipped": 2, "bad_steps": 3, "rollbacks": 1,
           "skipped_samples": 64}
    line = console.epoch_line(row, plan(), {})
    for part in ("51200 tokens/s", "fp16-skipped 2", "bad steps 3", "rollbacks 1",
                 "skipped samples 64"):
        assert f"  {part}" in line, (part, line)
    quiet = console.epoch_line({**row, "tokens_per_s": 0, "skipped": 0, "bad_steps": 0,
                                "rollbacks": 0, "skipped_samples": 0}, plan(), {})
    assert not any(w in quiet for w in ("tokens/s", "fp16-skipped", "bad steps", "rollbacks"))


def test_a_piped_progress_line_is_due_once_progress_every_s_has_passed(monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)  # a log file, not a terminal
    where = SimpleNamespace(step=0, epoch=0, offset=0)
    bar = console.EpochProgress(LogConfig(progress="auto", progress_every_steps=0,
                                          progress_every_s=5.0), where, plan(), True)
    where.step, now[0] = 1, 104.5
    bar.update()
    assert "step 1/160" not in capsys.readouterr().out  # 4.5 s: not yet
    where.step, now[0] = 2, 105.0
    bar.update()
    assert "step 2/160" in capsys.readouterr().out  # exactly 5 s after the bar started
    bar.close()


def test_the_progress_line_rates_the_steps_since_the_last_line_and_gives_the_eta():
    at = SimpleNamespace(step=40, epoch=1, offset=0)  # a resumed run: 40 steps done before
    prog = console.EpochProgress(LogConfig(progress="off"), at,
                                 console.RunPlan(100, 50, 2, window=1), main=False)
    prog.set_postfix(loss=0.5)
    line = console.progress_line(prog, step=60, now=prog.last_time + 10.0)
    prog.close()
    # 20 steps in 10 s: 2 steps/s, and the 40 left take 20 s
    assert line == "step 60/100  epoch 2/2  loss 0.5000  2.000 steps/s  eta 0:00:20"
    assert console._clock(3725.9) == "1:02:05"
    assert [console._clock(s) for s in (3599, 3600, 86400)] == ["0:59:59", "1:00:00", "24:00:00"]


def test_the_test_line_shows_every_number_but_the_time_accuracies_in_percent():
    test = {"loss": 1.23456, "acc": 0.875, "ppl": 3.4351, "seconds": 2.5, "note": "x"}
    assert console.test_line(test, "best") == ("test (best weights): test_loss 1.235  "
                                               "test_acc 87.50%  test_ppl 3.435")


@pytest.mark.parametrize("mode, terminal, main, shown", [
    ("auto", True, True, True), ("auto", False, True, False), ("on", False, True, True),
    ("off", True, True, False), ("auto", True, False, False)])
def test_the_bar_shows_on_a_terminal_or_when_forced_and_counts_this_epochs_steps(
        monkeypatch, mode, terminal, main, shown):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    at = SimpleNamespace(step=46, epoch=2, offset=64 * 5)  # 5 steps into epoch 3 of 23
    prog = console.EpochProgress(LogConfig(progress=mode), at, plan(), main)
    try:
        assert prog.bar.disable is (not shown)
        if shown:
            assert (prog.bar.total, prog.bar.n, prog.bar.unit) == (23, 5, "step")
    finally:
        prog.close()


@pytest.mark.parametrize("total_steps, steps", [(50, 5 + 4), (46, 5)])
def test_a_bar_whose_epoch_max_steps_cuts_short_counts_only_the_steps_left(
        monkeypatch, total_steps, steps):
    """4 steps to max_steps' 50; at 46 a run resumed where max_steps ended it has no step
    left, and its bar is full, not one step short."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    at = SimpleNamespace(step=46, epoch=2, offset=64 * 5)  # 5 steps into epoch 3
    prog = console.EpochProgress(LogConfig(progress="on"), at, plan(total_steps=total_steps),
                                 True)
    try:
        assert (prog.bar.total, prog.bar.n) == (steps, 5)
    finally:
        prog.close()


def test_the_bar_shows_the_latest_figures_of_every_key_logged_this_epoch():
    at = SimpleNamespace(step=46, epoch=2, offset=64 * 5)
    prog = console.EpochProgress(LogConfig(progress="on"), at, plan(), True)
    try:
        prog.set_postfix(loss=0.5, lr=0.001)
        assert prog.bar.postfix == "loss=0.5000, lr=0.001000"
        prog.set_postfix(loss=0.25)  # lr kept from the earlier log step
        assert prog.bar.postfix == "loss=0.2500, lr=0.001000"
    finally:
        prog.close()


def test_a_resume_line_lists_every_changed_key():
    line = console.resume_line({"from": "last.pt", "step": 46}, AT, plan(),
                               [("train.max_steps", 100, 160), ("optim.lr", 0.1, 0.2)])
    assert line.endswith("; config changed: train.max_steps 100 -> 160, optim.lr 0.1 -> 0.2")


def test_a_progress_line_with_no_step_since_the_last_gives_no_eta():
    at = SimpleNamespace(step=40, epoch=1, offset=0)
    prog = console.EpochProgress(LogConfig(progress="off"), at,
                                 console.RunPlan(100, 50, 2, window=1), main=False)
    line = console.progress_line(prog, step=40, now=prog.last_time + 10.0)
    prog.close()
    assert line == "step 40/100  epoch 2/2  0 steps/s"  # number(0.0) is "0"


def test_a_resume_line_says_in_full_what_one_redone_step_or_none_means():
    event = {"from": "last.pt", "step": 46, "last_logged_step": 47, "steps_redone": 1}
    assert console.resume_line(event, AT, plan(), []) == (
        "resumed from last.pt at step 46/160 (epoch 3, 5/23 steps into it); redoing step 47, "
        "which the previous process had logged after this checkpoint; config unchanged")
    quiet = {"from": "last.pt", "step": 46, "last_logged_step": 46, "steps_redone": 0}
    assert console.resume_line(quiet, AT, plan(), []) == (
        "resumed from last.pt at step 46/160 (epoch 3, 5/23 steps into it); the previous "
        "process logged no step past it; config unchanged")


def test_a_piped_progress_line_is_due_once_progress_every_steps_have_passed(monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    where = SimpleNamespace(step=0, epoch=0, offset=0)
    bar = console.EpochProgress(LogConfig(progress="auto", progress_every_steps=3,
                                          progress_every_s=0), where, plan(), True)
    where.step = 2
    bar.update()
    assert capsys.readouterr().out == ""  # 2 steps: not yet
    where.step = 3
    bar.update()
    assert capsys.readouterr().out.startswith("step 3/160  epoch 1/7  ")  # exactly 3 steps
    bar.close()


def test_an_epoch_line_gives_the_share_of_clipped_steps_in_percent():
    line = console.epoch_line({**ROW, "clipped_frac": 0.25}, plan(), {})
    assert line.endswith("  100.0 samples/s  clipped 25%")
    assert "clipped" not in console.epoch_line({**ROW, "clipped_frac": 0.0}, plan(), {})


def test_progress_off_prints_no_progress_line_even_to_a_log_file(monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    where = SimpleNamespace(step=0, epoch=0, offset=0)
    bar = console.EpochProgress(LogConfig(progress="off", progress_every_steps=1), where,
                                plan(), True)
    where.step = 5
    bar.update()
    bar.close()
    assert not bar.plain and bar.bar.disable and capsys.readouterr().out == ""
