"""One owner per run directory: an exclusive ``flock`` on ``run.dir/.ironloop.lock``.

Two processes writing one run.dir destroy each other's work: a second ``--resume`` deletes the
first's newer checkpoints as "past the step it resumed from", an ``--overwrite`` truncates a live
run's logs (a requeued SLURM job overlapping a stray one does exactly this). The lock is taken
before anything in run.dir is read, written or deleted, and held until the run ends. The kernel
drops a ``flock`` when its process dies, however it dies, so a SIGKILL never leaves a stale lock
behind; the file itself stays (it names the last holder, and it marks the directory as one that
ironloop wrote). Under torchrun rank 0 holds it for the job. Within one process the lock is
re-entrant (``ironloop train`` takes it before the preflight doctor, ``fit`` again).

Filesystems: on local disks ``flock`` is exact. On NFS (Linux >= 2.6.12) the client emulates it
with a POSIX byte-range lock that the server arbitrates, so it holds across nodes when the lock
manager runs (NFSv4, or NFSv3 with lockd); a ``nolock`` mount makes it local to one node. On
Lustre it holds across nodes with the ``flock`` mount option, only within a node with
``localflock``, and fails (ENOSYS) with neither: ironloop then warns and runs unlocked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ironloop.errors import UserError

LOCK_NAME = ".ironloop.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_held: dict[Path, list] = {}  # lock path -> [fd or None (unsupported), holds]
_found: dict[Path, bool] = {}  # lock path -> whether the file was there before this process


def holder(run_dir: Path) -> str:
    """Who holds run_dir, as its lock file says (the holder writes itself there once locked)."""
    try:
        record = json.loads((Path(run_dir) / LOCK_NAME).read_text())
        return f"pid {record['pid']} on {record['host']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"


def _acquire(path: Path, warn) -> int | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"run.dir {path.parent} cannot be created or written "
                        f"({e.strerror or e}); choose a writable run.dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"run.dir {path.parent} is in use by {holder(path.parent)}; wait for "
                        f"that run to end (or stop it), or choose another run.dir") from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _UNSUPPORTED:
            raise
        warn(f"warning: cannot lock {path} ({e.strerror}): this filesystem has no flock, so "
             f"nothing stops a second run from using run.dir at the same time")
        return None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


@contextlib.contextmanager
def hold(run_dir: Path, enabled: bool = True, warn=print):
    """Hold ``run_dir`` for the block, or raise a UserError naming the process that holds it.
    ``enabled=False`` (ranks other than 0) holds nothing."""
    path = Path(run_dir).absolute() / LOCK_NAME
    if not enabled:
        yield
        return
    if path not in _held:
        _found.setdefault(path, path.exists())
        _held[path] = [_acquire(path, warn), 0]
    entry = _held[path]
    entry[1] += 1
    try:
        yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            if entry[0] is not None:
                # Unlock before closing: DataLoader workers forked while the lock was held share
                # its open file description, and the flock lasts until the last copy closes.
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])


def written_by_ironloop(run_dir: Path) -> bool:
    """Whether an ironloop run had used ``run_dir`` before this process: every run leaves its
    lock file there, before it writes anything else."""
    path = Path(run_dir).absolute() / LOCK_NAME
    return _found.get(path, path.exists())
