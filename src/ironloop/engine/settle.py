"""Settling the guard's late verdicts, so that the step count and the LR schedule stay exact.

The guard judges every step on the device and applies its verdict there (``guard/verdict.py``):
a bad step changes no weight and no optimizer state, and nobody reads the verdict. The host goes
on as if the step were good: ``progress.step``, the meter's counts and a per-step scheduler all
advance. ``settle`` reads the verdicts of the steps since the last settle (one host read) and,
when some were bad, puts the host's counters where a guard that read every step would have
them:

- ``progress.step`` goes back by the bad steps (the guard has already put the meter right);
- the scheduler is put back to its state at the last settle and stepped once per good step,
  with the same hold at the end of a finite schedule as ``optimizer_step``. This is the
  save/restore choice: no step counter on the device, because torch schedulers compute on the
  host and a device LR would need the optimizer's tensor-LR path everywhere.

``LateSettle.due`` says when: before anything that needs exact numbers (a log line, an
evaluation, a checkpoint, the end of the run, a fault knob's step, the epoch end), on every step
when a callback has ``on_step_end`` or a fault knob poisons steps, and at once after a step the
host already knows is bad (an optimizer without ``found_inf`` reads its verdict before
``step()``). ``GuardReporter.settle`` (guard/reporter.py) reads the verdicts and acts on the bad
ones; ``LateSettle.settle`` here puts the host's counters right. This module is the one place
that knows the host's counters run ahead of the verdicts: the loop asks ``Run.settle`` and
``LateSettle.due``, the optimizer step counts every step, and nothing else re-derives it.

The largest lag is therefore ``log.every_steps`` optimizer steps (fewer with checkpoints or
evaluations more often). What the lag changes, and only after a bad step until its settle:

- those steps use the LR one schedule position later per bad step (for warmup-cosine over T
  steps, a relative change of about 1/T); from the settle on, the schedule is exact again;
- a rollback after ``guard.max_bad_steps`` bad steps in a row happens at the settle, up to
  ``log.every_steps - 1`` steps later; it restores the same checkpoint, so those steps are
  simply redone.

Settles happen at the same steps in an uninterrupted and a resumed run (every checkpoint is a
settle point), so a resume after a guarded skip is still bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from ironloop.data.source import BatchSource
from ironloop.engine.cadence import Cadence
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.train_module import TrainModule
from ironloop.guard.reporter import GuardReporter
from ironloop.parallel.world import World
from ironloop.state.resume import Stateful


@dataclass
class Mark:
    """Where the step count and the schedule stood at the last settle."""

    step: int
    schedule: dict | None  # the scheduler's state_dict, for a per-step scheduler
    lrs: list              # the param groups' LRs (load_state_dict does not restore them)


class LateSettle:
    """The guard as the run holds it: its reporter (guard/reporter.py) and the mark of the last
    settle, from which a settle puts the host's counters where a guard that read every step
    would have them."""

    def __init__(self, reporter: GuardReporter):
        self.reporter = reporter
        self.mark: Mark | None = None

    def begin(self, module: TrainModule, progress: Progress) -> None:
        """The counters are exact here (the top of an epoch, after any restore)."""
        self.mark = _mark(module, progress)

    def due(self, step: int, cadence: Cadence) -> bool:
        """Whether the step just counted needs settled numbers before the loop goes on: before
        a log line, an evaluation, a checkpoint, a fault knob's step and the end of the run; at
        every step when the reporter says so (a callback's on_step_end, a known bad step)."""
        return self.reporter.verdicts.eager or step >= cadence.total_steps or \
            cadence.logs(step) or cadence.saves(step) or step in cadence.fault_steps

    def settle(self, module: TrainModule, progress: Progress, meter: Meter, data: BatchSource,
               world: World, owner: Stateful) -> bool:
        """Read the pending verdicts; correct the step count and the schedule. Returns whether
        the latest step was bad (then it never happened: nothing to log or save for it). May
        raise the guard's RolledBack (``owner``, the run, restored) or GuardStop."""
        # host read of the pending verdicts (settle points only)
        attempts, bad = self.reporter.settle(meter, progress, data, module.raw_model, world,
                                             owner)
        if bad and self.mark is not None:
            since, good = self.mark, attempts - len(bad)
            if since.schedule is not None:
                _replay_schedule(module, progress, since, good)
            progress.step = since.step + good
        self.mark = _mark(module, progress)
        return bool(bad) and bad[-1] == attempts - 1

    @property
    def taken_back(self) -> int:
        """Bad steps taken back in this process (the time table counts them apart)."""
        return self.reporter.taken_back

    def load_state_dict(self, state: dict | None) -> None:
        """The guard's state from a checkpoint (None: from before the guard)."""
        self.reporter.load_state_dict(state)

    def totals(self) -> dict:
        """The guard's counts for epochs.jsonl and results.json."""
        return self.reporter.policy.totals()

    def close(self) -> None:
        self.reporter.close()


def _mark(module: TrainModule, progress: Progress) -> Mark:
    stepping = module.scheduler is not None and module.schedule_on == "step"
    return Mark(progress.step,
                module.scheduler.state_dict() if stepping and module.scheduler else None,
                [g["lr"] for g in module.optimizer.param_groups] if stepping else [])


def _replay_schedule(module: TrainModule, progress: Progress, since: Mark, good: int) -> None:
    """The scheduler as a guard that read every step would have left it: back to the last
    settle, then one step per good optimizer step (deterministic host work, bad path only)."""
    if module.scheduler is None or since.schedule is None:
        return
    module.scheduler.load_state_dict(since.schedule)
    for group, lr in zip(module.optimizer.param_groups, since.lrs):
        group["lr"] = lr
    progress.step = since.step
    for _ in range(good):
        module.lr = float(module.optimizer.param_groups[0]["lr"]) * module.lr_factor
        module.step_schedule(progress.step)
        progress.step += 1
