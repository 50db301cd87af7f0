"""The run: the one owner of the training state, and the few typed parts the loop touches, each
built completely in one place (``engine/build.py``); and ``RunView``, the small, documented
part of it that callbacks see.

What a checkpoint holds lives on the run itself, one attribute per fact (torchtitan's
``Trainer(Stateful)``): ``progress`` (epoch, step, offset), ``meter`` (the running sums),
``tracker`` (the best metric, early stopping) and ``last_eval``. ``state_dict`` is the whole
checkpoint dict, every part's state with them; ``load_state_dict`` is the one place that puts it
back (a resume, a rollback); ``save`` hands it to the checkpointer (state/checkpointer.py);
``settle`` reads the guard's late verdicts (engine/settle.py).

    cfg        the one Config, from start to end (config.yaml and every checkpoint hold it)
    world      rank, size, the process group
    data       the training BatchSource and the evaluation splits (data/source.py)
    module     model, optimizer, schedule, scaler, step function: the optimizer step
    progress   epoch, optimizer steps done, samples of the epoch consumed
    meter      the running loss sums and counts the logs report
    tracker    the best monitored metric and early stopping's patience
    outputs    run.dir, the run log, the checkpointer, the step timer
    guard      the guard's reporter and its late settle, or None
    cadence    log / evaluate / checkpoint now? and the run's length
    hooks      the user's callbacks, signal handling, the fault knobs
    last_eval  the latest evals.jsonl row
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from ironloop.callbacks import Callback, callbacks_state, fire, load_callbacks_state
from ironloop.config import Config
from ironloop.data.source import RunData
from ironloop.engine.cadence import Cadence
from ironloop.engine.divergence import LossGrowth
from ironloop.engine.early_stop import BestTracker
from ironloop.engine.preempt import Preemption
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.settle import LateSettle
from ironloop.engine.timing import StepTimer
from ironloop.engine.train_module import TrainModule
from ironloop.guard.faults import Faults
from ironloop.outputs import console
from ironloop.outputs.runlog import RunLog
from ironloop.parallel.world import World, gather_objects
from ironloop.state.checkpointer import Checkpointer
from ironloop.state.resume import collect_state, rank_meter, restore_rng, restore_state
from ironloop.state.run_dir import RunDir


@dataclass
class Outputs:
    """What the run writes: run.dir, the checkpoints (every rank's shards under FSDP2, else
    rank 0's files), the step-time breakdown, and rank 0's logs (opened after a restore, which
    truncates them to the step it resumed)."""

    dir: RunDir
    checkpoints: Checkpointer
    timer: StepTimer
    log: RunLog | None = None
    last_saved: int = 0  # the step of the previous save: on disk once the next one returns
    growth: LossGrowth = field(default_factory=lambda: LossGrowth(0.0))  # log.loss_growth

    def write(self, kind: str, row: dict) -> None:
        """One line of ``kind``.jsonl (and the trackers'): rank 0 writes, the others do not."""
        if self.log is not None:
            self.log.write(kind, row)

    def close(self) -> None:
        """Wait for an in-flight async checkpoint write, then close the logs."""
        self.checkpoints.close()
        if self.log is not None:
            self.log.close()


@dataclass
class Hooks:
    """What reaches into the loop from outside it: the user's callbacks (and a callback's
    request to stop), the preemption signals, the fault knobs' injector."""

    callbacks: list[Callback]
    preempt: Preemption
    faults: Faults
    stop_requested: bool = False  # a callback called RunView.stop()

    def should_stop(self) -> bool:
        """Whether a signal asked the run to stop (once per optimizer step; a bool, no device
        sync; under torchrun every rank answers the same at the same step)."""
        return self.preempt.should_stop()

    def at_step(self, step: int) -> None:
        """The fault knobs' point after the optimizer step ``step`` is counted and settled."""
        self.faults.at_step(step)


@dataclass
class Run:
    """Everything the loop touches, finished by ``build_run``, and the owner of the training
    state: ``state_dict``/``load_state_dict`` are what a checkpoint collects and a resume or a
    rollback restores."""

    cfg: Config
    world: World
    data: RunData
    module: TrainModule
    progress: Progress
    meter: Meter
    tracker: BestTracker
    outputs: Outputs
    guard: LateSettle | None
    cadence: Cadence
    hooks: Hooks
    last_eval: dict = field(default_factory=dict)

    @functools.cached_property
    def view(self) -> RunView:
        """What callbacks get instead of the run itself."""
        return RunView(self)

    @property
    def finished(self) -> bool:
        return self.progress.step >= self.cadence.total_steps or self.tracker.should_stop \
            or self.hooks.stop_requested

    def plan(self) -> console.RunPlan:
        """The run's length, as the console counts it."""
        t, source = self.cfg.train, self.data.source
        return console.RunPlan(self.cadence.total_steps, source.steps_per_epoch, t.epochs,
                               source.global_batch * t.accumulation_steps, source.epoch_known)

    # ---------------------------------------------------------------- the state ------------
    def state_dict(self) -> dict:
        """The whole checkpoint dict: every part's state, the counters, the RNG, the guard's
        state and the trackers' run ids (what a resume continues)."""
        m, p, out = self.module, self.progress, self.outputs
        return collect_state(
            self.cfg.to_dict(), m.raw_model,
            {"optimizer": m.optimizer, "scheduler": m.scheduler, "scaler": m.scaler,
             "progress": p, "meter": self.meter, "tracker": self.tracker, "carry": m.carry,
             "guard": self.guard.reporter if self.guard is not None else None},
            # the drift check compares global batches across resumes
            world_size=self.world.size,
            sampler={**self.data.source.state_dict(), "epoch": p.epoch, "offset": p.offset},
            callbacks=callbacks_state(self.hooks.callbacks), evaluation=self.last_eval,
            schedule_steps=m.schedule_steps,  # kept when a resume extends the run
            average=m.average.state_dict() if m.average is not None else None,
            # the LR the last step used: an epoch line written right after a resume (preempted
            # at the epoch's last step) reports it, as the uninterrupted run's does
            lr=m.lr, loggers=out.log.ids() if out.log is not None else {},  # W&B / MLflow
            loss_growth=out.growth.state_dict())  # the divergence baseline: the run's own

    def load_state_dict(self, state: dict, source: str = "the checkpoint") -> None:
        """Load every part (a resume, a rollback); a checkpoint that does not fit gets a
        CheckpointError naming ``source``. The trackers' ids are read where the logs open
        (engine/build.py)."""
        m = self.module
        restore_state(state, source, m.raw_model,
                      {"optimizer": m.optimizer, "scheduler": m.scheduler, "scaler": m.scaler,
                       "sampler": self.data.source})
        self.progress.load_state_dict(state["progress"])
        self.meter.load_state_dict(rank_meter(state["meter"], self.world.rank, self.world.size))
        self.tracker.load_state_dict(state["tracker"])
        load_callbacks_state(self.hooks.callbacks, state.get("callbacks"))
        if m.average is not None:  # none in a checkpoint from before averaging: a fresh one
            m.average.load_state_dict(state.get("average"))
        self.last_eval = state.get("evaluation") or {}
        m.lr = state.get("lr", m.lr)  # absent in checkpoints from before it was kept
        self.outputs.growth.load_state_dict(state.get("loss_growth"))  # None: kept since #59
        if m.carry is not None:
            m.carry.load_state_dict(state.get("carry"))
        m.resume_schedule(state.get("schedule_steps"))
        restore_rng(state)
        guard = state.get("guard") or {}  # absent in checkpoints from before the guard
        if self.guard is not None:
            self.guard.load_state_dict(guard)
        self.data.source.set_skip(guard.get("skip", []))  # honoured even with guard.enabled=false

    def save(self, best: bool) -> None:
        """Write a checkpoint (one file from rank 0, or DCP shards from every rank), move the
        guard's in-memory rollback point, tell the callbacks. Charged to the 'checkpoint' part
        of the time split."""
        with self.outputs.timer.part("checkpoint"):
            self._save(best)

    def _save(self, best: bool) -> None:
        out, p, checkpoints = self.outputs, self.progress, self.outputs.checkpoints
        if self.world.distributed:  # a collective: save runs on every rank at the same step
            own = {k: v for k, v in self.meter.state_dict().items() if k != "ranks"}
            self.meter.ranks = gather_objects(own, self.world)
        if checkpoints.writes:
            checkpoints.save(self.state_dict(), p.step, best=best)
            if out.log is not None:  # trackers get what a checkpoint covers
                out.log.durable(out.last_saved if checkpoints.async_write else p.step)
                out.last_saved = p.step  # async: on disk once the next save() returns
        if self.guard is not None:
            self.guard.reporter.saved(self)
        if checkpoints.writes and self.world.is_main:
            fire(self, "on_checkpoint", {"step": p.step, "epoch": p.epoch, "best": best})

    def settle(self) -> bool:
        """Read the guard's pending verdicts and put the step count and the schedule right
        (engine/settle.py). Returns whether the latest step was bad."""
        if self.guard is None:
            return False
        return self.guard.settle(self.module, self.progress, self.meter, self.data.source,
                                 self.world, self)

    def settle_due(self) -> bool:
        """Whether the step just counted needs settled numbers before the loop goes on."""
        return self.guard is not None and self.guard.due(self.progress.step, self.cadence)

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        """For callbacks: one scalars.jsonl line with the current step and epoch (numbers also
        go to TensorBoard). Values must be JSON: numbers, strings, lists. Rank 0 writes.

        The epoch is the 1-based epoch the step belongs to: at an epoch's end (on_epoch_end,
        its checkpoint, on_train_end after it) the counter already names the next epoch, which
        has not started, so the row carries the one that ended."""
        p = self.progress
        epoch = p.epoch if p.offset == 0 and p.epoch > 0 else p.epoch + 1
        self.outputs.write("scalars", {"step": p.step, "epoch": epoch, **scalars,
                                       "time": time.time()})


class RunView:
    """What a callback sees of the run (the first argument of every hook). Read-only views of
    the live objects, plus ``log_scalars``:

    - ``cfg``: the run's Config;
    - ``model``: the user's module (not the DDP/FSDP/compile wrapper);
    - ``optimizer``, ``scheduler``: the live torch objects (a callback may change the LR);
      with several optimizers, ``optimizer[name]`` is each one (engine/several.py);
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
    model = property(lambda self: self._run.module.raw_model)
    optimizer = property(lambda self: self._run.module.optimizer)
    scheduler = property(lambda self: self._run.module.scheduler)
    step = property(lambda self: self._run.progress.step)
    epoch = property(lambda self: self._run.progress.epoch)
    world = property(lambda self: self._run.world)
    device = property(lambda self: self._run.module.device)
    precision = property(lambda self: self._run.module.precision)
    run_dir = property(lambda self: self._run.outputs.dir.path)
    last_eval = property(lambda self: dict(self._run.last_eval))

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        self._run.log_scalars(scalars)

    def stop(self) -> None:
        """Ask the run to end: the loop finishes the current step or epoch, evaluates and
        checkpoints as at any end (mid-epoch, as ``train.max_steps`` does), and results.json
        says ``stopped_by_callback``. Not saved: a resume trains on. Under torchrun every rank
        must call it at the same step (callbacks run on every rank)."""
        self._run.hooks.stop_requested = True
