"""The run: everything the loop touches, built once by ``engine/build.py``; and ``RunView``, the
small, documented part of it that callbacks see."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ironloop.config import Config
from ironloop.data.loader import EpochSampler
from ironloop.dist.world import World
from ironloop.engine.early_stop import BestTracker
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.steps import StepFn
from ironloop.engine.timing import StepTimer
from ironloop.outputs.runlog import RunLog


@dataclass
class Run:
    """Everything the loop touches, built once by ``fit``; the resumable parts have state_dicts."""

    cfg: Config
    model: nn.Module            # what the loop calls: the DDP wrapper when distributed
    raw_model: nn.Module        # the user's module: evaluation, checkpoints, export
    optimizer: torch.optim.Optimizer
    scheduler: Any
    cadence: str                # "step" or "epoch" (ReduceLROnPlateau)
    scaler: torch.amp.GradScaler | None
    step_fn: StepFn
    train_data: Any
    val_data: Any
    collate_fn: Any
    sampler: EpochSampler
    progress: Progress
    meter: Meter
    tracker: BestTracker
    log: RunLog | None          # None on ranks other than 0
    save: Callable[[bool], None]  # writes a checkpoint; the argument says "this is a new best"
    device: torch.device
    precision: str
    world: World
    steps_per_epoch: int
    total_steps: int
    check_labels: Callable[[Any], None] | None = None
    best_state: dict | None = None  # CPU copy of the best weights, kept when early stopping
    step_lr: float = 0.0            # the LR the last optimizer step used
    callbacks: list = field(default_factory=list)
    last_eval: dict = field(default_factory=dict)  # the latest evals.jsonl row
    schedule_steps: int = 0         # a finite schedule's length; past it the LR holds (0 = none)
    guard: Any = None               # guard.GuardHook, or None with guard.enabled=false
    preempt: Any = None             # engine.preempt.Preemption while the loop runs
    lag_mark: Any = None            # engine/settle.py: step and schedule at the last settle
    carry: Any = None               # carry.StatefulStep: a stateful step's state, or None
    params: list = field(default_factory=list)  # the model's parameters, listed once
    loader: Any = None              # data.loader.EpochLoader: the training batches, every epoch
    timer: StepTimer = field(default_factory=lambda: StepTimer(torch.device("cpu"), False))
    stop_requested: bool = False    # a callback called run.stop() (RunView)

    @functools.cached_property
    def view(self) -> RunView:
        """What callbacks get instead of the run itself."""
        return RunView(self)

    @property
    def finished(self) -> bool:
        return (self.progress.step >= self.total_steps or self.tracker.should_stop
                or self.stop_requested)

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        """For callbacks: one scalars.jsonl line with the current step and epoch (numbers also
        go to TensorBoard). Values must be JSON: numbers, strings, lists. Rank 0 writes."""
        if self.log is not None:
            where = {"step": self.progress.step, "epoch": self.progress.epoch + 1}
            self.log.write("scalars", {**where, **scalars, "time": time.time()})


class RunView:
    """What a callback sees of the run (the first argument of every hook). Read-only views of
    the live objects, plus ``log_scalars``:

    - ``cfg``: the run's Config;
    - ``model``: the user's module (not the DDP/FSDP/compile wrapper);
    - ``optimizer``, ``scheduler``: the live torch objects (a callback may change the LR);
    - ``step``, ``epoch``: optimizer steps taken, epochs completed;
    - ``world``: ``rank``, ``size``, ``is_main`` (callbacks run on every rank);
    - ``device``, ``precision``, ``run_dir``;
    - ``last_eval``: the latest evals.jsonl row ({} before the first evaluation);
    - ``log_scalars({name: value})``: one scalars.jsonl line at the current step;
    - ``stop()``: end the run as ``train.max_steps`` would, after this step (from
      ``on_step_end``, ``on_eval_end``) or this epoch (from ``on_epoch_end``).
    """

    __slots__ = ("_run",)

    def __init__(self, run: Run):
        self._run = run

    cfg = property(lambda self: self._run.cfg)
    model = property(lambda self: self._run.raw_model)
    optimizer = property(lambda self: self._run.optimizer)
    scheduler = property(lambda self: self._run.scheduler)
    step = property(lambda self: self._run.progress.step)
    epoch = property(lambda self: self._run.progress.epoch)
    world = property(lambda self: self._run.world)
    device = property(lambda self: self._run.device)
    precision = property(lambda self: self._run.precision)
    run_dir = property(lambda self: Path(self._run.cfg.run.dir))
    last_eval = property(lambda self: dict(self._run.last_eval))

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        self._run.log_scalars(scalars)

    def stop(self) -> None:
        """Ask the run to end: the loop finishes the current step or epoch, evaluates and
        checkpoints as at any end (mid-epoch, as ``train.max_steps`` does), and results.json
        says ``stopped_by_callback``. Not saved: a resume trains on. Under torchrun every rank
        must call it at the same step (callbacks run on every rank)."""
        self._run.stop_requested = True
