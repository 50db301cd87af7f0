"""Fabricated records, states and exits that the resume check's tests share."""

from __future__ import annotations

import json
from pathlib import Path

from ironloop.config import load_config

CASES = "tests.resume_cases"


def rec(batches=("b",), losses=(1.0,), weights="w", modules=(("fc (Linear)", "h"),)) -> dict:
    """One step's record as resume_record writes it."""
    return {"batches": list(batches), "losses": list(losses), "weights": weights,
            "modules": [list(m) for m in modules]}


# --- resume_compare: what the processes held outside the checkpoint ----------------------------

def held_state(model=None, data=None, globals_=None, callbacks=None) -> dict:
    return {"model": model or {}, "data": data or {}, "globals": globals_ or {},
            "callbacks": callbacks or {}}


# --- resume_check: the scratch runs ----------------------------------------------------------

def config(tmp_path, *extra: str):
    return load_config(None, [f"data.name={CASES}:clean_data", f"run.dir={tmp_path / 'run'}",
                              "model.name=mlp", "model.kwargs={hidden: [16]}",
                              "train.batch_size=16", "train.epochs=3", *extra])


class Exited:
    """A finished scratch process."""

    def __init__(self, code: int | None):
        self.returncode, self.killed = code, False

    def wait(self) -> int:
        return -9 if self.killed else self.returncode

    def poll(self):
        return self.returncode

    def kill(self) -> None:
        self.killed = True


def write_records(path: Path, steps, state=None, **changed) -> None:
    """A scratch run's record: a step line per step (``changed``: {step: record}), then its
    end state."""
    lines = [{"step": i, **changed.get(f"s{i}", rec(batches=[f"b{i}"]))} for i in steps]
    if state is not None:
        lines.append({"end": steps[-1], "state": state})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
