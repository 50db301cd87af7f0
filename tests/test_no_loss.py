"""Nothing a user has is lost (issue 29): a wrong --resume directory, a resume of a run that
cannot be resumed, another run's checkpoint, a refused foreign directory (twice), the run-dir
lock and orphaned loader workers, preemption that reaches the loader workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ironloop.cli import main
from ironloop.state import lock
from tests.conftest import REPO
from tests.test_preempt import (
    ARGS,
    ENV,
    TIMEOUT,
    ckpt_step,
    events,
    ironloop_lines,
    logged_steps,
    wait_for,
)

FAST = [*ARGS, "train.epochs=1", "train.max_steps=6", "checkpoint.every_steps=2"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a directory): byte-for-byte state."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ironloop: error: "), err
    return err[0]


def test_resume_from_a_directory_without_a_checkpoint_is_refused_and_the_run_stays_intact(
        tmp_path, capsys):
    run_dir, wrong = tmp_path / "r1", tmp_path / "empty_dir"
    assert main(["train", *FAST, f"run.dir={run_dir}"]) == 0
    wrong.mkdir()
    (wrong / "notes.txt").write_text("not a run\n")
    before, before_wrong = snapshot(run_dir), snapshot(wrong)
    assert any(k.startswith("checkpoints/step-") for k in before)
    capsys.readouterr()
    assert main(["train", *FAST, "train.max_steps=8", f"run.dir={run_dir}",
                 "--resume", str(wrong)]) == 2
    line = one_error_line(capsys)
    assert str(wrong) in line and "no checkpoint" in line
    assert snapshot(run_dir) == before and snapshot(wrong) == before_wrong


def test_a_bare_resume_of_a_finished_run_without_checkpoints_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert main(["train", *FAST, "checkpoint.enabled=false", f"run.dir={run_dir}"]) == 0
    before = snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", *FAST, "checkpoint.enabled=false", f"run.dir={run_dir}",
                 "--resume"]) == 2
    assert "checkpoint.enabled=false" in one_error_line(capsys)
    assert snapshot(run_dir) == before


def test_a_resume_from_another_runs_checkpoint_never_deletes_this_runs_newer_ones(
        tmp_path, capsys):
    mine, other = tmp_path / "mine", tmp_path / "other"
    keep = [*FAST, "checkpoint.keep_last=5"]
    assert main(["train", *keep, f"run.dir={mine}"]) == 0  # checkpoints up to step 6
    assert main(["train", *keep, f"run.dir={other}"]) == 0
    before = snapshot(mine)
    capsys.readouterr()
    step2 = other / "checkpoints" / "step-00000002.pt"
    assert main(["train", *keep, f"run.dir={mine}", "--resume", str(step2)]) == 2
    line = one_error_line(capsys)
    assert str(step2) in line and "step 6" in line
    assert snapshot(mine) == before


def test_a_rewind_to_an_older_checkpoint_of_the_same_run_drops_the_newer_ones(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert main(["train", *FAST, f"run.dir={run_dir}", "checkpoint.keep_last=5"]) == 0
    step2 = run_dir / "checkpoints" / "step-00000002.pt"
    assert main(["train", *FAST, f"run.dir={run_dir}", "checkpoint.keep_last=5",
                 "--resume", str(step2)]) == 0  # the user asked for this rewind
    out = capsys.readouterr().out
    assert "step-00000006.pt: it is past the step this run resumed from" in out
    assert [e["step"] for e in events(run_dir) if e["event"] == "resume"] == [2]


@pytest.mark.parametrize("resume", [False, True])
def test_a_refused_foreign_directory_is_unchanged_after_two_attempts(tmp_path, capsys, resume):
    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("lr: 0.1\n")
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    (run_dir / "doctor.json").write_text('{"mine": true}\n')
    before = snapshot(run_dir)
    flags = ["--resume"] if resume else []
    for attempt in (1, 2):  # the first refused attempt must not make the second one succeed
        # the preflight doctor on: it writes doctor.json, after the run.dir checks only
        assert main(["train", *FAST, "doctor.preflight=true", f"run.dir={run_dir}",
                     *flags]) == 2, attempt
        capsys.readouterr()
        assert snapshot(run_dir) == before, attempt


def test_a_refused_run_dir_that_did_not_exist_is_not_left_behind(tmp_path, capsys):
    run_dir = tmp_path / "new" / "run"
    assert main(["train", *FAST, f"run.dir={run_dir}", "--resume", str(tmp_path)]) == 2
    one_error_line(capsys)
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- the lock --
HOLDER = """
import sys, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader, Dataset
from ironloop.state import lock

class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        return torch.zeros(1)

