"""Building a run, finished: the train module, the counters, the guard, the cadence; then the run
directory (refused, overwritten or resumed), the restore, and the outputs. ``build_run`` returns
a Run that needs nothing more; fit() only trains it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ironloop.callbacks import HOOKS, Callback, from_specs
from ironloop.config import Config
from ironloop.data.source import RunData
from ironloop.engine import carry, cuda_graph, schedule_notes, several, step_fns
from ironloop.engine.average import build_average
from ironloop.engine.cadence import Cadence
from ironloop.engine.divergence import LossGrowth
from ironloop.engine.early_stop import BestTracker, check_monitor
from ironloop.engine.metrics import build_metrics
from ironloop.engine.optim import check_given, resolve_optimizer, resolve_scheduler
from ironloop.engine.precision import grad_scaler
from ironloop.engine.preempt import Preemption
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.run import Hooks, Outputs, Run
from ironloop.engine.settle import LateSettle
from ironloop.engine.timing import StepTimer
from ironloop.engine.train_module import TrainModule, check_closure
from ironloop.errors import UserError
from ironloop.guard.faults import Faults
from ironloop.guard.reporter import GuardReporter, advice as guard_advice
from ironloop.guard.verdict import DeviceVerdicts, device_verdicts
from ironloop.outputs import console, loggers, records
from ironloop.outputs.runlog import RunLog
from ironloop.parallel import data_parallel
from ironloop.parallel.world import World, all_reduce_sum
from ironloop.parallel.wrap import checkpoint_activations, compile_model
from ironloop.state import drift, prepare
from ironloop.state.checkpointer import Checkpointer, Found, Peeked
from ironloop.state.run_dir import TRACE, RunDir


@dataclass(frozen=True)
class Given:
    """What fit() was handed besides the model and the data (None: from the config)."""

    loss_fn: Callable | None = None
    step_fn: Callable | None = None
    num_classes: int | None = None
    optimizer: Any = None  # an Optimizer, or a factory of one (engine/optim.py)
    scheduler: Any = None  # an LR scheduler, or a factory of one
    callbacks: list | None = None
    metrics: dict | None = None  # {name: torchmetrics-style object}
    resume: bool | str | None = False
    overwrite: bool = False
    allow_config_change: bool = False
    from_config: bool = False

    @property
    def user_fns(self) -> dict:
        """The user's own functions, for config.yaml's record."""
        return {"loss_fn": self.loss_fn, "step_fn": self.step_fn}


def build_run(cfg: Config, model: nn.Module, data: RunData, device: torch.device,
              world: World, precision: str, given: Given, faults: Faults,
              peeked: Peeked | None = None) -> tuple[Run, str]:
    """The finished run, and its parallel strategy ("ddp", "fsdp" or "none"). ``peeked``: the
    resume's read of its checkpoint (``engine.fit.peek``), resumed from without a second."""
    # fit()'s own callbacks, then train.callbacks: positions key their checkpointed state
    callbacks = check_callbacks([*_as_list(given.callbacks), *from_specs(cfg.train.callbacks)])
    progress = Progress()
    meter = Meter(device, reduce=lambda t: all_reduce_sum(t, world))
    # Several optimizers: each update is guarded on its own (engine/several.py), not the step
    verdicts = device_verdicts(cfg.guard, meter.loss_sum.device, meter.loss_sum.dtype) \
        if cfg.guard.enabled and not several.wanted(given.optimizer, cfg.optim.name) else None
    module, strategy = _train_module(cfg, model, data, device, world, precision, given,
                                     progress, faults, verdicts)
    validates = data.val is not None and len(data.val) > 0
    check_monitor(cfg.early_stop.metric, step_fns.step_kind(given.step_fn, cfg.train.step_fn),
                  cfg.eval.perplexity, validates, _prefixes(data, module),
                  tuple(module.metrics.metrics) if module.metrics is not None else ())
    run_dir = RunDir(cfg.run.dir)
    guard = None if verdicts is None else LateSettle(GuardReporter(
        cfg.guard, run_dir.path, verdicts,
        from_files=cfg.checkpoint.enabled and cfg.guard.rollback_to == "checkpoint",
        accumulation=cfg.train.accumulation_steps,
        advice=guard_advice(cfg.clip.max_norm, module.precision)))
    if guard is not None:
        guard.reporter.injected = faults.injected  # names the knob as a bad step's cause
    tracker = BestTracker(cfg.early_stop.resolved_mode, cfg.early_stop.patience,
                          cfg.early_stop.min_delta)
    cadence = Cadence(cfg.log.every_steps, cfg.eval.every_steps if validates else 0,
                      cfg.checkpoint.every_steps, module.total_steps, validates,
                      faults.steps)
    hooks = Hooks(callbacks, Preemption(world.distributed, cfg.dist.timeout_s), faults)
    checkpoints = Checkpointer(run_dir, cfg.checkpoint, world, module.raw_model,
                               module.optimizer)
    outputs = Outputs(run_dir, checkpoints, _timer(cfg, run_dir, device, world),
                      # the log opens after a restore; the advice names what is on
                      growth=LossGrowth(cfg.log.loss_growth, cfg.clip.max_norm or 0.0,
                                        cfg.guard.spike_factor if guard is not None else 0.0))
    if module.several is not None:  # each update marks its own forward, backward and step
        module.several.mark = outputs.timer.mark
    run = Run(cfg=cfg, world=world, data=data, module=module, progress=progress, meter=meter,
              tracker=tracker, outputs=outputs, guard=guard, cadence=cadence, hooks=hooks)
    resumed = _prepare_run_dir(run, given, peeked)
    if resumed is not None:
        _restore(run, resumed)
        _warn_past_schedule(run)
    if world.is_main:
        records.write_run_json(run_dir.path, records.environment(device, world.size),
                               resumed=resumed is not None)
    _open_outputs(run, given.resume, resumed)
    if guard is not None:
        _start_guard(run, guard.reporter, resumed is not None, bool(given.resume))
    return run, strategy


