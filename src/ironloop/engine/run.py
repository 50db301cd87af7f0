"""The run: a few typed parts, each built completely in one place (``engine/build.py``) and
handed to the code that needs it; and ``RunView``, the small, documented part of it that
callbacks see.

    cfg        the one Config, from start to end (config.yaml and every checkpoint hold it)
    world      rank, size, the process group
    data       the training BatchSource and the evaluation splits (data/source.py)
    step       model, optimizer, schedule, scaler, step function: the optimizer step
    counters   progress, meter, best tracker, latest evaluation, the run's plan
    state      what a checkpoint holds, collected and put back
    outputs    the run log, the checkpoint manager, the step timer
    guard      the guard's reporting side (its device half is in ``step``), or None
    cadence    log / evaluate / checkpoint / settle now?
    faults     the fault knobs' injector
    callbacks  the user's callbacks
    preempt    SIGTERM/SIGINT/SIGUSR1 handling while the loop runs
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ironloop.callbacks import Callback, callbacks_state, fire, load_callbacks_state
from ironloop.config import Config
from ironloop.data.source import BatchSource, RunData
from ironloop.dist.world import World, gather_objects
from ironloop.engine.cadence import Cadence
from ironloop.engine.preempt import Preemption
from ironloop.engine.progress import Counters
from ironloop.engine.timing import StepTimer
from ironloop.engine.trainstep import TrainStep
from ironloop.guard.faults import Faults
from ironloop.guard.hook import GuardHook
from ironloop.outputs import console
from ironloop.outputs.runlog import RunLog
from ironloop.state import dcp as sharded
from ironloop.state.manager import CheckpointManager
from ironloop.state.resume import collect_state, rank_meter, restore_rng, restore_state


@dataclass
class RunState:
    """What a checkpoint holds, collected from the parts and put back into them. The guard's
    state and the trackers' ids are added by ``Run.save`` (a rollback keeps its own)."""

    cfg: Config
    step: TrainStep
    counters: Counters
    source: BatchSource
    world: World
    callbacks: list[Callback]

    def collect(self, **more: Any) -> dict:
        s, c = self.step, self.counters
        p = c.progress
        return collect_state(
            self.cfg.to_dict(), s.raw_model,
            {"optimizer": s.optimizer, "scheduler": s.scheduler, "scaler": s.scaler,
             "progress": p, "meter": c.meter, "tracker": c.tracker, "carry": s.carry},
            # the drift check compares global batches across resumes
            world_size=self.world.size,
            sampler={**self.source.state_dict(), "epoch": p.epoch, "offset": p.offset},
            callbacks=callbacks_state(self.callbacks), evaluation=c.last_eval,
            schedule_steps=s.schedule_steps,  # kept when a resume extends the run
            average=s.average.state_dict() if s.average is not None else None,
            **more)

    def restore(self, state: dict, source: str) -> None:
        """Load every part; a checkpoint that does not fit gets a CheckpointError naming it."""
        s, c = self.step, self.counters
        restore_state(state, source, s.raw_model,
                      {"optimizer": s.optimizer, "scheduler": s.scheduler, "scaler": s.scaler,
                       "sampler": self.source})
        c.progress.load_state_dict(state["progress"])
        c.meter.load_state_dict(rank_meter(state["meter"], self.world.rank, self.world.size))
        c.tracker.load_state_dict(state["tracker"])
        load_callbacks_state(self.callbacks, state.get("callbacks"))
        if s.average is not None:  # none in a checkpoint from before averaging: a fresh one
            s.average.load_state_dict(state.get("average"))
        c.last_eval = state.get("evaluation") or {}
        if s.carry is not None:
            s.carry.load_state_dict(state.get("carry"))
        restore_rng(state)
        guard = state.get("guard") or {}  # absent in checkpoints from before the guard
        self.source.set_skip(guard.get("skip", []))  # honoured even with guard.enabled=false

    def plan(self) -> console.Plan:
        """The run's length, as the console counts it."""
        c, t = self.counters, self.cfg.train
        return console.Plan(c.total_steps, c.steps_per_epoch, t.epochs,
                            self.source.global_batch * t.accumulation_steps)


