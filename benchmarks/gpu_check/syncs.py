"""Part 2, host syncs in plain steps: ``torch.cuda.set_sync_debug_mode("error")`` armed
over every plain step, in fp32, bf16 and fp16, guard and step-time split on (their defaults).

A plain step is one without a log line (every ``log.every_steps``), where ironloop promises no
host read at all; the first two steps (lazy initialisation) are left out too. The check must not
change what it measures: a callback with ``on_step_end`` makes every step a settle point (a host
read, by design: it sees exact numbers), so the mode is armed and disarmed from an optimizer
step post-hook instead. After optimizer step k, when step k is plain, it arms: step k's
scheduler step and the rest of its turn (no settle is due), the next batch's fetch and its
non_blocking copy, the forward, backward, unscale, clip, the guard's verdict, the fused
optimizer step and the timer's CUDA events all run armed; after the step of a log line, or the
last step, it disarms before that step's settle. Any host sync there raises, and the row says
where. The goal is 0.

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
    """Arms sync debug mode "error" after each plain optimizer step up to ``last`` and
    disarms after the others, from an optimizer step post-hook (no ``on_step_end``: see the
    module's docstring); counts the steps that ran armed. The epoch's end (its settle, a host
    read) follows step ``last`` and must run disarmed: ``on_epoch_end`` checks that it did,
    which a CPU can check too."""

    def __init__(self, cuda: bool, last: int):
        self.cuda, self.last, self.armed, self.checked = cuda, last, False, 0
        self.upcoming = 1  # the optimizer step that runs next
        self.handle = None

    def arm(self, on: bool) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error" if on else "default")
        self.armed = on

    def on_train_start(self, run, metrics: dict) -> None:
        self.handle = run.optimizer.register_step_post_hook(self.after_optimizer_step)

    def after_optimizer_step(self, optimizer, args, kwargs) -> None:
        step, self.upcoming = self.upcoming, self.upcoming + 1
        self.checked += self.armed  # step ran armed from its batch's fetch to its update
        # Armed through the rest of a plain step's turn (its settle is not due) and into the
        # next step; a log step's (or the last step's) settle reads the verdicts: disarmed.
        self.arm(1 < step < self.last and step % LOG_EVERY != 0)

    def on_epoch_end(self, run, metrics: dict) -> None:
        if self.armed:
            raise RuntimeError("the epoch's end ran armed: the check would blame its settle")

    def on_train_end(self, run, metrics: dict) -> None:
        self.arm(False)
        if self.handle is not None:
            self.handle.remove()


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