def total_steps(cfg: Config, data: RunData) -> int:
    """The run's end: epochs x steps per epoch, or train.max_steps when sooner."""
    steps = data.source.steps_per_epoch * cfg.train.epochs
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def _prepare_run_dir(run: Run, given: Given, peeked: Peeked | None) -> Found | None:
    """run.dir refused, overwritten or resumed (state/prepare.py), with config.yaml's record."""
    m = run.module
    used = records.used(m.raw_model, m.optimizer, m.scheduler, given.from_config,
                        run.data.described(), **given.user_fns)
    return prepare.prepare_run_dir(run.outputs.checkpoints, run.cfg, given.resume,
                                   given.overwrite, run.world,
                                   records.config_record(run.cfg.to_dict(), used),
                                   given.allow_config_change, peeked)


def _start_guard(run: Run, reporter: GuardReporter, resumed: bool, requested: bool) -> None:
    """After any restore: the reporter's baseline, guard.jsonl, the snapshot; every step
    settles when a fault knob poisons steps or a callback watches them."""
    hooks = run.hooks
    reporter.verdicts.start(run.module.optimizer,
                            hooks.faults.poisons_steps or _watches_steps(hooks.callbacks))
    reporter.checkpoints = run.outputs.checkpoints  # a rollback loads through it
    reporter.start(run, run.meter, run.progress.offset, run.outputs.log, run.world,
                   (resumed, requested))


def _prefixes(data: RunData, step: TrainModule) -> tuple[str, ...]:
    """The metric-name prefixes evaluation reports: per validation set, then the same for the
    averaged weights (engine/evaluate.py's validation_metrics)."""
    sets = [f"{name}_" if name else "" for name in data.val_sets]
    weights = ["val_", "val_avg_"] if step.average is not None else ["val_"]
    return tuple(f"{w}{s}" for w in weights for s in sets)