@dataclass
class Outputs:
    """What the run writes: rank 0's logs, the checkpoints (every rank's shards under FSDP2,
    else rank 0's files; None without checkpoints), and the step-time breakdown."""

    log: RunLog | None
    checkpoints: CheckpointManager | sharded.ShardedCheckpointManager | None
    timer: StepTimer
    last_saved: int = 0  # the step of the previous save: on disk once the next one returns


@dataclass
class Run:
    """Everything the loop touches, finished by ``build_run``; the resumable parts have
    state_dicts (``state``)."""

    cfg: Config
    world: World
    data: RunData
    step: TrainStep
    counters: Counters
    state: RunState
    outputs: Outputs
    guard: GuardHook | None
    cadence: Cadence
    faults: Faults
    callbacks: list[Callback]
    preempt: Preemption

    @functools.cached_property
    def view(self) -> RunView:
        """What callbacks get instead of the run itself."""
        return RunView(self)

    @property
    def finished(self) -> bool:
        c = self.counters
        return c.progress.step >= c.total_steps or c.tracker.should_stop or c.stop_requested

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        """For callbacks: one scalars.jsonl line with the current step and epoch (numbers also
        go to TensorBoard). Values must be JSON: numbers, strings, lists. Rank 0 writes."""
        if self.outputs.log is not None:
            p = self.counters.progress
            self.outputs.log.write("scalars", {"step": p.step, "epoch": p.epoch + 1,
                                               **scalars, "time": time.time()})

    def save(self, best: bool) -> None:
        """Write a checkpoint (one file from rank 0, or DCP shards from every rank), move the
        guard's in-memory rollback point, tell the callbacks. Charged to the 'checkpoint' part
        of the time split."""
        with self.outputs.timer.part("checkpoint"):
            self._save(best)

    def _save(self, best: bool) -> None:
        out, p, c = self.outputs, self.counters.progress, self.counters
        if self.world.distributed:  # a collective: save runs on every rank at the same step
            own = {k: v for k, v in c.meter.state_dict().items() if k != "ranks"}
            c.meter.ranks = gather_objects(own, self.world)
        manager = out.checkpoints
        if manager is not None:
            state = self.state.collect(
                loggers=out.log.ids() if out.log is not None else {},  # W&B / MLflow run ids
                guard=self.guard.state_dict() if self.guard is not None else None)
            if isinstance(manager, sharded.ShardedCheckpointManager):
                manager.save(state, self.step.raw_model, self.step.optimizer, p.step, best=best)
            else:
                manager.save(state, p.step, best=best)
            if out.log is not None:  # trackers get what a checkpoint covers
                out.log.durable(out.last_saved if manager.async_write else p.step)
                out.last_saved = p.step  # async: on disk once the next save() returns
        if self.guard is not None:
            self.guard.saved()
        if manager is not None and self.world.is_main:
            fire(self, "on_checkpoint", {"step": p.step, "epoch": p.epoch, "best": best})


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
    model = property(lambda self: self._run.step.raw_model)
    optimizer = property(lambda self: self._run.step.optimizer)
    scheduler = property(lambda self: self._run.step.scheduler)
    step = property(lambda self: self._run.counters.progress.step)
    epoch = property(lambda self: self._run.counters.progress.epoch)
    world = property(lambda self: self._run.world)
    device = property(lambda self: self._run.step.device)
    precision = property(lambda self: self._run.step.precision)
    run_dir = property(lambda self: Path(self._run.cfg.run.dir))
    last_eval = property(lambda self: dict(self._run.counters.last_eval))

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        self._run.log_scalars(scalars)

    def stop(self) -> None:
        """Ask the run to end: the loop finishes the current step or epoch, evaluates and
        checkpoints as at any end (mid-epoch, as ``train.max_steps`` does), and results.json
        says ``stopped_by_callback``. Not saved: a resume trains on. Under torchrun every rank
        must call it at the same step (callbacks run on every rank)."""
        self._run.counters.stop_requested = True
