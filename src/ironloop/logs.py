"""Run outputs: metrics.jsonl, epochs.jsonl, events.jsonl, evals.jsonl (one line per
evaluation), scalars.jsonl (what callbacks log) and, optionally, TensorBoard.

After a resume, lines past the checkpoint are dropped first, so each step and each epoch appears
exactly once and a curve across crashes is one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ironloop.checkpoint import temp_path
from ironloop.errors import UserError


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file so a reader never sees half of it."""
    tmp = temp_path(path)
    tmp.write_text(text)
    os.replace(tmp, path)


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


class RunLog:
    """Appends JSON lines; each line is flushed so a crash loses at most the line being written."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None = None,
                 resume_epoch: int | None = None):
        self.dir = run_dir
        self.last_logged_step = 0  # the furthest step the previous process logged
        if resume_step is not None:
            self.last_logged_step = truncate_jsonl(run_dir / "metrics.jsonl", "step", resume_step)
            truncate_jsonl(run_dir / "epochs.jsonl", "epoch", resume_epoch)
            for name in ("evals", "scalars"):
                truncate_jsonl(run_dir / f"{name}.jsonl", "step", resume_step)
        self._files = {name: open(run_dir / f"{name}.jsonl", "a")
                       for name in ("metrics", "epochs", "events", "evals", "scalars")}
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise UserError("log.tensorboard=true needs the tensorboard package: "
                                "pip install 'ironloop[tensorboard]' or set "
                                "log.tensorboard=false") from e
            # purge_step drops events past the checkpoint, like the JSONL truncation above.
            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge)

    def write(self, name: str, row: dict) -> None:
        f = self._files[name]
        f.write(json.dumps(row) + "\n")
        f.flush()
        if self.tb is not None and name != "events":
            step = row["step"]
            for k, v in row.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{name}/{k}", v, step)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        if self.tb is not None:
            self.tb.close()