def _train_module(cfg: Config, model: nn.Module, data: RunData, device: torch.device,
                  world: World, precision: str, given: Given, progress: Progress,
                  faults: Faults, verdicts: DeviceVerdicts | None) -> tuple[TrainModule, str]:
    """The step function, the wrapped model, the optimizer and schedule, the scaler."""
    raw_model, check_labels, step_fn = model, None, given.step_fn
    check_given(given.optimizer)  # a list of optimizers: the message, not 'not callable'
    metrics = build_metrics(cfg.eval.metrics, given.metrics, device)
    if step_fn is None and cfg.train.step_fn:
        step_fn = step_fns.named_step(cfg.train.step_fn)  # 'lm' or the user's 'module:function'
    optimizers = _several(cfg, raw_model, world, given)
    if optimizers is not None:  # the step updates each of them: step(model, batch, optimizers)
        step_fn = several.bound(step_fn, optimizers, given.optimizer is not None, cfg.optim.name)
    elif step_fn is not None and several.takes_optimizers(step_fn):
        raise UserError(f"step_fn {getattr(step_fn, '__name__', step_fn)!r} takes "
                        f"'optimizers', and the run has one optimizer; pass optimizer={{name: "
                        f"optimizer, ...}} (optim.name=module:factory), or drop the parameter")
    if step_fn is None:
        step_fn, check_labels, classes = step_fns.classification(
            cfg, model, device, given.loss_fn, given.num_classes, data, metrics is not None)
        if metrics is not None:
            metrics.check_classes(classes)  # now, not at the first evaluation an epoch later
    step_fn, stateful = carry.stateful(step_fn, device, cfg.train.carry_reset)
    step_fn = faults.wrap_step(step_fn, progress,
                               verdicts.policy if verdicts is not None else None)
    if cfg.train.activation_checkpointing:
        checkpoint_activations(raw_model, cfg.train.activation_checkpointing)
    average = build_average(cfg.average, raw_model)  # a copy of the module before any wrapper
    wrapped, strategy = data_parallel.wrap(raw_model, cfg, world, device, precision)
    if average is not None and strategy == "fsdp":
        average.shard(cfg.dist.fsdp_modules, precision)
    elif average is not None:
        average.reset()  # the weights DDP broadcast from rank 0
    if cfg.train.compile:
        wrapped = compile_model(wrapped, cfg.train.compile_mode)  # raw_model stays uncompiled
    _warn_batchnorm(raw_model, cfg, world)
    optimizer = optimizers if optimizers is not None else \
        resolve_optimizer(given.optimizer, raw_model, cfg.optim)
    check_closure(optimizer, cfg.train.accumulation_steps, precision, world,
                  stateful is not None)  # LBFGS: what its closure can honour
    steps = total_steps(cfg, data)
    scheduler, schedule_on = resolve_scheduler(given.scheduler, optimizer, cfg.schedule,
                                               data.source.steps_per_epoch, steps)
    finite = cfg.schedule.name in drift.FINITE_SCHEDULES
    module = TrainModule(
        model=wrapped, raw_model=raw_model, optimizer=optimizer, scheduler=scheduler,
        schedule_on=schedule_on, scaler=grad_scaler(precision, device), step_fn=step_fn,
        carry=stateful, device=device, precision=precision, clip=cfg.clip, total_steps=steps,
        schedule_steps=steps if finite else 0, verdicts=verdicts, check_labels=check_labels,
        average=average, metrics=metrics,
        frozen=given.optimizer is None and optimizers is None and cfg.optim.lr == 0,
        several=optimizers)
    # train.cuda_graph: refused here, before training, if the step cannot be captured
    module.graph = cuda_graph.build(cfg, module, world, module.takes_closure)
    return module, strategy


def _several(cfg: Config, model: nn.Module, world: World,
             given: Given) -> several.Optimizers | None:
    """The run's several optimizers (engine/several.py), or None for one. Built before the
    parallel wrap, which they refuse (one process): the parameters are the model's own."""
    if not several.wanted(given.optimizer, cfg.optim.name):
        return None
    several.refuse(cfg, world.size, given.scheduler is not None)
    return several.resolve(given.optimizer, model, cfg.optim, cfg.clip, cfg.guard.enabled)


def _restore(run: Run, resumed: Found) -> None:
    """Put a checkpoint back into the run, loaded by the checkpointer (a sharded one's model
    and optimizer resharded to this run's ranks); the best weights for early stopping's final
    restore."""
    checkpoints = run.outputs.checkpoints
    run.load_state_dict(checkpoints.load(resumed), resumed.source)
    if run.cfg.early_stop.patience:
        run.tracker.best_weights = checkpoints.best_weights()


def _warn_past_schedule(run: Run) -> None:
    """Before the first step: a resume that runs past the end of its finite schedule says at
    what LR those steps run (engine/schedule_notes.py)."""
    m, step = run.module, run.progress.step
    held = float(m.optimizer.param_groups[0]["lr"]) if step >= m.schedule_steps else \
        schedule_notes.end_lr(run.cfg)  # the schedule still runs to its end first
    warning = schedule_notes.extension_warning(
        run.cfg.schedule.name, m.schedule_steps, step, m.total_steps, held,
        schedule_notes.peak_lr(run.cfg))
    if warning and run.world.is_main:
        print(warning)


