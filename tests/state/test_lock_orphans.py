"""The run-dir lock and orphaned loader workers (issue 29): forked children never hold
run.dir, so a restart right after ``kill -9`` is accepted; a dead pid is never named as the
holder. Real processes, real SIGKILLs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ironloop.cli import main
from ironloop.state import lock
from tests.conftest import REPO
from tests.engine.test_preempt import ARGS, ENV, TIMEOUT, logged_steps, wait_for

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


