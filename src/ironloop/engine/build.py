"""Building a run, finished: the step part, the counters, the guard, the cadence; then the run
directory (refused, overwritten or resumed), the restore, and the outputs. ``build_run`` returns
a Run that needs nothing more; fit() only trains it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ironloop.callbacks import HOOKS, Callback, from_specs
from ironloop.config import Config
from ironloop.data.source import RunData
from ironloop.dist import parallel
from ironloop.dist.world import World, all_reduce_sum
from ironloop.dist.wrap import checkpoint_activations, compile_model
from ironloop.engine import carry, steps
from ironloop.engine.average import build_average
from ironloop.engine.cadence import Cadence
from ironloop.engine.early_stop import BestTracker, check_monitor
from ironloop.engine.metrics import build_metrics
from ironloop.engine.optim import Loss, resolve_optimizer, resolve_scheduler
from ironloop.engine.precision import grad_scaler
from ironloop.engine.preempt import Preemption
from ironloop.engine.progress import Counters, Meter, Progress
from ironloop.engine.run import Outputs, Run, RunState
from ironloop.engine.timing import StepTimer
from ironloop.engine.trainstep import TrainStep, check_closure
from ironloop.errors import CheckpointError, UserError
from ironloop.guard.faults import Faults
from ironloop.guard.hook import GuardHook, advice as guard_advice
from ironloop.guard.verdict import device_guard
from ironloop.outputs import console, loggers, records
from ironloop.outputs.runlog import RunLog
from ironloop.specs import import_spec
from ironloop.state import dcp as sharded, drift, remote, rundir
from ironloop.state.manager import CheckpointManager


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
              world: World, precision: str, given: Given, faults: Faults) -> tuple[Run, str]:
    """The finished run, and its parallel strategy ("ddp", "fsdp" or "none")."""
    # fit()'s own callbacks, then train.callbacks: positions key their checkpointed state
    callbacks = check_callbacks([*(given.callbacks or []), *from_specs(cfg.train.callbacks)])
    counters = _counters(cfg, data, device, world)
    guard_device = device_guard(cfg.guard, counters.meter.loss_sum.device,
                                counters.meter.loss_sum.dtype) if cfg.guard.enabled else None
    step, strategy = _step_part(cfg, model, data, device, world, precision, given, counters,
                                faults, guard_device)
    validates = data.val is not None and len(data.val) > 0
    check_monitor(cfg.early_stop.metric, _step_kind(cfg, given), cfg.eval.perplexity,
                  validates, _prefixes(data, step),
                  tuple(step.metrics.metrics) if step.metrics is not None else ())
    state = RunState(cfg, step, counters, data.source, world, callbacks)
    guard = None if guard_device is None else GuardHook(
        cfg.guard, Path(cfg.run.dir), cfg.checkpoint.enabled, guard_device,
        meter=counters.meter, progress=counters.progress, data=data.source,
        model=step.raw_model, world=world, state=state,
        accumulation=cfg.train.accumulation_steps,
        advice=guard_advice(cfg.clip.max_norm, step.precision))
    run_dir = Path(cfg.run.dir)
    used = records.used(step.raw_model, step.optimizer, step.scheduler, given.from_config,
                        data.described(), **given.user_fns)
    resumed, source = rundir.prepare_run_dir(run_dir, cfg, given.resume, given.overwrite, world,
                                             records.config_record(cfg.to_dict(), used),
                                             given.allow_config_change)
    if resumed is not None:
        _restore(state, guard, resumed, source, strategy, run_dir)
    if world.is_main:
        records.write_run_json(run_dir, records.environment(device, world.size),
                               resumed=resumed is not None)
    outputs = _outputs(cfg, state, world, strategy, given.resume, resumed, source)
    if guard is not None:
        manager = outputs.checkpoints
        guard.start(outputs.log, resumed is not None, bool(given.resume),
                    faults.poisons_steps or _watches_steps(callbacks), step.optimizer,
                    manager.wait if manager is not None else None)
    cadence = Cadence(cfg.log.every_steps, cfg.eval.every_steps if validates else 0,
                      cfg.checkpoint.every_steps, counters.total_steps, validates, faults.steps)
    preempt = Preemption(world.distributed, cfg.dist.timeout_s)
    return Run(cfg, world, data, step, counters, state, outputs, guard, cadence, faults,
               callbacks, preempt), strategy


def _step_kind(cfg: Config, given: Given) -> str:
    """'classification', 'lm' or 'user': which step computes the run's metrics."""
    if steps.is_lm(given.step_fn, cfg.train.step_fn):
        return "lm"
    return "classification" if given.step_fn is None and not cfg.train.step_fn else "user"


