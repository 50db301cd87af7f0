"""The file writer behind the checkpointer (checkpointer.py): one ``.pt`` file per save, from
rank 0, and the newest valid one found again.

Layout: ``step-{N:08d}.pt`` rolling files (the newest ``keep_last``), ``last.pt`` (the newest
save) and ``best.pt`` (the best validation save). Each save writes its bytes once; ``last.pt``
and ``best.pt`` are hard links to that file. This is safe because no file is ever modified in
place: every write makes a new inode via temp file + rename, so re-pointing or deleting one name
never changes what another name holds.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ironloop.errors import CheckpointError, option

from .io import (
    LoadFailure,
    fsync_dir,
    load_checked,
    remove_quietly,
    save_atomic,
    temp_path,
    write_failed,
)
from .remote import Mirror
from .run_dir import BEST, LAST, step_entries, step_name
from .snapshot import copies_done, snapshot

LAST_FILE, BEST_FILE = f"{LAST}.pt", f"{BEST}.pt"


def retention_victims(steps: list[int], keep_last: int) -> list[int]:
    """The steps to delete, oldest first, so that only the newest ``keep_last`` remain."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    ordered = sorted(set(steps))
    return ordered[: max(len(ordered) - keep_last, 0)]


class FileWriter:
    """Saves checkpoints into ``directory`` and keeps the newest ``keep_last`` step files.

    With ``async_write=True``, ``save`` copies the state to CPU memory and returns; a background
    thread writes it while training continues. At most one write is in flight; its error (e.g. a
    full disk) is raised by the next ``save`` or by ``wait``/``close``. The CPU copy is kept and
    reused by the next save (one checkpoint's worth of host memory), which makes the stall a
    plain memory copy.

    With a ``mirror`` (``checkpoint.remote``), each checkpoint is handed to it once it is
    durable here, with the copies of the run's logs it took at the save; the mirror uploads
    them in its own thread.
    """

    def __init__(self, directory: Path, keep_last: int, async_write: bool = False,
                 warn: Callable[[str], None] | None = None, mirror: Mirror | None = None):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.async_write = async_write
        self._warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: Any = None  # the last async snapshot: reused as the next one's buffers
        self.mirror = mirror

    def discard_after(self, step: int) -> list[Path]:
        """Delete what a resume from ``step`` leaves behind: step files newer than it (an
        abandoned timeline after a rewind, or damaged files that the fallback skipped) and
        temp files of writers that were killed. Returns the step files deleted."""
        for tmp in self.directory.glob(".*.tmp-*"):
            remove_quietly(tmp)
        newer = [p for s, p in sorted(step_entries(self.directory).items()) if s > step]
        for p in newer:
            remove_quietly(p)
        return newer

    def save(self, state: dict, step: int, best: bool = False) -> None:
        """Save ``state`` as the checkpoint for ``step``; also as ``best.pt`` if ``best``."""
        # Here, not in the write: an async write runs on while the loop appends past ``step``.
        logs = self.mirror.snapshot_logs(step) if self.mirror is not None else None
        if not self.async_write:
            self._write(state, step, best, logs)
            return
        self.wait()  # at most one write in flight; a failed previous write is raised here
        # Before returning: the caller may mutate its tensors right away. The previous
        # snapshot's write is done, so its buffers are free to copy into. A GPU's tensors go to
        # pinned memory, queued on their stream ahead of the next step's updates, with no host
        # sync here: the writer thread waits for them (``landed``) before it reads them.
        snap = self._staging = snapshot(state, self._staging, pinned=True)
        landed = copies_done(state)
        self._thread = threading.Thread(target=self._background,
                                        args=(snap, step, best, logs, landed),
                                        name="ironloop-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the in-flight write is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._staging = None
            if self.mirror is not None:  # pending uploads get checkpoint.remote_wait_s
                print(self.mirror.close())

    def _background(self, state: dict, step: int, best: bool, logs: Path | None,
                    landed: Callable[[], None]) -> None:
        try:
            landed()
            self._write(state, step, best, logs)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    def _write(self, state: dict, step: int, best: bool, logs: Path | None = None) -> None:
        last = self.directory / LAST_FILE
        primary = self.directory / step_name(step) if self.keep_last > 0 else last
        save_atomic(state, primary)
        targets = [last] if primary != last else []
        targets += [self.directory / BEST_FILE] if best else []
        for target in targets:
            self._point(target, primary)
        if targets:
            fsync_dir(self.directory)
        # Only now, with the new checkpoint durable under every name, may old ones go.
        steps = step_entries(self.directory)
        for victim in retention_victims(list(steps), self.keep_last):
            if victim == step:
                continue  # a save for an older step than existing files: never delete it
            try:
                os.unlink(steps[victim])
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn(f"could not delete old checkpoint {steps[victim]} ({e.strerror}); "
                           "delete it by hand if disk space runs short")
        if self.mirror is not None:  # hard links: the upload reads them in its own thread
            self.mirror.push(step, {step_name(step): primary}, "file", best, logs)

    def _point(self, target: Path, primary: Path) -> None:
        """Make ``target`` name the same content as ``primary``, atomically.

        A hard link costs no I/O, so a save writes its bytes once however many names it gets.
        On filesystems without hard links, fall back to copying the bytes.
        """
        tmp = temp_path(target)
        remove_quietly(tmp)  # a stale temp from a crashed process with the same pid
        try:
            try:
                os.link(primary, tmp)
            except OSError:
                with open(primary, "rb") as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 16 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            os.replace(tmp, target)
        except OSError as e:
            remove_quietly(tmp)
            raise write_failed(target, e) from e


def _progress_step(state: dict) -> int:
    progress = state.get("progress")
    step = progress.get("step") if isinstance(progress, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise LoadFailure(Path(), "no progress.step recorded", "")
    return step


def latest_file(directory: Path, warn: Callable[[str], object]) -> tuple[Path, dict] | None:
    """The valid checkpoint with the highest progress step, or None if there are none at all.

    ``last.pt`` is tried first. Step files newer than it are tried too, newest first: a crash
    between writing ``step-N.pt`` and re-linking ``last.pt`` leaves the newest state only there.
    Each damaged file is reported through ``warn``. ``best.pt`` is never a resume candidate.
    """
    directory = Path(directory)
    last = directory / LAST_FILE
    steps = step_entries(directory)
    has_last = last.is_file()
    if not has_last and not steps:
        return None
    damaged: list[str] = []

    def attempt(path: Path) -> tuple[dict, int] | None:
        try:
            state = load_checked(path, "cpu")
            return state, _progress_step(state)
        except LoadFailure as e:
            damaged.append(f"{path} ({e.reason})")
            warn(f"checkpoint {path} is damaged ({e.reason}); falling back to an older one")
            return None

    found = attempt(last) if has_last else None
    floor = found[1] if found else None
    for step in sorted(steps, reverse=True):
        if floor is not None and step <= floor:
            break
        newer = attempt(steps[step])
        if newer is not None:
            return steps[step], newer[0]
    if found is not None:
        return last, found[0]
    raise CheckpointError(
        f"every checkpoint in {directory} is damaged: {', '.join(damaged)}. Pass "
        f"{option('overwrite')} to start over, or {option('resume', 'PATH')} to pick a file "
        f"(e.g. best.pt) yourself."
    )


def has_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds any checkpoint (last.pt, best.pt or a step file)."""
    directory = Path(directory)
    return (directory / LAST_FILE).exists() or (directory / BEST_FILE).exists() \
        or bool(step_entries(directory))
