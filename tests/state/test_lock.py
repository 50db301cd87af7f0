"""One owner per run.dir (state/lock.py): while a run holds its run.dir, a second ``ironloop
train`` on it, with --resume, --overwrite or neither, exits 2 naming the holder and touches
nothing; a SIGKILLed holder leaves no stale lock, and a forked worker that inherited the lock's
descriptor does not keep it once the holder lets go. The holders are small processes started
here that hold the lock until the test writes to their pipe: no training run, no race."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys

import pytest

from ironloop.cli import main
from ironloop.errors import UserError
from ironloop.state import lock
from tests.conftest import REPO
from tests.engine.test_preempt import ARGS, TIMEOUT


def test_the_lock_is_reentrant_in_one_process_and_released_after(tmp_path):
    with lock.hold(tmp_path):
        with lock.hold(tmp_path):  # ironloop train takes it before the preflight, fit again
            pass
        record = json.loads((tmp_path / lock.LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with lock.hold(tmp_path, enabled=False):  # ranks other than 0 hold nothing
        pass
    with lock.hold(tmp_path):  # released: taken again
        pass


def test_the_lock_file_names_its_holder_and_its_start_and_is_readable_by_all(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    with lock.hold(tmp_path / "run"):
        lock.claim(tmp_path / "run")  # the run went on: its lock file stays
        path = tmp_path / "run" / lock.LOCK_NAME
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~umask
        record = json.loads(path.read_text())
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+", record["started"])
        assert lock.holder(tmp_path / "run") == (f"pid {os.getpid()} on {socket.gethostname()}, "
                                                 f"started {record['started']}")
        other = os.open(path, os.O_RDWR)  # another open file: flock refuses it while held
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    other = os.open(path, os.O_RDWR)  # let go: free for the next run
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)


HOLDER = """
import os, sys
from pathlib import Path
from ironloop.state import lock
with lock.hold(Path(sys.argv[1])):
    if sys.argv[2] == "fork":
        # A DataLoader worker forked while the lock is held: it shares the lock's open file
        # description and outlives the holder's block. It lives until the holder exits (its
        # pipe's write end closes then); it never reads stdin, which is the holder's.
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
    print("held", flush=True)
    sys.stdin.buffer.read(1)  # until the test writes a byte (or closes the pipe)