def _prefixes(data: RunData, step: TrainStep) -> tuple[str, ...]:
    """The metric-name prefixes evaluation reports: per validation set, then the same for the
    averaged weights (engine/evaluate.py's validation_metrics)."""
    sets = [f"{name}_" if name else "" for name in data.val_sets]
    weights = ["val_", "val_avg_"] if step.average is not None else ["val_"]
    return tuple(f"{w}{s}" for w in weights for s in sets)


def _counters(cfg: Config, data: RunData, device: torch.device, world: World) -> Counters:
    steps_per_epoch = data.source.steps_per_epoch
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    return Counters(Progress(), Meter(device, reduce=lambda t: all_reduce_sum(t, world)),
                    BestTracker(cfg.early_stop.resolved_mode, cfg.early_stop.patience,
                                cfg.early_stop.min_delta),
                    total_steps, steps_per_epoch)


def _step_part(cfg: Config, model: nn.Module, data: RunData, device: torch.device,
               world: World, precision: str, given: Given, counters: Counters, faults: Faults,
               guard) -> tuple[TrainStep, str]:
    """The step function, the wrapped model, the optimizer and schedule, the scaler."""
    raw_model, check_labels, step_fn = model, None, given.step_fn
    metrics = build_metrics(cfg.eval.metrics, given.metrics, device)
    if step_fn is None and cfg.train.step_fn:
        step_fn = steps.named_step(cfg.train.step_fn)  # 'lm' or the user's 'module:function'
    if step_fn is None:
        step_fn, check_labels = classification(cfg, model, device, given.loss_fn,
                                                given.num_classes, data, metrics is not None)
    step_fn, stateful = carry.stateful(step_fn, device, cfg.train.carry_reset)
    step_fn = faults.wrap_step(step_fn, counters.progress,
                               guard.policy if guard is not None else None)
    if cfg.train.activation_checkpointing:
        checkpoint_activations(raw_model, cfg.train.activation_checkpointing)
    average = build_average(cfg.average, raw_model)  # a copy of the module before any wrapper
    wrapped, strategy = parallel.wrap(raw_model, cfg, world, device, precision)
    if average is not None and strategy == "fsdp":
        average.shard(cfg.dist.fsdp_modules, precision)
    elif average is not None:
        average.reset()  # the weights DDP broadcast from rank 0
    if cfg.train.compile:
        wrapped = compile_model(wrapped, cfg.train.compile_mode)  # raw_model stays uncompiled
    _warn_batchnorm(raw_model, cfg, world)
    optimizer = resolve_optimizer(given.optimizer, raw_model, cfg.optim)
    check_closure(optimizer, cfg.train.accumulation_steps, precision, world,
                  stateful is not None)  # LBFGS: what its closure can honour
    scheduler, schedule_on = resolve_scheduler(given.scheduler, optimizer, cfg.schedule,
                                               counters.steps_per_epoch, counters.total_steps)
    finite = cfg.schedule.name in drift.FINITE_SCHEDULES
    return TrainStep(wrapped, raw_model, optimizer, scheduler, schedule_on,
                     grad_scaler(precision, device), step_fn, stateful, device, precision,
                     cfg.clip, counters.total_steps,
                     schedule_steps=counters.total_steps if finite else 0, guard=guard,
                     check_labels=check_labels, average=average, metrics=metrics,
                     frozen=given.optimizer is None and cfg.optim.lr == 0), strategy


