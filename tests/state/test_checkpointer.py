"""state/checkpointer.py's finding: a resume reads its checkpoint once (``peek``, then ``find``
with what it read), under run.dir's lock, and reads again only when the folder changed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest

import ironloop
from ironloop.errors import CheckpointError
from ironloop.state.checkpointer import Checkpointer
from ironloop.state.lock import LOCK_NAME
from ironloop.state.run_dir import RunDir
from tests.conftest import blobs, cfg, tiny_mlp

#: (path, whether run.dir's lock was held) of every open for reading, while a test listens
_opened: list[tuple[str, bool]] | None = None
_lock: Path | None = None
_hooked = False


def _audit(event: str, args: tuple) -> None:
    """Every ``open`` of the process (builtins.open, os.open: torch.load's too) is an audit
    event: a real count of the file's reads, not a stand-in for the code that reads it."""
    if event != "open" or _opened is None or not isinstance(args[0], (str, os.PathLike)):
        return
    path, mode, flags = os.path.abspath(os.fspath(args[0])), args[1], args[2]
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else \
        bool(flags & (os.O_WRONLY | os.O_RDWR))
    if path.endswith(".pt") and not writes:
        _opened.append((path, _locked()))


def _locked() -> bool:
    """Whether someone holds run.dir's lock: a second flock of its file is refused while it is
    held (flock is per open file, so this process's own hold refuses it too)."""
    global _opened
    listening, _opened = _opened, None  # the probe's own open is not a read of a checkpoint
    try:
        fd = os.open(_lock, os.O_RDONLY)
    except OSError:
        return False
    finally:
        _opened = listening
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def reads(run_dir: Path):
    """The .pt files opened for reading in the block, each with whether run.dir was locked."""
    global _opened, _lock, _hooked
    if not _hooked:  # an audit hook cannot be removed: one, silent outside this block
        sys.addaudithook(_audit)
        _hooked = True
    seen: list[tuple[str, bool]] = []
    _opened, _lock = seen, run_dir / LOCK_NAME
    try:
        yield seen
    finally:
        _opened = None


def test_a_resume_reads_its_checkpoint_once_and_under_run_dirs_lock(tmp_path):
    conf = cfg(tmp_path, train__max_steps=7)  # 7 steps an epoch: last.pt at step 7
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    run_dir = tmp_path / "run"
    last = str(RunDir(run_dir).checkpoints / "last.pt")
    with reads(run_dir) as seen:
        res = ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 0},
                           resume=True, allow_config_change=True)
    assert res.results["steps"] == 14  # it resumed at step 7
    # the global batch's read and the resume's are one: loaded and digest-checked once
    assert [path for path, _ in seen].count(last) == 1, seen
    assert all(locked for path, locked in seen if path == last), seen


def _steps(tmp_path) -> Path:
    """A run.dir whose checkpoints are step 3 and step 6 (last.pt), returned."""
    ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path, train__max_steps=6,
                                                checkpoint__every_steps=3,
                                                checkpoint__keep_last=2))
    return tmp_path / "run"


def test_find_resumes_from_the_peek_while_the_folder_is_as_it_was(tmp_path):
    run_dir = _steps(tmp_path)
    ckpt = Checkpointer(RunDir(run_dir))
    peeked = ckpt.peek(True)
    found = peeked.found
    with reads(run_dir) as seen:
        assert ckpt.find(True, peeked=peeked) is found and found.step == 6
    assert seen == []  # nothing read again
    # the caller's peek (held while the run trains) no longer holds the checkpoint's state
    assert peeked.found is None and peeked.state is None
    with reads(run_dir) as seen:
        assert ckpt.find(True, peeked=peeked).step == 6  # spent: read again
    assert len(seen) == 1


def test_find_reads_again_when_a_checkpoint_came_or_went_after_the_peek(tmp_path):
    run_dir = _steps(tmp_path)
    ckpt = Checkpointer(RunDir(run_dir))
    peeked = ckpt.peek(True)
    folder = RunDir(run_dir).checkpoints
    # a writer that was not refused by the lock (a rank that read before rank 0 held it):
    # last.pt re-linked to step 3's state
    shutil.copy(folder / "step-00000003.pt", folder / ".next")
    os.replace(folder / ".next", folder / "last.pt")
    (folder / "step-00000006.pt").unlink()
    assert peeked.found is not None and peeked.found.step == 6
    assert ckpt.find(True, peeked=peeked).step == 3
    # what --resume names is compared as it named it: another path, another read
    peeked = ckpt.peek(True)
    assert ckpt.find(str(folder / "step-00000003.pt"), peeked=peeked).step == 3


def test_the_peek_says_nothing_and_find_says_its_warnings_once_then_its_refusal(tmp_path,
                                                                                  capsys):
    run_dir = _steps(tmp_path)
    folder = RunDir(run_dir).checkpoints
    (folder / "last.pt").unlink()  # a link to step 6's file: damaged apart from it
    (folder / "last.pt").write_bytes(b"garbage")
    capsys.readouterr()
    ckpt = Checkpointer(RunDir(run_dir))
    peeked = ckpt.peek(True)
    assert capsys.readouterr().out == ""
    assert ckpt.find(True, peeked=peeked).step == 6  # step-6.pt, last.pt's twin
    assert capsys.readouterr().out.count("is damaged") == 1
    (folder / "step-00000006.pt").write_bytes(b"garbage")
    (folder / "step-00000003.pt").write_bytes(b"garbage")
    peeked = ckpt.peek(True)
    assert peeked.found is None and isinstance(peeked.error, CheckpointError)
    with pytest.raises(CheckpointError, match="every checkpoint in"):
        ckpt.find(True, peeked=peeked)
    assert capsys.readouterr().out.count("is damaged") == 3