run_dir, ready = Path(sys.argv[1]), Path(sys.argv[2])
with lock.hold(run_dir):
    # a plain DataLoader (the user's own, or any forked process): the fix must not need ours
    loader = DataLoader(Slow(), batch_size=1, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    ready.write_text(" ".join(str(w.pid) for w in it._workers))
    while True:
        time.sleep(1)
"""


def running(pid: int) -> bool:
    """Whether pid runs (a zombie has exited and holds no descriptor)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_orphaned_loader_workers_do_not_hold_the_lock_after_a_sigkill_5_of_5(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    for i in range(5):
        run_dir, ready = tmp_path / f"run{i}", tmp_path / f"ready{i}"
        log = tmp_path / f"holder{i}.log"
        proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(ready)],
                                cwd=REPO, env=ENV, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        wait_for(lambda ready=ready: ready.exists() and ready.read_text(), proc, log,
                 "the workers")
        workers = [int(p) for p in ready.read_text().split()]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        with lock.hold(run_dir):  # at once: the orphans (still running) must not hold it
            orphans = [w for w in workers if running(w)]
        assert orphans, "the workers had exited already: this attempt tested nothing"
        for w in orphans:
            os.kill(w, signal.SIGKILL)


def test_a_dead_pid_is_never_named_as_the_holder(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / lock.LOCK_NAME).write_text(json.dumps(
        {"pid": dead.pid, "host": os.uname().nodename, "started": "then"}))
    assert str(dead.pid) not in lock.holder(tmp_path)
    (tmp_path / lock.LOCK_NAME).write_text(json.dumps(
        {"pid": os.getpid(), "host": os.uname().nodename, "started": "now"}))
    assert f"pid {os.getpid()}" in lock.holder(tmp_path)


@pytest.mark.slow
def test_an_immediate_restart_after_kill_9_with_2_workers_is_accepted_5_of_5(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", *ARGS, "data.num_workers=2", "train.epochs=30",
            "checkpoint.every_steps=2", f"run.dir={run_dir}"]
    for i in range(5):
        log = tmp_path / f"run{i}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ironloop", *argv,
                                     *(["--resume", "--allow-config-change"] if i else [])],
                                    cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT)
        start = logged_steps(run_dir)[-1] if i else 0
        wait_for(lambda start=start: len(logged_steps(run_dir)) and
                 logged_steps(run_dir)[-1] >= start + 3, proc, log, "3 more steps")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        step = logged_steps(run_dir)[-1]
        capsys.readouterr()
        assert main(["train", *ARGS, "data.num_workers=2", "train.epochs=30",
                     "checkpoint.every_steps=2", f"train.max_steps={step + 1}",
                     f"run.dir={run_dir}", "--resume", "--allow-config-change"]) == 0, \
            (i, capsys.readouterr().err)
        assert "in use" not in capsys.readouterr().err


# --------------------------------------------------------------------- preemption --
RC = """
import os, sys
from pathlib import Path
from ironloop.cli import main

rc = main(sys.argv[2:])
Path(sys.argv[1], "rc." + os.environ.get("RANK", "0")).write_text(str(rc))
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
"""


def _preempt_once(tmp_path: Path, i: int, torchrun: bool) -> tuple[Path, list[int]]:
    """A run with 2 loader workers per process, SIGTERM to its whole process group (torchrun's
    too) after step 5; returns run.dir and the exit codes of the training processes."""
    run_dir, log, rcs = tmp_path / f"run{i}", tmp_path / f"run{i}.log", tmp_path / f"rc{i}"
    rcs.mkdir()
    script = tmp_path / "rc.py"
    script.write_text(textwrap.dedent(RC))
    argv = ["train", *ARGS, "data.num_workers=2", "train.epochs=20", "train.batch_size=32",
            f"run.dir={run_dir}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--standalone"] if torchrun else [sys.executable]
    with log.open("w") as out:
        proc = subprocess.Popen([*launcher, str(script), str(rcs), *argv], cwd=REPO, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: len(logged_steps(run_dir)) >= 5, proc, log, "step 5")
    os.killpg(proc.pid, signal.SIGTERM)  # every process: launcher, ranks, loader workers
    proc.wait(timeout=TIMEOUT)
    text = log.read_text()
    codes = [int(p.read_text()) for p in sorted(rcs.iterdir())]
    assert "DataLoader worker" not in text and "ConnectionResetError" not in text, text[-4000:]
    # torchrun prints its own SignalException traceback; one process prints none
    assert torchrun or "Traceback" not in text, text[-4000:]
    assert not [line for line in ironloop_lines(text) if "error" in line.lower()], text[-4000:]
    return run_dir, codes


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", [False, True], ids=["process_group", "torchrun"])
def test_sigterm_to_the_process_group_with_2_workers_exits_75_redoing_no_step_5_of_5(
        tmp_path, torchrun):
    for i in range(5):
        run_dir, codes = _preempt_once(tmp_path, i, torchrun)
        assert codes == [75] * (2 if torchrun else 1), (i, codes)
        stop = events(run_dir)[-1]
        assert stop["event"] == "preempted" and stop["saved"], (i, stop)
        # the checkpoint is the last step logged: a resume redoes none
        assert ckpt_step(run_dir / "checkpoints" / "last.pt") == stop["step"]
        assert logged_steps(run_dir)[-1] == stop["step"], i