def _restore(state: RunState, guard: GuardHook | None, resumed: dict, source: str,
             strategy: str, run_dir: Path) -> None:
    """Put a checkpoint back into the run: a sharded .dcp directory, or one file."""
    step = state.step
    if sharded.is_sharded(Path(source)):  # model and optimizer come from DCP, resharded
        sharded.load_sharded(Path(source), step.raw_model, step.optimizer)
        resumed = {**resumed, "model": step.raw_model.state_dict(),
                   "optimizer": step.optimizer.state_dict()}
    elif strategy == "fsdp":
        raise CheckpointError(f"{source} is a single-file checkpoint (from ddp or one "
                              f"process); dist.strategy=fsdp resumes only sharded .dcp "
                              f"checkpoints. Resume it with dist.strategy=ddp")
    state.restore(resumed, source)
    if guard is not None:
        guard.load_state_dict(resumed.get("guard"))
    state.counters.best_state = rundir.best_weights(run_dir, state.cfg)
    if step.schedule_steps:  # an extended run keeps the schedule's length (see drift.py)
        step.schedule_steps = resumed.get("schedule_steps") or step.schedule_steps
        step.hold_onecycle()


def _outputs(cfg: Config, state: RunState, world: World, strategy: str, resume,
             resumed: dict | None, source: str | None) -> Outputs:
    """Rank 0's logs (truncated to the resumed step), the resume event, the checkpoint
    manager (every rank's under FSDP2), and the step timer."""
    run_dir, progress = Path(cfg.run.dir), state.counters.progress
    log: RunLog | None = None
    manager: CheckpointManager | sharded.ShardedCheckpointManager | None = None
    if world.is_main:
        # Any --resume, even one that found nothing and starts fresh, drops log lines past the
        # step it continues from, so each step and each epoch is logged exactly once.
        ids = (resumed.get("loggers") or {}) if resumed is not None else {}
        log = RunLog(run_dir, False, resume_epoch=progress.epoch,
                     resume_step=progress.step if resume else None,
                     loggers=loggers.build(cfg, run_dir, progress.step if resume else None,
                                           ids))
        if resumed is not None:
            _resume_event(log, state, resumed, source or "")
    if cfg.checkpoint.enabled and strategy == "fsdp":
        manager = sharded.ShardedCheckpointManager(run_dir / "checkpoints",
                                                   cfg.checkpoint.keep_last,
                                                   cfg.checkpoint.async_write,
                                                   mirror=_mirror(cfg, world, progress.step))
    elif cfg.checkpoint.enabled and world.is_main and not parallel.is_fsdp(state.step.raw_model):
        manager = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                    cfg.checkpoint.async_write,
                                    mirror=_mirror(cfg, world, progress.step))
    if manager is not None:
        # Checkpoints past the step this run resumed from belong to a future that did not
        # happen: the file and the sharded manager both drop them, saying so.
        for path in manager.discard_after(progress.step):
            print(f"notice: removed {path}: it is past the step this run resumed from")
    timer = StepTimer(state.step.device, cfg.profile.breakdown, cfg.profile.sync,
                      run_dir / "trace" if cfg.profile.trace and world.is_main else None,
                      cfg.profile.trace_steps)
    return Outputs(log, manager, timer, last_saved=progress.step)


def _mirror(cfg: Config, world: World, step: int) -> remote.Mirror | None:
    """checkpoint.remote's uploader (rank 0's also mirrors the logs); rank 0 first drops
    remote checkpoints past ``step``."""
    c = cfg.checkpoint
    if not c.remote:
        return None
    mirror = remote.Mirror(remote.open_remote(c.remote, c.remote_options),
                           Path(cfg.run.dir) / "checkpoints" / remote.STAGING / f"rank{world.rank}",
                           c.keep_last, rank=world.rank, world_size=world.size,
                           retries=c.remote_retries, wait_s=c.remote_wait_s,
                           logs_from=Path(cfg.run.dir) if world.is_main else None)
    if world.is_main:
        for url in mirror.discard_after(step):
            print(f"notice: removed {url} from the remote: it is past the step this run "
                  f"resumed from")
    return mirror