def _open_outputs(run: Run, resume, resumed: Found | None) -> None:
    """Rank 0's logs (truncated to the resumed step), the resume event, the checkpointer's
    writer (every rank's under FSDP2)."""
    cfg, world, progress, out = run.cfg, run.world, run.progress, run.outputs
    if world.is_main:
        # Any --resume, even one that found nothing and starts fresh, drops log lines past the
        # step it continues from, so each step and each epoch is logged exactly once.
        ids = (resumed.state.get("loggers") or {}) if resumed is not None else {}
        out.log = RunLog(out.dir.path, False, resume_epoch=progress.epoch,
                         resume_step=progress.step if resume else None,
                         loggers=loggers.build(cfg, out.dir.path,
                                               progress.step if resume else None, ids))
        # every start, at the world size and global batch it trains at; then a resume's line
        out.log.write("events", {"event": "start", "step": progress.step, **_world(run),
                                 "resumed": resumed is not None, "time": time.time()})
        if resumed is not None:
            _resume_event(run, out.log, resumed)
    out.checkpoints.open(progress.step)
    out.last_saved = progress.step


def _timer(cfg: Config, run_dir: RunDir, device: torch.device, world: World) -> StepTimer:
    return StepTimer(device, cfg.profile.breakdown, cfg.profile.sync,
                     run_dir / TRACE if cfg.profile.trace and world.is_main else None,
                     cfg.profile.trace_steps)


def _resume_event(run: Run, log: RunLog, resumed: Found) -> None:
    """events.jsonl's resume line and the console's: from where, what is redone, what
    changed."""
    p = run.progress
    log.catch_up(p.step)  # each tracker gets the rows it does not hold yet
    old = resumed.state.get("config") or {}
    before = resumed.state.get("world_size", run.world.size)
    event = {"event": "resume", "step": p.step, "epoch": p.epoch + 1, "from": resumed.source,
             "last_logged_step": log.last_logged_step,
             # work lost to the crash: logged past the checkpoint, redone
             "steps_redone": max(0, log.last_logged_step - p.step), "time": time.time(),
             "world_size_before": before,
             "accumulation_before": (old.get("train") or {}).get("accumulation_steps"),
             "global_batch_before": drift.global_window(old, before), **_world(run)}
    log.write("events", event)
    changed = drift.changes(old, run.cfg.to_dict())
    if before != run.world.size:  # the resume line says why accumulation changed
        changed = [c for c in changed if c[0] != "train.accumulation_steps"]
    console.say(True, console.resume_line(event, p, run.plan(), changed))


def _world(run: Run) -> dict:
    """The world size and the global batch this start trains at (events.jsonl)."""
    return {"world_size": run.world.size, "accumulation_steps": run.cfg.train.accumulation_steps,
            "global_batch": run.plan().window}


def _warn_batchnorm(model: nn.Module, cfg: Config, world: World) -> None:
    norms = (nn.modules.batchnorm._BatchNorm,)
    if cfg.train.accumulation_steps > 1 and world.is_main and \
            any(isinstance(m, norms) for m in model.modules()):
        print(f"warning: the model has BatchNorm and train.accumulation_steps="
              f"{cfg.train.accumulation_steps}: BatchNorm normalises each micro-batch of "
              f"{cfg.train.batch_size} separately, so accumulation is not equivalent to a "
              f"batch of {cfg.train.batch_size * cfg.train.accumulation_steps}")


def _as_list(callbacks) -> list:
    """fit()'s ``callbacks=``: a list (or tuple) of callbacks, or None."""
    if callbacks is None or isinstance(callbacks, (list, tuple)):
        return list(callbacks or [])
    single = any(hasattr(callbacks, hook) for hook in HOOKS)
    raise UserError(f"callbacks={callbacks!r:.60}: must be a list of callbacks, not "
                    f"{type(callbacks).__name__}; " +
                    ("wrap it in one: callbacks=[...]" if single else
                     "pass [MyCallback(), ...] (ironloop.callbacks.Callback subclasses)"))


def check_callbacks(callbacks) -> list[Callback]:
    callbacks = list(callbacks or [])
    for cb in callbacks:
        if not any(hasattr(cb, hook) for hook in HOOKS):
            raise UserError(f"callbacks: {type(cb).__name__} has none of the hooks "
                            f"{', '.join(HOOKS)}; subclass ironloop.callbacks.Callback")
    return callbacks


def _watches_steps(callbacks: list) -> bool:
    """A callback with its own on_step_end: it sees exact numbers every step (a settle)."""
    return any(getattr(type(cb), "on_step_end", Callback.on_step_end)
               is not Callback.on_step_end for cb in callbacks)
