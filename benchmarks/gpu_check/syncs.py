"""Part 2, host syncs in plain steps: ``torch.cuda.set_sync_debug_mode("error")`` armed
over every plain step, in fp32, bf16 and fp16, guard and step-time split on (their defaults).

A plain step is one without a log line (every ``log.every_steps``), where ironloop promises no
host read at all; the first step (lazy initialisation) is left out too. The mode is armed in
the ``on_step_end`` before a plain step, so the next batch's fetch and its non_blocking copy,
the forward, backward, unscale, clip, the guard's verdict, the fused optimizer step and the
timer's CUDA events all run armed; it is disarmed at that step's own ``on_step_end``. Any host
sync there raises, and the row says where. The goal is 0.

The rows: in-memory tensors (ironloop's sliced path) in each precision, and fp16 through a
DataLoader with workers and pinned memory. Without CUDA (a dry run) the same runs go through
with the arming as a no-op, and the rows say "skipped: no CUDA".
"""

from __future__ import annotations

import tempfile
import traceback
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

import ironloop
from benchmarks.gpu_check.shared import Jpegs, Part, stand_in
from ironloop.callbacks import Callback

LOG_EVERY = 10


class ArmPlainSteps(Callback):
    """Arms sync debug mode "error" for each plain step up to ``last``; counts the plain steps
    finished. The epoch's end (its settle, a host read) follows step ``last`` and must run
    disarmed: ``on_epoch_end`` checks that it did, which a CPU can check too."""

    def __init__(self, cuda: bool, last: int):
        self.cuda, self.last, self.armed, self.checked = cuda, last, False, 0
        self.upcoming = 1  # the step armed for, once armed

    def arm(self, on: bool) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error" if on else "default")
        self.armed = on

    def on_step_end(self, run, metrics: dict) -> None:
        self.checked += self.armed
        self.arm(False)
        self.upcoming = metrics["step"] + 1
        if self.upcoming <= self.last and self.upcoming % LOG_EVERY:  # no log line: no read
            self.arm(True)

    def on_epoch_end(self, run, metrics: dict) -> None:
        if self.armed:
            raise RuntimeError("the epoch's end ran armed: the check would blame its settle")

    def on_train_end(self, run, metrics: dict) -> None:
        self.arm(False)


def where(e: BaseException) -> str:
    """The innermost frames in ironloop or in this check (not torch's): the sync's caller."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/ironloop/" in f.filename or "/gpu_check/" in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:3])


def check(part: Part, data, precision: str, workers: int, tmp: Path) -> dict:
    batch = 32
    arm = ArmPlainSteps(part.cuda, last=len(data) // batch)
    config = {"run.dir": tempfile.mkdtemp(dir=tmp), "run.device": part.device.type,
              "train.epochs": 1, "train.batch_size": batch, "train.precision": precision,
              "data.num_workers": workers, "log.every_steps": LOG_EVERY,
              "log.progress": "off", "checkpoint.enabled": False, "doctor.preflight": False,
              "guard.enabled": True, "profile.breakdown": True}
    try:
        ironloop.fit(stand_in(), data, None, config, callbacks=[arm])
    except RuntimeError as e:
        if "synchronizing" not in str(e):
            raise
        raise RuntimeError(f"host sync in plain step {arm.upcoming}: {where(e)}") from e
    finally:
        arm.arm(False)
    return {"plain_steps_checked": arm.checked, "host_syncs": 0 if part.cuda else None}


def main() -> None:
    part = Part("syncs", __doc__.splitlines()[0])
    n, size = (32 * 13, 8) if part.dry else (32 * 43, 32)  # the last step is not a log step
    g = torch.Generator().manual_seed(0)
    tensors = TensorDataset(torch.randn(n, 3, size, size, generator=g),
                            torch.randint(0, 1000, (n,), generator=g))
    rows: list[tuple[str, Dataset, str, int]] = [
        (f"{p}, in-memory tensors", tensors, p, 0) for p in ("fp32", "bf16", "fp16")]
    rows.append(("fp16, DataLoader, 2 workers, pin_memory", Jpegs(n, size), "fp16", 2))
    with tempfile.TemporaryDirectory() as d:
        for label, data, precision, workers in rows:
            part.attempt(label, partial(check, part, data, precision, workers, Path(d)),
                         cpu_status="skipped: no CUDA (the same run, the arming a no-op)")

if __name__ == "__main__":
    main()
