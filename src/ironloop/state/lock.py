"""One owner per run directory: an exclusive ``flock`` on ``run.dir/.ironloop.lock``.

Two processes writing one run.dir destroy each other's work: a second ``--resume`` deletes the
first's newer checkpoints as "past the step it resumed from", an ``--overwrite`` truncates a live
run's logs (a requeued SLURM job overlapping a stray one does exactly this). The lock is taken
before anything in run.dir is read, written or deleted, and held until the run ends. The kernel
drops a ``flock`` when the last descriptor of its open file goes, however its process dies, so a
SIGKILL leaves no stale lock behind; the file itself stays (it names the last holder, and it
marks the directory as one that ironloop wrote). Under torchrun rank 0 holds it for the job.
Within one process the lock is re-entrant (a second ``hold`` of a held run.dir only counts);
``ironloop train`` takes it once, before torch's import, and tells the front door so
(``tools/recipe.run_fit``).

Forked children (DataLoader workers, ours or the user's, any multiprocessing fork) would share
the lock's open file description, so orphaned workers of a SIGKILLed run held it for seconds and
the restart was refused. Every forked child closes its copy of the descriptor at once
(``os.register_at_fork``): closing a copy never unlocks the parent's, and the child never holds
the lock. Why not POSIX ``lockf`` (not inherited across fork): it is dropped when the process
closes *any* descriptor of the file (reading the lock file to name its holder would unlock), and
on Lustre and local disks it is a different lock from the ``flock`` described below. Children
started by exec (spawn, forkserver, subprocess) never see it: Python opens it close-on-exec.

A lock that is free was dropped, so the holder a refused run names is checked too: a pid that no
longer runs on this host is never named as the one that holds run.dir.

A run that is refused leaves run.dir as it was: a lock file this process created is removed again
unless the run claimed the directory (``claim``, once every check that can refuse it passed).

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
_NOT_YET = "another process (it has not written its pid yet)"
_held: dict[Path, list] = {}  # lock path -> [fd or None (unsupported), holds]
_found: dict[Path, bool] = {}  # lock path -> whether the file was there before this process
_made: dict[Path, list[Path]] = {}  # lock path -> what this process created: the file, dirs
_before: dict[Path, bytes] = {}  # lock path -> the file's content before this process wrote it
_claimed: set[Path] = set()  # lock paths whose run passed every check that can refuse it


def _drop_in_child() -> None:
    """In a forked child: close its copies of the lock descriptors, never unlock (the lock
    belongs to the open file description the parent shares; LOCK_UN would free it for both)."""
    for entry in _held.values():
        if entry[0] is not None:
            with contextlib.suppress(OSError):
                os.close(entry[0])
            entry[0] = None


os.register_at_fork(after_in_child=_drop_in_child)


def holder(run_dir: Path) -> str:
    """Who holds run_dir, as its lock file says (the holder writes itself there once locked).
    A pid on this host that no longer runs is not named: its lock went with it, and the file
    still names it only because the live holder has not written itself yet."""
    try:
        record = json.loads((Path(run_dir) / LOCK_NAME).read_text())
        pid, host = int(record["pid"]), record["host"]
        if host == socket.gethostname() and not alive(pid):
            return _NOT_YET
        return f"pid {pid} on {host}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return _NOT_YET


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts). ``pid`` comes from a
    file another process wrote: anything but a positive int names no process (0 and -1 would
    ask about a whole process group, or every process)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _open(path: Path) -> int:
    """The lock file's descriptor; creates run.dir and the file when missing, and records what
    it created so that a refused run can take it away again (``_release``)."""
    missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # deepest 1st
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _made[path] = [path, *missing]
        return fd
    except OSError as e:
        raise UserError(f"run.dir {path.parent} cannot be created or written "
                        f"({e.strerror or e}); choose a writable run.dir") from None


def _acquire(path: Path, warn) -> int | None:
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"run.dir {path.parent} is in use by {holder(path.parent)}; wait "
                            f"for that run to end (or stop it), or choose another "
                            f"run.dir") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _UNSUPPORTED:
                raise
            warn(f"warning: cannot lock {path} ({e.strerror}): this filesystem has no flock, "
                 f"so nothing stops a second run from using run.dir at the same time")
            return None
        if _same_file(fd, path):
            break
        os.close(fd)  # a refused run removed the file we opened: lock the one that is there
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    _before[path] = os.pread(fd, 1 << 16, 0)  # put back if this run is refused
    _rewrite(fd, (json.dumps(record) + "\n").encode())
    return fd


def _rewrite(fd: int, content: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, content, 0)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def hold(run_dir: Path, enabled: bool = True, warn=print):
    """Hold ``run_dir`` for the block, or raise a UserError naming the process that holds it.
    ``enabled=False`` (ranks other than 0) holds nothing."""
    path = Path(run_dir).absolute() / LOCK_NAME
    if not enabled:
        yield
        return
    if path not in _held:
        _found[path] = path.exists()
        _held[path] = [_acquire(path, warn), 0]
    entry = _held[path]
    entry[1] += 1
    try:
        yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            _release(path, entry[0])


def claim(run_dir: Path) -> None:
    """run.dir passed every check that can refuse it, and the run writes there from now on:
    its lock file stays when the lock is let go."""
    _claimed.add(Path(run_dir).absolute() / LOCK_NAME)


def _release(path: Path, fd: int | None) -> None:
    """A run that never claimed run.dir takes back what it wrote: the lock file's previous
    record, or the lock file itself (while still locked) and the directories it made (if
    empty), so a refused run leaves run.dir as it found it."""
    made, before, _ = _made.pop(path, []), _before.pop(path, b""), _found.pop(path, None)
    if path not in _claimed:
        if fd is not None and not made:  # the previous holder's record, as it was
            _rewrite(fd, before)
        for p in made:
            with contextlib.suppress(OSError):  # a directory someone else wrote into stays
                p.unlink() if p == path else p.rmdir()
    _claimed.discard(path)
    if fd is not None:
        # Unlock, not only close: the lock ends here whatever copies of the descriptor exist.
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def written_by_ironloop(run_dir: Path) -> bool:
    """Whether an ironloop run had used ``run_dir`` before this process: every run leaves its
    lock file there, before it writes anything else."""
    path = Path(run_dir).absolute() / LOCK_NAME
    return _found.get(path, path.exists())
