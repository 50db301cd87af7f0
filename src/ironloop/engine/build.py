"""Building a run: the step, the wrapped model, the sampler, the optimizer and schedule, the
guard and timer (``build_run``, in memory); then its outputs (``open_outputs``,
``open_sharded``) and the one ``run.save`` (``wire_save``). fit() calls these in order."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

from ironloop.callbacks import HOOKS, fire
from ironloop.config import Config
from ironloop.data.lm import check_order
from ironloop.data.loader import EpochLoader, EpochSampler, TensorData
from ironloop.data.samplers import order_of
from ironloop.data.stream import Stream, build_order, first_sample
from ironloop.dist import parallel
from ironloop.dist.world import World, all_reduce_sum, gather_objects
from ironloop.dist.wrap import checkpoint_activations, compile_model
from ironloop.engine import carry, steps
from ironloop.engine.early_stop import BestTracker
from ironloop.engine.optim import Loss, resolve_optimizer, resolve_scheduler
from ironloop.engine.precision import grad_scaler
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.run import Run
from ironloop.engine.timing import StepTimer
from ironloop.errors import UserError
from ironloop.guard.faults import PoisonLoss
from ironloop.guard.hook import GuardHook
from ironloop.outputs import console, loggers
from ironloop.outputs.runlog import RunLog
from ironloop.specs import import_spec
from ironloop.state import dcp as sharded
from ironloop.state import drift
from ironloop.state.manager import CheckpointManager
from ironloop.state.resume import collect_state


def build_run(cfg: Config, model: nn.Module, data, device, world: World, precision,
               loss_fn, step_fn, num_classes, optimizer, scheduler, callbacks):
    """Everything the loop needs, in memory: the step, the wrapped model, the sampler, the
    optimizer and schedule, the guard and timer. Writes nothing to disk. Returns (run,
    strategy)."""
    raw_model, check_labels = model, None
    if step_fn is None and cfg.train.step_fn:
        step_fn = steps.named_step(cfg.train.step_fn)
    if step_fn is steps.lm_step and not cfg.eval.perplexity:
        cfg = cfg.with_overrides({"eval.perplexity": True})  # on by default for the LM step
    if step_fn is None:
        step_fn, check_labels = classification(cfg, model, device, loss_fn, num_classes,
                                                (data.train, data.val, data.test))
    step_fn, stateful = carry.stateful(step_fn, device, cfg.train.carry_reset)
    if cfg.train.activation_checkpointing:
        checkpoint_activations(raw_model, cfg.train.activation_checkpointing)
    model, strategy = parallel.wrap(raw_model, cfg, world, device, precision)
    if cfg.train.compile:
        model = compile_model(model, cfg.train.compile_mode)  # raw_model stays uncompiled
    _warn_batchnorm(raw_model, cfg, world)

    if isinstance(data.train, Stream):  # an IterableDataset: read in order (data/stream.py)
        sampler, steps_per_epoch = build_order(cfg, data.train, world.rank, world.size, device)
    else:
        order, warning = order_of(data.sampler, len(data.train), cfg.run.seed, cfg.data.shuffle)
        if warning and world.is_main:
            print(warning)
        sampler = EpochSampler(len(data.train), cfg.train.batch_size, cfg.run.seed,
                               shuffle=cfg.data.shuffle, rank=world.rank, world_size=world.size,
                               order=order)
        check_order(data.train, cfg.data.shuffle, sampler.global_batch)
        steps_per_epoch = math.ceil(sampler.usable / (sampler.global_batch
                                                      * cfg.train.accumulation_steps))
        _warn_batch_size(cfg, len(data.train), world)
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    optimizer = resolve_optimizer(optimizer, raw_model, cfg.optim)
    scheduler, cadence = resolve_scheduler(scheduler, optimizer, cfg.schedule, steps_per_epoch,
                                           total_steps)
    run = Run(
        cfg=cfg, model=model, raw_model=raw_model, optimizer=optimizer, scheduler=scheduler,
        cadence=cadence, scaler=grad_scaler(precision, device), step_fn=step_fn,
        train_data=data.train, val_data=data.val, collate_fn=data.collate_fn, sampler=sampler,
        progress=Progress(), meter=Meter(device, reduce=lambda t: all_reduce_sum(t, world)),
        tracker=BestTracker(cfg.early_stop.resolved_mode, cfg.early_stop.patience,
                            cfg.early_stop.min_delta),
        log=None, save=lambda best: None, device=device, precision=precision, world=world,
        steps_per_epoch=steps_per_epoch, total_steps=total_steps, check_labels=check_labels,
        callbacks=check_callbacks(callbacks))
    # After parallel.wrap: FSDP2 has replaced them with their sharded DTensors by now. All of
    # them, not only those requiring grad: a callback may unfreeze a layer later.
    run.params = list(raw_model.parameters())
    run.loader = EpochLoader(data.train, sampler, num_workers=cfg.data.num_workers,
                             pin_memory=cfg.data.pin_memory and device.type == "cuda",
                             collate_fn=data.collate_fn, seed_samples=cfg.data.seed_samples)
    run.carry = stateful  # a stateful step's state across batches (engine/carry.py), or None
    run_dir = Path(cfg.run.dir)
    run.timer = StepTimer(device, cfg.profile.breakdown, cfg.profile.sync,
                          run_dir / "trace" if cfg.profile.trace and world.is_main else None,
                          cfg.profile.trace_steps)
    if cfg.schedule.name in drift.FINITE_SCHEDULES:
        run.schedule_steps = total_steps
    if cfg.guard.enabled:
        run.guard = GuardHook(cfg.guard, run_dir, cfg.checkpoint.enabled)
    if cfg.fault.nan_at_step:
        run.step_fn = PoisonLoss(run.step_fn, cfg.fault.nan_at_step)
        run.step_fn.run = run
    return run, strategy


def classification(cfg: Config, model: nn.Module, device, loss_fn, num_classes, datasets):
    """The default (inputs, targets) step, and the label check it needs (or None when every
    dataset is an in-memory tensor whose labels were checked here, once, in full)."""
    train_set = datasets[0]
    if num_classes is None:
        num_classes = infer_num_classes(model, train_set, device)
    if loss_fn is None and ":" in cfg.loss.name:
        loss_fn = import_spec(cfg.loss.name, "loss.name")
    step_fn = steps.classification_step(loss_fn or Loss(cfg.loss, num_classes))
    if not num_classes:
        return step_fn, None
    check = steps.label_checker(num_classes)
    sets = [ds for ds in datasets if ds is not None]
    if not all(isinstance(ds, TensorData) for ds in sets):
        return step_fn, check  # checked batch by batch, on the host
    for ds in sets:
        check((ds.x[:1], ds.y))
    return step_fn, None


def infer_num_classes(model: nn.Module, dataset, device) -> int | None:
    """C from one forward of one sample in eval mode; None if the output is not (1, C), or if
    the forward fails: a model whose forward takes more than the inputs (an RNN's hidden
    state) is not a classifier to infer from, and the run reports its own errors later."""
    try:
        return _num_classes(model, dataset, device)
    except Exception:  # noqa: BLE001 - a guess that may fail; never the run's error
        return None


@torch.inference_mode()
def _num_classes(model: nn.Module, dataset, device) -> int | None:
    sample = first_sample(dataset) if isinstance(dataset, Stream) else dataset[0]
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


def _warn_batch_size(cfg: Config, n: int, world: World) -> None:
    per_step = cfg.train.batch_size * world.size
    if per_step > n and world.is_main:
        print(f"warning: train.batch_size={cfg.train.batch_size}"
              + (f" x {world.size} processes" if world.size > 1 else "")
              + f" is larger than the training split ({n} samples): each epoch is a single "
              f"optimizer step; lower train.batch_size")


def check_callbacks(callbacks) -> list:
    callbacks = list(callbacks or [])
    for cb in callbacks:
        if not any(hasattr(cb, hook) for hook in HOOKS):
            raise UserError(f"callbacks: {type(cb).__name__} has none of the hooks "
                            f"{', '.join(HOOKS)}; subclass ironloop.callbacks.Callback")
    return callbacks


def open_outputs(run: Run, run_dir: Path, resume, state, source):
    """Rank 0's logs (truncated to the resumed step), the resume event, and the checkpoint
    manager. Returns the manager, or None without checkpoints."""
    cfg = run.cfg
    # Any --resume, even one that found nothing and starts fresh, drops log lines past the
    # step it continues from, so each step and each epoch is logged exactly once.
    resume_step = run.progress.step if resume else None
    ids = (state.get("loggers") or {}) if state is not None else {}
    run.log = RunLog(run_dir, False, resume_epoch=run.progress.epoch, resume_step=resume_step,
                     loggers=loggers.build(cfg, run_dir, resume_step, ids))
    if state is not None:
        run.log.catch_up(run.progress.step)  # each tracker gets the rows it does not hold yet
        event = {"event": "resume", "step": run.progress.step, "epoch": run.progress.epoch,
                 "from": source, "last_logged_step": run.log.last_logged_step,
                 # work lost to the crash: logged past the checkpoint, redone
                 "steps_redone": max(0, run.log.last_logged_step - run.progress.step),
                 "time": time.time()}
        run.log.write("events", event)
        console.say(run, console.resume_line(event, run, drift.changes(
            state.get("config") or {}, cfg.to_dict())))
    if not cfg.checkpoint.enabled or parallel.is_fsdp(run.raw_model):
        return None
    manager = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                cfg.checkpoint.async_write)
    return _discard_past_resume(manager, run)


def open_sharded(run: Run, run_dir: Path) -> sharded.ShardedCheckpointManager:
    """Under FSDP2: DCP directories, written by every rank."""
    cfg = run.cfg
    manager = sharded.ShardedCheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                               cfg.checkpoint.async_write)
    return _discard_past_resume(manager, run)


def _discard_past_resume(manager, run: Run):
    """Checkpoints past the step this run resumed from belong to a future that did not happen:
    the file and the sharded manager both drop them, saying so."""
    for path in manager.discard_after(run.progress.step):
        print(f"notice: removed {path}: it is past the step this run resumed from")
    return manager


def wire_save(run: Run, manager) -> None:
    """The one place ``run.save(best)`` is built: write the checkpoint (one file from rank 0, or
    DCP shards from every rank), move the guard's in-memory rollback point, tell the callbacks.
    All of it is charged to the 'checkpoint' part of the time split."""

    last = [run.progress.step]  # the step of the previous save

    def save(best: bool) -> None:
        if run.world.distributed:  # a collective: save runs on every rank at the same step
            own = {k: v for k, v in run.meter.state_dict().items() if k != "ranks"}
            run.meter.ranks = gather_objects(own, run.world)
        if isinstance(manager, sharded.ShardedCheckpointManager):
            manager.save(collect_state(run), run.raw_model, run.optimizer, run.progress.step,
                         best=best)
        elif manager is not None:
            manager.save(collect_state(run), run.progress.step, best=best)
        if run.log is not None and manager is not None:  # trackers get what a checkpoint covers
            run.log.durable(last[0] if manager.async_write else run.progress.step)
            last[0] = run.progress.step  # async: on disk once the next save() returns
        if run.guard is not None:
            run.guard.saved(run)
        if manager is not None and run.world.is_main:
            fire(run, "on_checkpoint", {"step": run.progress.step, "epoch": run.progress.epoch,
                                        "best": best})

    run.save = run.timer.wrap("checkpoint", save)
