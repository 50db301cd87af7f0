"""Run outputs: metrics.jsonl, epochs.jsonl, events.jsonl, evals.jsonl (one line per
evaluation), scalars.jsonl (what callbacks log) and, optionally, TensorBoard, W&B and MLflow
(loggers.py).

After a resume, lines past the checkpoint are dropped first, so each step and each epoch appears
exactly once and a curve across crashes is one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ironloop.errors import UserError
from ironloop.outputs import durable
from ironloop.state.io import write_atomic
from ironloop.state.run_dir import LOGS, RunDir


def _append(path: Path):
    """A JSONL file opened for appending, unbuffered: each ``write`` goes straight to the file,
    so a failed one leaves nothing buffered for ``close`` to fail on again."""
    return open(path, "ab", buffering=0)


def truncate_jsonl(path: Path, key: str, last: int) -> int:
    """Keep only the lines whose ``key`` is <= ``last``; drop a torn final line.

    Returns the largest ``key`` the file held: where the previous process got to."""
    if not path.exists():
        return 0
    kept, seen = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
        seen = max(seen, row.get(key, 0))
        if row.get(key, 0) <= last:
            kept.append(line)
    write_atomic(path, "".join(k + "\n" for k in kept))
    return seen


def _last_time(path: Path) -> float | None:
    """The "time" of a JSONL file's last complete line, or None."""
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            return json.loads(line).get("time")
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
    return None


class RunLog:
    """Appends JSON lines; each line is flushed so a crash loses at most the line being written.

    Every metrics and epochs row also goes to ``loggers`` (TensorBoard, W&B, MLflow: see
    loggers.py), each of which warns once and drops out if it fails."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None = None,
                 resume_epoch: int = 0, loggers: list | None = None):
        self.dir = run_dir
        self.last_logged_step = 0  # the furthest step the previous process logged
        self.last_logged_time = None  # when it wrote its last metrics line
        if resume_step is not None:
            self.last_logged_time = _last_time(RunDir(run_dir).log("metrics"))
            self.last_logged_step = self._truncate(resume_step, resume_epoch)
        self._files = {name: _append(RunDir(run_dir).log(name)) for name in LOGS}
        self.loggers = list(loggers or [])
        if tensorboard and not any(lg.name == "tensorboard" for lg in self.loggers):
            from ironloop.outputs.loggers import Guarded, TensorBoard

            self.loggers.append(Guarded(durable.Durable(TensorBoard(run_dir, resume_step), 0,
                                                        passthrough=True)))

    def write(self, name: str, row: dict) -> None:
        f = self._files[name]
        data = memoryview((json.dumps(row) + "\n").encode())
        size = os.fstat(f.fileno()).st_size  # where this line starts
        try:
            while data:  # an unbuffered write may take part of the line
                data = data[f.write(data):]
        except OSError as e:  # a full disk or quota: cut the torn line, stop like a checkpoint
            os.ftruncate(f.fileno(), size)
            raise _no_room(RunDir(self.dir).log(name), e) from None
        if name != "events":
            for logger in self.loggers:
                logger.write(name, row)

    def durable(self, step: int) -> None:
        """The checkpoint at ``step`` is on disk: the trackers get the rows up to it."""
        for logger in self.loggers:
            logger.durable(step)
        self._mark()

    def catch_up(self, step: int) -> None:
        """On resume from ``step``: the trackers get the logged rows they do not hold yet."""
        durable.catch_up(self.loggers, self.dir, step)
        self._mark()

    def _mark(self) -> None:
        if self.loggers:
            try:
                durable.write_marks(self.dir, {lg.name: lg.confirmed() for lg in self.loggers})
            except OSError as e:  # the trackers' hand-over mark: stops as metrics.jsonl does
                raise _no_room(self.dir / durable.MARKS, e) from None

    def rewind(self, step: int, epoch: int) -> None:
        """Drop the JSONL lines past ``step``/``epoch`` (a guard rollback), as a resume does;
        the trackers drop the rows they were still holding back past it."""
        for logger in self.loggers:
            logger.rewind(step)
        for f in self._files.values():
            f.close()
        self._truncate(step, epoch)
        self._files = {name: _append(RunDir(self.dir).log(name)) for name in self._files}

    def _truncate(self, step: int, epoch: int) -> int:
        """Keep the lines up to ``step`` (``epoch`` for epochs.jsonl); returns the furthest
        step metrics.jsonl held."""
        for name in ("evals", "scalars"):
            truncate_jsonl(RunDir(self.dir).log(name), "step", step)
        truncate_jsonl(RunDir(self.dir).log("epochs"), "epoch", epoch)
        return truncate_jsonl(RunDir(self.dir).log("metrics"), "step", step)

    def ids(self) -> dict:
        """The external runs' ids (W&B, MLflow), for the checkpoint: a resume continues them."""
        out: dict = {}
        for logger in self.loggers:
            out.update(logger.ids())
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        for logger in self.loggers:
            logger.close()
        self._mark()


def _no_room(path: Path, e: OSError) -> UserError:
    """The one line for a log file that could not be written (a full disk, a quota)."""
    return UserError(f"could not write {path}: {e.strerror or e}. The logs end at their last "
                     f"complete line and the checkpoints are intact; free disk space (or point "
                     f"run.dir at a disk with room), then --resume")
