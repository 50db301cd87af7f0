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

``due`` says when (``Cadence.settles``, engine/cadence.py): before anything that needs exact
numbers (a log line, an evaluation, a checkpoint, the end of the run, a fault knob's step, the
epoch end), on every step when a callback has ``on_step_end`` or a fault knob poisons steps, and
at once after a step the host already knows is bad (an optimizer without ``found_inf`` reads its
verdict before ``step()``). ``GuardHook.settle`` (guard/hook.py) reads the verdicts and acts on
the bad ones; ``settle`` here puts the host's counters right.

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

from ironloop.engine.progress import Mark
from ironloop.engine.run import Run


def mark(run: Run) -> Mark:
    step = run.step
    stepping = step.scheduler is not None and step.schedule_on == "step"
    return Mark(run.counters.progress.step,
                step.scheduler.state_dict() if stepping and step.scheduler else None,
                [g["lr"] for g in step.optimizer.param_groups] if stepping else [])


def due(run: Run) -> bool:
    """Whether the step just counted needs settled numbers before the loop goes on."""
    if run.guard is None:
        return False
    return run.guard.device.eager or run.cadence.settles(run.counters.progress.step)


def settle(run: Run) -> bool:
    """Read the pending verdicts; correct the step count and the schedule. Returns whether the
    latest step was bad (then it never happened: nothing to log or save for it). May raise the
    guard's RolledBack or GuardStop."""
    if run.guard is None:
        return False
    attempts, bad = run.guard.settle()  # host read of the pending verdicts (log steps)
    c = run.counters
    if bad and c.settled is not None:
        since = c.settled
        good = attempts - len(bad)
        if since.schedule is not None:
            _replay_schedule(run, since, good)
        c.progress.step = since.step + good
    c.settled = mark(run)
    return bool(bad) and bad[-1] == attempts - 1


def _replay_schedule(run: Run, since: Mark, good: int) -> None:
    """The scheduler as a guard that read every step would have left it: back to the last
    settle, then one step per good optimizer step (deterministic host work, bad path only)."""
    step, p = run.step, run.counters.progress
    if step.scheduler is None or since.schedule is None:
        return
    step.scheduler.load_state_dict(since.schedule)
    for group, lr in zip(step.optimizer.param_groups, since.lrs):
        group["lr"] = lr
    p.step = since.step
    for _ in range(good):
        step.lr = float(step.optimizer.param_groups[0]["lr"]) * step.lr_factor
        step.step_schedule(p.step)
        p.step += 1
