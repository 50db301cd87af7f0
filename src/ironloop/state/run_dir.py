"""A run's directory: every path a run writes there, each name defined once, and its lock.

    run.dir/
        checkpoints/        the checkpointer's (state/checkpointer.py): step-N.pt or step-N.dcp/,
                            last, best, the remote's staging and lineage record
        config.yaml         the resolved config and what the user passed (outputs/records.py)
        metrics.jsonl ...   the logs (LOGS: outputs/runlog.py), guard.jsonl, run.json
        results.json, final.safetensors, final_avg.safetensors    at the end
        tb/, wandb/, mlflow.db, trace/, report/, doctor.json, trackers.json

``OUTPUTS`` is what ``--overwrite`` removes and nothing else; ``MIRRORED`` what travels with
each checkpoint to ``checkpoint.remote``. The checkpoint names (``step-N``, ``last``, ``best``)
are here too, for the file and the sharded writers and the remote's manifests alike.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from pathlib import Path

from ironloop.state import lock

CHECKPOINTS = "checkpoints"
CONFIG = "config.yaml"
RESULTS = "results.json"
RUN_JSON = "run.json"
FINAL = "final.safetensors"
FINAL_AVG = "final_avg.safetensors"
GUARD = "guard.jsonl"
DOCTOR = "doctor.json"
TRACKERS = "trackers.json"
TENSORBOARD, TRACE = "tb", "trace"
REPORT = "report"  # ``ironloop report``'s default folder
TUNE, TUNED = "tune.json", "tuned.yaml"  # ``ironloop tune``'s record and its config
#: the JSONL logs RunLog appends to (``<kind>.jsonl``); the first four go to the trackers
LOGS = ("metrics", "epochs", "evals", "scalars", "events")
TRACKED = LOGS[:4]
#: Files a run writes; --overwrite removes these and nothing else (every LOGS kind among them).
OUTPUTS = (CHECKPOINTS, "metrics.jsonl", "epochs.jsonl", "events.jsonl", RESULTS, FINAL,
           FINAL_AVG, CONFIG, TENSORBOARD, REPORT, "evals.jsonl", "scalars.jsonl", RUN_JSON,
           "wandb", "mlflow.db", GUARD, TRACE, TRACKERS)
#: The run's append-only logs, mirrored with each checkpoint. Not trackers.json: a new node has
#: no tb/ files, so TensorBoard must get every row again from the restored JSONL.
MIRRORED = (*(f"{k}.jsonl" for k in LOGS), GUARD, RUN_JSON)

#: a checkpoint's kinds, by their names' suffix: one file, or a sharded (DCP) directory
SUFFIXES = {"file": ".pt", "dcp": ".dcp"}
LAST, BEST = "last", "best"
# [0-9], not \d: int() reads every Unicode digit, and "step-٠٠٤٦.pt" is not a step name
STEP_RE = {kind: re.compile(rf"^step-([0-9]+){re.escape(s)}$") for kind, s in SUFFIXES.items()}


def step_name(step: int, kind: str = "file") -> str:
    """``step-00000042.pt`` (a file) or ``step-00000042.dcp`` (a sharded directory)."""
    return f"step-{step:08d}{SUFFIXES[kind]}"


def step_entries(directory: Path, kind: str = "file") -> dict[int, Path]:
    """step number -> path, for the step checkpoints of ``kind`` in ``directory`` (temp names
    start with '.' and never match)."""
    found = {}
    if directory.is_dir():
        for p in directory.iterdir():
            m = STEP_RE[kind].match(p.name)
            if m:
                found[int(m.group(1))] = p
    return found


class RunDir:
    """``run.dir``: the paths a run writes, by role. A value object: two RunDirs of one path are
    the same directory."""

    __slots__ = ("path",)

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def log(self, kind: str) -> Path:
        """``<kind>.jsonl``: metrics, epochs, evals, scalars or events."""
        return self.path / f"{kind}.jsonl"

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def results(self) -> Path:
        return self.path / RESULTS

    @property
    def guard_log(self) -> Path:
        return self.path / GUARD

    def outputs(self) -> list[Path]:
        """What --overwrite removes: the files a run writes, and nothing else."""
        return [self.path / name for name in OUTPUTS]

    def hold(self, enabled: bool = True) -> AbstractContextManager[None]:
        """run.dir's lock for the block (state/lock.py); ``enabled=False`` holds nothing."""
        return lock.hold(self.path, enabled)
