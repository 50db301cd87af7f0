"""Each step exactly once in the trackers (TensorBoard, W&B, MLflow), across any number of
kills and resumes.

The trackers only append (MLflow has no call that deletes a metric point; a W&B offline run
cannot be resumed, and syncing a second offline directory can replace the first one's history:
wandb issues #3841, #4624, #5865; W&B's rewind needs its server). A step logged by a process that
is then killed past its last checkpoint would be logged again by the resumed one. So a tracker
gets a row only once the checkpoint covering its step is on disk (``Durable``): what it holds is
never redone. A resume then sends each tracker the rows of the JSONL files it does not hold:
past what its own files say it holds (MLflow's store; W&B's transaction logs, read by
``wandb_file.py``, since wandb writes them on its own schedule and a kill loses the tail), or,
for TensorBoard, past the step ``trackers.json`` says it flushed at the last hand-over, purging
anything past it (``purge_step``). Trackers therefore lag by at most one checkpoint interval
(``checkpoint.every_steps``); a run that ends normally hands over every row at close.

With checkpoints off there is no resume, and rows go straight through.
"""

from __future__ import annotations

import json
from pathlib import Path

from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import write_atomic
from ironloop.state.run_dir import TRACKED, TRACKERS

MARKS = TRACKERS
KINDS = TRACKED  # what RunLog forwards to the trackers


class Durable:
    """A tracker behind the checkpoints: rows wait until ``durable(step)`` covers them.

    ``inner`` has ``write_rows(rows)``, ``flush()`` and ``close()``; an ``asynchronous`` one
    (MLflow) is flushed at the next hand-over, so a checkpoint never waits for its writes."""

    def __init__(self, inner, confirmed: int, passthrough: bool = False):
        self.inner, self.name, self.passthrough = inner, inner.name, passthrough
        self.pending: list[tuple[str, dict]] = []
        self.confirmed = self.sent = confirmed  # flushed through / handed over through

    def write(self, kind: str, row: dict) -> None:
        if self.passthrough:  # no checkpoints, so no resume: nothing will be redone
            self.inner.write_rows([(kind, row)])
        else:
            self.pending.append((kind, row))

    def held(self) -> dict[str, int]:
        """The last step of each kind the tracker holds: what its own files say (W&B, MLflow),
        else what it confirmed (TensorBoard)."""
        told = self.inner.held_steps()
        return {kind: self.confirmed for kind in KINDS} if told is None else told

    def durable(self, step: int) -> None:
        """The checkpoint at ``step`` is on disk: hand over the rows up to it."""
        ready = [(k, r) for k, r in self.pending if r["step"] <= step]
        self.pending = [(k, r) for k, r in self.pending if r["step"] > step]
        if getattr(self.inner, "asynchronous", False):
            self.inner.flush()  # the previous hand-over's writes are in the store now
            self.confirmed = self.sent
            if ready:
                self.inner.write_rows(ready)
            self.sent = max(self.sent, step)
            return
        if ready:
            self.inner.write_rows(ready)
        self.inner.flush()
        self.confirmed = self.sent = max(self.sent, step)

    def ids(self) -> dict:
        return self.inner.ids()

    def rewind(self, step: int) -> None:
        """A guard rollback to ``step``: the rows past it will be redone."""
        self.pending = [(k, r) for k, r in self.pending if r["step"] <= step]

    def finish(self, failing: bool) -> None:
        """At close: a run that ends normally hands over everything; one that fails keeps only
        what its checkpoints cover (the resume sends the rest)."""
        if not failing:  # every row is final: hand over up to the last one
            self.durable(max([r["step"] for _, r in self.pending], default=self.sent))
        if getattr(self.inner, "asynchronous", False):
            self.inner.flush()
            self.confirmed = self.sent
        self.inner.close()


def read_marks(run_dir: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads((run_dir / MARKS).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # none yet (a fresh run, or killed before its first checkpoint): 0 for all


def write_marks(run_dir: Path, marks: dict[str, float]) -> None:
    write_atomic(run_dir / MARKS, json.dumps({k: int(v) for k, v in marks.items()
                                              if v is not None}) + "\n")


def catch_up(trackers: list, run_dir: Path, step: int) -> None:
    """On resume from ``step``: send each tracker the logged rows it does not hold yet (the
    JSONL files were truncated to ``step`` already)."""
    rows = {kind: read_jsonl(run_dir / f"{kind}.jsonl") for kind in KINDS}
    for tracker in trackers:
        held = tracker.held()
        for kind in KINDS:
            for row in rows[kind]:
                if held.get(kind, 0) < row.get("step", 0) <= step:
                    tracker.write(kind, row)
        tracker.durable(step)