print("released", flush=True)
sys.stdin.buffer.read()  # the fork case: live on (the worker too) until the pipe closes
"""


@pytest.fixture
def holders(tmp_path):
    """Start processes that hold a run.dir's lock; every one is gone after the test, passed
    or failed (closing its stdin ends it, and its forked worker ends with it)."""
    started: list[subprocess.Popen] = []
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)

    def start(run_dir, fork: bool = False) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(script), str(run_dir),
                                 "fork" if fork else "-"], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ,
                                                             "OMP_NUM_THREADS": "1"})
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stdin.close()  # the holder and its worker read EOF and exit
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def says(proc: subprocess.Popen, word: str) -> None:
    """Wait (no fixed sleep) until the holder prints ``word``; fail if it ends first."""
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    line = proc.stdout.readline().decode().strip() if ready else "(nothing)"
    assert line == word, f"the holder said {line!r}, exit code {proc.poll()}"


def test_a_second_process_is_refused_naming_the_holder_and_a_sigkill_frees_the_lock(
        tmp_path, holders):
    child = holders(tmp_path)
    says(child, "held")
    named = f"in use by pid {child.pid} on {socket.gethostname()}, started "
    with pytest.raises(UserError, match=named), lock.hold(tmp_path):
        pass
    child.send_signal(signal.SIGKILL)  # the kernel drops a dead process's flock
    child.wait(timeout=TIMEOUT)
    with lock.hold(tmp_path):
        assert json.loads((tmp_path / lock.LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_worker_that_inherited_the_lock_does_not_keep_it_after_the_holder_lets_go(
        tmp_path, holders):
    child = holders(tmp_path, fork=True)
    says(child, "held")
    child.stdin.write(b"x")  # the holder leaves its block; its forked worker lives on
    child.stdin.flush()
    says(child, "released")
    assert child.poll() is None  # both still alive, the worker with the inherited descriptor
    with lock.hold(tmp_path):
        pass


def test_the_lock_ends_with_the_holder_whatever_copies_of_its_descriptor_live_on(tmp_path):
    """Forked children close their copy (os.register_at_fork), but a copy can also outlive the
    holder without a fork in Python: a program started with the descriptor passed (pass_fds),
    or one forked by native code. flock belongs to the open file description all copies share,
    so the holder unlocks it (LOCK_UN) before closing: closing alone would leave it held."""
    with lock.hold(tmp_path):
        lock.claim(tmp_path)  # a run that wrote there: its lock file stays after it
        fd = lock._held[tmp_path.absolute() / lock.LOCK_NAME][0]
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 pass_fds=(fd,), stdin=subprocess.PIPE)
    try:
        assert child.poll() is None  # the copy of the descriptor lives on in the child
        with lock.hold(tmp_path):
            pass
    finally:
        child.stdin.close()  # the child reads EOF and exits
        child.wait(timeout=TIMEOUT)


@pytest.mark.slow
def test_the_cli_refused_by_a_held_run_dir_exits_2_and_touches_nothing(tmp_path, holders,
                                                                        capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"the live run's")
    child = holders(run_dir)
    says(child, "held")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    for flags in (["--resume"], ["--overwrite"], []):
        code = main(["train", *ARGS, "train.epochs=1", f"run.dir={run_dir}", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (flags, err)
        assert f"pid {child.pid} on {socket.gethostname()}, started " in err[0], err
        assert "in use" in err[0] and "Traceback" not in err[0]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert child.poll() is None, "the holder must not notice the refused processes"


def test_resume_into_a_directory_of_foreign_files_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("lr: 0.1\n")
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    for flags, says in ((["--resume"], "did not write"), ([], "already holds a run")):
        assert main(["train", *ARGS, "train.epochs=1", "train.max_steps=2",
                     f"run.dir={run_dir}", *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
        assert ("config.yaml" in err and "metrics.jsonl" in err) or says != "did not write", err
    assert (run_dir / "config.yaml").read_text() == "lr: 0.1\n"  # nothing overwritten
    assert (run_dir / "metrics.jsonl").read_text() == '{"epoch": 1, "acc": 0.5}\n'


def test_the_holder_is_named_even_before_it_wrote_itself(tmp_path):
    (tmp_path / lock.LOCK_NAME).write_text("")  # locked, its pid not written yet
    assert "another process" in lock.holder(tmp_path)


def test_a_forked_child_closes_its_copy_of_the_lock_and_holds_no_descriptor(tmp_path,
                                                                              monkeypatch):
    # what os.register_at_fork runs in every forked child, called here on a stand-in entry
    fd = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT, 0o644)
    held = {tmp_path / lock.LOCK_NAME: [fd, 2], tmp_path / "unlocked": [None, 1]}
    monkeypatch.setattr(lock, "_held", held)
    lock._drop_in_child()
    assert held == {tmp_path / lock.LOCK_NAME: [None, 2], tmp_path / "unlocked": [None, 1]}
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_a_lock_file_replaced_while_it_was_locked_is_left_and_the_new_one_locked(
        tmp_path, monkeypatch):
    """A refused run removes the lock file it made just as this run locks it, and another run
    makes a new one: the lock on the removed file guards nothing, so this run closes that
    descriptor (no leak) and locks the file that is there."""
    path = tmp_path / lock.LOCK_NAME
    real, calls = fcntl.flock, []

    def flock(fd, op):
        real(fd, op)
        if not op & fcntl.LOCK_EX:
            return
        if not calls:  # the first lock: the file is swapped under it
            path.unlink()
            path.write_text("")
        calls.append(fd)

    monkeypatch.setattr(lock.fcntl, "flock", flock)
    before = len(os.listdir("/proc/self/fd"))
    with lock.hold(tmp_path):
        assert len(os.listdir("/proc/self/fd")) == before + 1  # the first one was closed
        assert os.fstat(calls[1]).st_ino == os.stat(path).st_ino
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert len(calls) == 2
