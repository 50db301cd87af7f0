"""The fault knobs (``fault.*``), behind one injector: the only module that reads them.

The loop calls ``Faults`` at named points and otherwise reads as production code:

- ``poison``: the training split with ``fault.nan_sample``'s input set to NaN every time it is
  read (a bad sample, for the guard's skip list);
- ``wrap_step``: the training step whose loss is NaN at ``fault.nan_at_step``'s steps (a
  transient fault, for the guard's skip), each listed step once per run; ``injected`` tells
  the guard which of its bad steps the knob made;
- ``at_step``: ``fault.crash_at_step`` dies like a preempted job, writing nothing more (the
  lab's crash); ``fault.oom_at_step`` raises an out-of-memory error;
- ``steps``: the steps where the injector acts, which the loop must reach with settled numbers.

Each acts where real faults come from, so the loop sees them as it would see the real thing.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

from ironloop.config import FaultConfig
from ironloop.data.loader import TensorData
from ironloop.errors import ConfigError


class _Position(Protocol):
    step: int  # optimizer steps done


class _Streak(Protocol):
    consecutive: int  # bad steps in a row (guard/decide.py)


class Faults:
    """The injector: ``Faults(cfg.fault)``."""

    def __init__(self, cfg: FaultConfig):
        self.crash_at, self.oom_at = cfg.crash_at_step, cfg.oom_at_step
        self.nan_steps, self.nan_sample = set(cfg.nan_at_step or ()), cfg.nan_sample
        self.steps = frozenset(s for s in (self.crash_at, self.oom_at) if s)
        self.poisoned: PoisonLoss | None = None  # the wrapped step, once wrap_step made it

    @property
    def poisons_steps(self) -> bool:
        """Whether some steps' losses are poisoned (the guard then settles every step)."""
        return bool(self.nan_steps)

    def poison(self, dataset):
        """The training split, with ``fault.nan_sample``'s input NaN (unchanged when -1)."""
        return poison_sample(dataset, self.nan_sample)

    def wrap_step(self, step_fn, progress: _Position, streak: _Streak | None):
        """The training step as the loop calls it: poisoned at ``fault.nan_at_step``."""
        if not self.nan_steps:
            return step_fn
        self.poisoned = PoisonLoss(step_fn, self.nan_steps, progress, streak)
        return self.poisoned

    def injected(self, listed: int) -> bool:
        """Whether ``fault.nan_at_step``'s step ``listed`` has fired: the guard names the
        knob, not the model, as the cause of that bad step."""
        return self.poisoned is not None and listed in self.poisoned.fired

    def at_step(self, step: int) -> None:
        """After the optimizer step ``step`` is counted (and settled)."""
        if step == self.crash_at:
            os._exit(1)  # the lab's fault knob: die like a preempted job, writing nothing more
        if step == self.oom_at:
            raise torch.OutOfMemoryError(f"injected by fault.oom_at_step={step}")


class PoisonLoss:
    """Wraps a step function: the training loss of the FIRST attempt at each listed optimizer
    step is NaN (a transient fault). The guard skips that attempt; the retry of the same step
    number, on the next window, is clean. Each listed step fires once per run: a rollback's
    replay of the steps before it is clean (``fired`` lives here, outside the run's state that
    the rollback puts back), so one listed incident costs at most one rollback.

    A bad attempt is not a step, so the k-th bad attempt in a row at step n stands for step
    n + k: a run of consecutive numbers ([20, 21, 22]) gives that many bad steps in a row (the
    guard's rollback), as a user listing them expects."""

    def __init__(self, step_fn, steps: set[int], progress: _Position, streak: _Streak | None):
        self.step_fn, self.steps, self.progress, self.streak = step_fn, steps, progress, streak
        self.fired: set[int] = set()  # listed numbers spent in this process

    def __call__(self, model, batch):
        loss, *rest = self.step_fn(model, batch)  # (loss, metrics[, weight])
        if not model.training:
            return loss, *rest
        streak = 0 if self.streak is None else self.streak.consecutive
        at = self.progress.step + 1 + streak
        if at in self.steps and at not in self.fired:
            self.fired.add(at)
            loss = loss * float("nan")
        return (loss, *rest)


def poison_sample(dataset: Dataset, index: int) -> Dataset:
    """``dataset`` with sample ``index``'s input set to NaN (``index`` < 0: unchanged)."""
    if index < 0:
        return dataset
    if not hasattr(dataset, "__len__"):  # a stream (data/stream.py): no sample has an index
        raise ConfigError(f"fault.nan_sample={index} needs a map-style training split; this "
                          f"one is a stream: use fault.nan_at_step instead")
    if index >= len(dataset):
        raise ConfigError(f"fault.nan_sample={index}: the training split has {len(dataset)} "
                          f"samples; pick an index below that")
    if isinstance(dataset, TensorData):  # keep the one-slice batching of in-memory data
        if not dataset.x.is_floating_point():
            raise ConfigError(f"fault.nan_sample={index}: the inputs are {dataset.x.dtype}, "
                              f"which cannot hold a NaN; use fault.nan_at_step instead")
        x = dataset.x.clone()
        x[index] = float("nan")
        return TensorData(x, dataset.y)
    return _PoisonedSample(dataset, index)


class _PoisonedSample(Dataset):
    def __init__(self, dataset: Any, index: int):
        self.dataset, self.index = dataset, index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        sample = self.dataset[i]
        if i != self.index:
            return sample
        if isinstance(sample, (tuple, list)):
            return type(sample)([sample[0].float() * float("nan"), *sample[1:]])
        return sample.float() * float("nan")
