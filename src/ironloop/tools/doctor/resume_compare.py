"""The resume check's comparisons: two scratch runs' records (resume_record.py) step by step,
their last checkpoints key by key, and what each process held outside the checkpoint.

Pure functions over plain data and tensors, so each is tested without running anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Checkpoint entries that differ between two exact runs: where and when they ran, not what.
VARYING = frozenset({"config", "integrity", "loggers", "ironloop_version", "torch_version",
                     "seconds", "train_seconds", "time", "wall_seconds"})


@dataclass
class Records:
    """One scratch process's record: {step: line} and the end-of-run state (None if killed)."""

    steps: dict[int, dict]
    state: dict | None


def read_records(path: Path) -> Records:
    steps, state = {}, None
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except ValueError:  # a line cut by the kill: the steps before it are whole
                continue
            if "end" in line:
                state = line["state"]
            else:
                steps[line["step"]] = line
    return Records(steps, state)


@dataclass
class Difference:
    """The first thing that differs: at ``step`` (0 for the end of the run), ``what`` (batch,
    loss, module, weights, checkpoint, model, data, callback, global, steps) and ``detail``."""

    step: int
    what: str
    detail: str

    def to_dict(self) -> dict:
        return {"step": self.step, "what": self.what, "detail": self.detail}


def first_step_difference(a: dict[int, dict], b: dict[int, dict],
                          steps: range) -> Difference | None:
    """The first step of ``steps`` where run b's record differs from run a's: the batch it saw,
    then the loss, then the module whose training output first differs, then the weights."""
    for step in steps:
        ra, rb = a.get(step), b.get(step)
        if ra is None or rb is None:
            missing = "the uninterrupted run" if ra is None else "the resumed run"
            return Difference(step, "steps", f"{missing} has no record of step {step}")
        diff = _step_difference(step, ra, rb)
        if diff is not None:
            return diff
    return None


def _step_difference(step: int, ra: dict, rb: dict) -> Difference | None:
    if ra["batches"] != rb["batches"]:
        i = _first_unequal(ra["batches"], rb["batches"])
        return Difference(step, "batch", f"micro-batch {i + 1} of {len(ra['batches'])} holds "
                          f"other tensors (hash {_at(rb['batches'], i)} instead of "
                          f"{_at(ra['batches'], i)})")
    if ra["losses"] != rb["losses"]:
        i = _first_unequal(ra["losses"], rb["losses"])
        module = first_module(ra["modules"], rb["modules"])
        where = f"; the first module whose output differs is {module}" if module else ""
        return Difference(step, "loss", f"loss {_num(_at(rb['losses'], i))} instead of "
                          f"{_num(_at(ra['losses'], i))} on micro-batch {i + 1}{where}")
    if ra["weights"] != rb["weights"]:
        return Difference(step, "weights", "the losses are equal, the weights after the "
                          "optimizer step are not (the gradients, the optimizer's state, the LR "
                          "or the gradient scaler differ)")
    return None


def first_module(a: list, b: list) -> str | None:
    """The module whose training output first differs, in the order the forward called them
    (a hook fires when a module returns, so the innermost module comes first)."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            entry = a[i] if i < len(a) else b[i]
            return repr(entry[0])
    return None


def _first_unequal(a: list, b: list) -> int:
    return next((i for i in range(max(len(a), len(b)))
                 if i >= len(a) or i >= len(b) or a[i] != b[i]), 0)


def _at(values: list, i: int) -> Any:
    return values[i] if i < len(values) else "none"


def _num(x: Any) -> str:
    return f"{x:.9g}" if isinstance(x, float) else str(x)


def checkpoint_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The dotted key of the first entry that differs between two checkpoints' dicts (tensors
    bit for bit), skipping what differs between exact runs (``VARYING``); None if equal."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if str(key) in VARYING:
                continue
            if key not in a or key not in b:
                return f"{path}{key} (only in the {'resumed' if key in b else 'uninterrupted'} run)"
            found = checkpoint_difference(a[key], b[key], f"{path}{key}.")
            if found is not None:
                return found
        return None
    where = path.rstrip(".") or "(root)"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} (length {len(b)} instead of {len(a)})"
        for i, (x, y) in enumerate(zip(a, b)):
            found = checkpoint_difference(x, y, f"{path}{i}.")
            if found is not None:
                return found
        return None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if same else where
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if type(a) is type(b) and a == b else where


def state_differences(a: dict | None, b: dict | None) -> list[Difference]:
    """What the two processes held outside the checkpoint at the end and that differs: module
    attributes, the dataset's attributes, callbacks' attributes, the user's globals."""
    if not a or not b:
        return []
    found = []
    for kind, what in (("model", "model"), ("data", "data"), ("globals", "global")):
        for name in sorted(set(a[kind]) | set(b[kind])):
            if a[kind].get(name) != b[kind].get(name):
                found.append(Difference(0, what, f"{name} is {b[kind].get(name)!r} after the "
                                        f"resume, {a[kind].get(name)!r} uninterrupted"))
    for name, cb in a["callbacks"].items():
        other = b["callbacks"].get(name, {}).get("attributes", {})
        changed = sorted(k for k in set(cb["attributes"]) | set(other)
                         if cb["attributes"].get(k) != other.get(k))
        if changed and not cb["state_dict"]:
            found.append(Difference(0, "callback", f"{name} has no state_dict, and its "
                                    f"{', '.join(changed)} differ after the resume "
                                    f"({_pairs(changed, other, cb['attributes'])})"))
    return found


#: Hidden state whose effect the check sees at every step: a module's attribute that forward
#: reads changes that module's output, a dataset's that __getitem__ reads changes a batch.
OBSERVED = ("model", "data")


def without_unread(found: list[Difference]) -> tuple[list[Difference], list[Difference]]:
    """(what makes the resume not exact, module and dataset attributes that differ but that
    nothing read). With every step (batches, module outputs, losses, weights) and the last
    checkpoints equal, such an attribute changed nothing the run computed: a call counter that
    forward increments and never reads. It is named, not counted against the resume. Callbacks'
    attributes and globals stay differences: what they change (a log line, a decision) is not
    recorded per step."""
    if any(d.what not in HIDDEN_KINDS for d in found):  # the trajectory differs: keep them all
        return found, []
    unread = [d for d in found if d.what in OBSERVED]
    return [d for d in found if d.what not in OBSERVED], unread


#: What ``state_differences`` reports, as Difference.what.
HIDDEN_KINDS = ("model", "data", "global", "callback")


def _pairs(keys: list[str], resumed: dict, straight: dict) -> str:
    return "; ".join(f"{k}: {resumed.get(k)!r} vs {straight.get(k)!r}" for k in keys[:3])


def stateless_callbacks(state: dict | None) -> list[str]:
    """Callbacks the run has that hold attributes but no state_dict (named even when the run
    is exact: a crash resets whatever they hold)."""
    if not state:
        return []
    return [name for name, cb in state["callbacks"].items()
            if not cb["state_dict"] and cb["attributes"]]