def _resume_event(log: RunLog, state: RunState, resumed: dict, source: str) -> None:
    """events.jsonl's resume line and the console's: from where, what is redone, what
    changed."""
    p = state.counters.progress
    log.catch_up(p.step)  # each tracker gets the rows it does not hold yet
    event = {"event": "resume", "step": p.step, "epoch": p.epoch + 1, "from": source,
             "last_logged_step": log.last_logged_step,
             # work lost to the crash: logged past the checkpoint, redone
             "steps_redone": max(0, log.last_logged_step - p.step), "time": time.time()}
    log.write("events", event)
    changed = drift.changes(resumed.get("config") or {}, state.cfg.to_dict())
    console.say(True, console.resume_line(event, p, state.plan(), changed))


def classification(cfg: Config, model: nn.Module, device, loss_fn, num_classes,
                   data: RunData, feed_metrics: bool = False) -> tuple[Any, Any]:
    """The default (inputs, targets) step, and the label check it needs (or None when every
    dataset is an in-memory tensor whose labels were checked here, once, in full)."""
    if num_classes is None:
        num_classes = num_classes_of(model, data.first_sample, device)
    if loss_fn is None and ":" in cfg.loss.name:
        loss_fn = import_spec(cfg.loss.name, "loss.name")
    step_fn = steps.classification_step(loss_fn or Loss(cfg.loss, num_classes), feed_metrics)
    if not num_classes:
        return step_fn, None
    check = steps.label_checker(num_classes)
    if not data.in_memory():
        return step_fn, check  # checked batch by batch, on the host
    for ds in (data.train, *data.val_sets.values(), data.test):
        if ds is not None:
            check((ds.x[:1], ds.y))
    return step_fn, None


def infer_num_classes(model: nn.Module, dataset, device) -> int | None:
    """C from the first sample of a map-style dataset (see ``num_classes_of``)."""
    return num_classes_of(model, lambda: dataset[0], device)


def num_classes_of(model: nn.Module, sample: Callable[[], Any], device) -> int | None:
    """C from one forward of one sample in eval mode; None if the output is not (1, C), or if
    the forward fails: a model whose forward takes more than the inputs (an RNN's hidden
    state) is not a classifier to infer from, and the run reports its own errors later."""
    try:
        return _num_classes(model, sample(), device)
    except Exception:  # noqa: BLE001 - a guess that may fail; never the run's error
        return None


@torch.inference_mode()
def _num_classes(model: nn.Module, sample, device) -> int | None:
    if not isinstance(sample, (tuple, list)) or len(sample) < 2:
        return None
    x, y = sample[0], sample[1]
    if not isinstance(x, torch.Tensor) or (isinstance(y, torch.Tensor) and y.is_floating_point()):
        return None
    was_training = model.training
    model.eval()
    try:
        out = model(x.unsqueeze(0).to(device))
    finally:
        model.train(was_training)
    return out.shape[-1] if isinstance(out, torch.Tensor) and out.ndim == 2 else None


def _warn_batchnorm(model: nn.Module, cfg: Config, world: World) -> None:
    norms = (nn.modules.batchnorm._BatchNorm,)
    if cfg.train.accumulation_steps > 1 and world.is_main and \
            any(isinstance(m, norms) for m in model.modules()):
        print(f"warning: the model has BatchNorm and train.accumulation_steps="
              f"{cfg.train.accumulation_steps}: BatchNorm normalises each micro-batch of "
              f"{cfg.train.batch_size} separately, so accumulation is not equivalent to a "
              f"batch of {cfg.train.batch_size * cfg.train.accumulation_steps}")


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
