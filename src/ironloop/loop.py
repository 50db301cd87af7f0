"""The training loop, in the order it runs.

One optimizer step covers a window of ``accumulation_steps`` micro-batches (fewer for the
ragged last window of an epoch)::

    optimizer.zero_grad(set_to_none=True)
    for each micro-batch of the window:
        with autocast:                        # fp16/bf16, or nothing for fp32
            loss = step_fn(model, batch)      # forward + loss, a mean over the micro-batch
        backward(loss * n_micro / n_window)   # exact: the window's mean gradient, ragged or not
    scaler.unscale_(optimizer)                # fp16 only; unscale BEFORE clipping
    grad_norm = norm(gradients)               # the pre-clip norm is what gets logged
    if the guard says bad: skip the step      # guard.py: nothing updated, not counted
    clip(parameters, grad_norm)
    optimizer.step(); scaler.update()         # scaler.step skips the step on inf/NaN (fp16)
    scheduler.step()                          # per-step schedules, AFTER optimizer.step
    [crash knob] -> [log line] -> on_step_end
    -> [evaluate, every eval.every_steps] -> [checkpoint] -> on_checkpoint -> [finished?]

and at the end of each epoch: [evaluate, when eval.every_steps is 0] -> epoch line ->
on_epoch_end -> checkpoint -> on_checkpoint.

An evaluation (``run_evaluation``, the same one from both places): validate in eval mode under
inference_mode on the val split (a fixed subset with eval.max_batches) -> best tracking and
early-stopping patience -> plateau scheduler step with the monitored metric -> evals.jsonl
line -> on_eval_end.

Callback hooks (``ironloop.callbacks``), in order over a run::

    on_train_start
    per optimizer step:  on_step_end -> [on_eval_end] -> [on_checkpoint]
    per epoch end:       [on_eval_end] -> on_epoch_end -> [on_checkpoint]
    on_train_end

``run.timer.mark(part)`` after each piece of work charges the time since the previous mark to
that part (data, copy, forward, backward, optimizer, other, validation; see timing.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ironloop import console, parallel
from ironloop.callbacks import fire
from ironloop.config import Config
from ironloop.data.loader import (EpochSampler, EvalSampler, batch_size_of, make_loader,
                                  to_device)
from ironloop.distributed import World, sum_over_ranks
from ironloop.early_stop import BestTracker
from ironloop.errors import ConfigError
from ironloop.gradients import clip_to_norm, grad_norm_of
from ironloop.guard import RolledBack, lr_scaled
from ironloop.logs import RunLog
from ironloop.precision import autocast
from ironloop.progress import Meter, Progress
from ironloop.steps import StepFn, describe
from ironloop.timing import StepTimer


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
    params: list = field(default_factory=list)  # the model's parameters, listed once
    timer: StepTimer = field(default_factory=lambda: StepTimer(torch.device("cpu"), False))

    @property
    def finished(self) -> bool:
        return self.progress.step >= self.total_steps or self.tracker.should_stop

    def log_scalars(self, scalars: dict[str, Any]) -> None:
        """For callbacks: one scalars.jsonl line with the current step and epoch (numbers also
        go to TensorBoard). Values must be JSON: numbers, strings, lists. Rank 0 writes."""
        if self.log is not None:
            where = {"step": self.progress.step, "epoch": self.progress.epoch + 1}
            self.log.write("scalars", {**where, **scalars, "time": time.time()})


def train(run: Run) -> None:
    """Run epochs until the configured epochs, max_steps or early stopping end the run.

    A run that max_steps stops mid-epoch leaves that epoch open: it checkpoints where it is,
    and a resume with a larger max_steps finishes the same epoch in the same order."""
    run.meter.start_clock()  # training time starts now, not while fit() was setting up
    while run.progress.epoch < run.cfg.train.epochs and not run.finished:
        try:
            train_epoch(run)
        except RolledBack:
            continue  # the guard restored an earlier state: go on from its epoch and offset
        if run.progress.offset < run.sampler.usable:  # stopped by max_steps, mid-epoch
            if not _saved_by_after_step(run):
                run.save(False)
            return
        end_epoch(run)


def train_epoch(run: Run) -> None:
    cfg, p, sampler = run.cfg, run.progress, run.sampler
    accum, world = cfg.train.accumulation_steps, run.world.size
    n, global_batch = sampler.usable, sampler.global_batch
    sampler.set_epoch(p.epoch, p.offset)  # resume = start slicing at the offset: no replay
    loader = make_loader(run.train_data, sampler, num_workers=cfg.data.num_workers,
                         pin_memory=cfg.data.pin_memory and run.device.type == "cuda",
                         collate_fn=run.collate_fn)
    non_blocking = run.device.type == "cuda"
    bar = console.progress_bar(run)
    run.model.train()
    run.timer.start_epoch()
    micro = window = 0
    for batch in loader:
        run.timer.mark("data")
        if micro == 0:
            window = min(global_batch * accum, n - p.offset)  # samples in this step, all ranks
            run.optimizer.zero_grad(set_to_none=True)
        if run.check_labels is not None:
            run.check_labels(batch)  # on the host copy, before it can become a CUDA assert
        n_micro = batch_size_of(batch)
        p.offset += min(global_batch, n - p.offset)
        last = micro == accum - 1 or p.offset >= n
        batch = to_device(batch, run.device, non_blocking)
        run.timer.mark("copy")
        # DDP/FSDP sync gradients on every backward; inside a window only the last one needs to.
        with parallel.micro_sync(run.model, last):
            with _autocast(run):
                loss, _ = _call_step(run, run.model, batch, "training")
            run.timer.mark("forward")
            # Weight by samples, not 1/accum: micro-batch gradients then sum to the window's
            # mean gradient, ragged last window included. DDP averages over ranks, hence * world.
            scale = n_micro * world / window
            scaled = loss if scale == 1.0 else loss * scale  # x * 1.0 is x: skip the op
            (run.scaler.scale(scaled) if run.scaler else scaled).backward()
        run.timer.mark("backward")
        run.meter.add_micro(loss, n_micro)
        micro += 1
        if not last:
            continue
        micro = 0
        stepped = optimizer_step(run)
        run.timer.mark("optimizer")
        if not stepped:
            continue  # the guard skipped it: nothing to log or save
        bar.update(1)
        after_step(run, bar)
        run.timer.mark("other")
        if run.finished:  # max_steps, or early stopping at a step-path evaluation
            break
    bar.close()


def optimizer_step(run: Run) -> bool:
    """unscale -> norm -> guard -> clip -> step -> scaler update -> per-step scheduler.
    Returns False when the guard skipped the step."""
    cfg, opt, scaler = run.cfg, run.optimizer, run.scaler
    skipped = None
    if scaler is not None:
        scaler.unscale_(opt)  # clipping must see the true gradients, not the scaled ones
        # Read before step(): found_inf is on the device, so counting skips costs no sync.
        # (scaler.step itself syncs once to decide whether to skip: that is torch's design.)
        found = scaler._found_inf_per_device(opt)  # private, stable since torch 1.x
        skipped = torch.stack([f.to(run.device) for f in found.values()]).sum().clamp(max=1)
    params = [p for p in run.params if p.grad is not None]  # no module walk per step
    grad_norm = grad_norm_of(params)
    # The guard looks before clipping: a NaN norm would make the clip turn every gradient NaN.
    if run.guard is not None and run.guard.check(run, grad_norm, skipped):
        return False  # a bad step: no update, no scheduler step, not counted (guard.py)
    clipped = clip_to_norm(params, grad_norm, cfg.clip.max_norm, cfg.clip.mode)
    with lr_scaled(opt, run.guard):  # the rollbacks' LR factor, on top of the schedule
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        run.step_lr = float(opt.param_groups[0]["lr"])  # the LR this step used, for the logs
    if run.scheduler is not None and run.cadence == "step" and _schedule_running(run):
        run.scheduler.step()  # after optimizer.step, once per optimizer step
    run.progress.step += 1
    run.meter.add_step(grad_norm, clipped, skipped)
    return True


def _schedule_running(run: Run) -> bool:
    """A run longer than its finite schedule (extended on resume) holds the LR of the schedule's
    last step: past their end, onecycle extrapolates and cosine climbs back up."""
    if not run.schedule_steps or run.total_steps <= run.schedule_steps:
        return True
    return run.progress.step < run.schedule_steps - 1


def after_step(run: Run, bar) -> None:
    cfg, p = run.cfg, run.progress
    if cfg.fault.crash_at_step and p.step == cfg.fault.crash_at_step:
        os._exit(1)  # the lab's fault knob: die like a preempted job, writing nothing more
    if cfg.fault.oom_at_step and p.step == cfg.fault.oom_at_step:
        raise torch.OutOfMemoryError(f"injected by fault.oom_at_step={p.step}")
    if p.step % cfg.log.every_steps == 0:
        row = run.meter.flush_window()  # host sync: only at log steps
        run.timer.flush()  # reads the step timer's CUDA events: the stream is synced already
        row = {"step": p.step, "epoch": p.epoch + 1, "loss": row.pop("loss"), "lr": run.step_lr,
               **row, "time": time.time()}
        if run.log is not None:
            run.log.write("metrics", row)
        bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", refresh=False)
    else:
        row = {"step": p.step, "epoch": p.epoch + 1}  # no device read off the log steps
    fire(run, "on_step_end", row)
    evaluated = improved = False
    if cfg.eval.every_steps and p.step % cfg.eval.every_steps == 0 and run.val_data:
        run.timer.mark("other")
        started = time.perf_counter()
        evaluated, improved = True, run_evaluation(run)[1]
        run.meter.exclude(time.perf_counter() - started)  # keep samples/s about training
        run.timer.mark("validation")
    # Checkpoint after an evaluation too: best.pt follows evaluations, and a resume then
    # continues from the evaluated state.
    if evaluated or (cfg.checkpoint.every_steps and p.step % cfg.checkpoint.every_steps == 0):
        run.save(improved)


def _saved_by_after_step(run: Run) -> bool:
    """Whether after_step checkpointed the current step (a checkpoint or evaluation step)."""
    cfg, step = run.cfg, run.progress.step
    every_eval = cfg.eval.every_steps if run.val_data else 0
    return any(n and step % n == 0 for n in (cfg.checkpoint.every_steps, every_eval))


def end_epoch(run: Run) -> None:
    """Evaluate (unless evaluations follow eval.every_steps), log the epoch, checkpoint."""
    cfg, p = run.cfg, run.progress
    stats = run.meter.flush_epoch()  # host sync, once per epoch
    run.timer.mark("other")
    started = time.perf_counter()
    lr = run.step_lr
    improved = False
    if run.val_data and not cfg.eval.every_steps:
        val, improved = run_evaluation(run)
    else:  # step-path evaluations: the epoch line repeats the latest one
        val = {k: v for k, v in run.last_eval.items() if k.startswith("val_")}
    val_seconds = time.perf_counter() - started
    run.timer.mark("validation")
    p.epoch += 1
    p.offset = 0
    row = {"epoch": p.epoch, "step": p.step, "train_loss": stats.pop("train_loss"),
           "val_loss": val.get("val_loss"), "val_acc": val.get("val_acc"), "lr": lr,
           "seconds": stats["train_seconds"] + val_seconds, "val_seconds": val_seconds, **stats,
           **{k: v for k, v in val.items() if k not in ("val_loss", "val_acc")}}
    if run.guard is not None and run.guard.guard.bad_steps:  # only once there is news
        row.update(run.guard.guard.totals())
    if run.timer.enabled:
        row["time_split"] = run.timer.end_epoch()  # seconds per part; they add up to "seconds"
    if run.log is not None:
        run.log.write("epochs", row)
        console.say(run, console.epoch_line(row, cfg.train.epochs))
    fire(run, "on_epoch_end", row)
    saving = time.perf_counter()
    # Validation and logging are not training time. Exclude them BEFORE the save: the
    # checkpoint records the training time so far.
    run.meter.exclude(saving - started)
    run.save(improved)
    run.meter.exclude(time.perf_counter() - saving)


def run_evaluation(run: Run) -> tuple[dict[str, float], bool]:
    """One evaluation, from the step path or an epoch end: validate, track the best (and
    early-stopping patience), step plateau, log evals.jsonl. Returns (val metrics, new best)."""
    cfg, p = run.cfg, run.progress
    started = time.perf_counter()
    val = {f"val_{k}": v for k, v in evaluate(run, run.val_data).items()}
    metric = cfg.early_stop.metric
    if metric not in val:
        raise ConfigError(f"early_stop.metric={metric!r}: this run reports "
                          f"{', '.join(val)}; monitor one of those")
    improved = run.tracker.update(val[metric], p.epoch)
    if improved and cfg.early_stop.patience > 0:
        run.best_state = {k: v.detach().to("cpu", copy=True)
                          for k, v in run.raw_model.state_dict().items()}
    if run.scheduler is not None and run.cadence == "eval":
        run.scheduler.step(val[metric])  # ReduceLROnPlateau: once per evaluation, with the metric
    row = {"step": p.step, "epoch": p.epoch + 1, **val, "lr": run.step_lr,
           "seconds": time.perf_counter() - started}
    run.last_eval = row
    if run.log is not None:
        run.log.write("evals", row)
    fire(run, "on_eval_end", row)
    return val, improved


@torch.inference_mode()
def evaluate(run: Run, dataset) -> dict[str, float]:
    """Mean loss and metrics over a dataset, in eval mode; restores the previous mode."""
    model = run.raw_model
    was_training = model.training
    model.eval()
    # Every sample exactly once over all ranks: the training sampler's tail drop is for DDP's
    # backward, and evaluation has none.
    sampler = EvalSampler(len(dataset), run.cfg.train.batch_size, run.cfg.run.seed,
                          shuffle=False, rank=run.world.rank, world_size=run.world.size)
    loader = make_loader(dataset, sampler, num_workers=run.cfg.data.num_workers,
                         pin_memory=run.cfg.data.pin_memory and run.device.type == "cuda",
                         collate_fn=run.collate_fn)
    sums, names, count, batches = None, [], 0, 0
    for batch in loader:
        if run.check_labels is not None:
            run.check_labels(batch)
        n = batch_size_of(batch)
        batch = to_device(batch, run.device, run.device.type == "cuda")
        with _autocast(run):
            loss, metrics = _call_step(run, model, batch, "evaluation")
        names = ["loss", *metrics]
        values = torch.stack([loss.float(), *(m.float() for m in metrics.values())]) * n
        sums = values if sums is None else sums + values
        count += n
        batches += 1
    _pad_forwards(run, dataset, batches)
    model.train(was_training)
    # A rank that saw no sample (fewer samples than ranks) still joins the all-reduce there.
    return sum_over_ranks(names, sums, count, run.world)


def _pad_forwards(run: Run, dataset, batches: int) -> None:
    """Under FSDP2 each forward is a collective: a rank with fewer evaluation batches runs
    discarded forwards on one sample until every rank has run as many."""
    owed = parallel.extra_forwards(run.raw_model, run.world, len(dataset),
                                   run.cfg.train.batch_size, batches)
    if owed <= 0:
        return
    one = next(iter(make_loader(dataset, EvalSampler(1, 1, 0, False), num_workers=0,
                                pin_memory=False, collate_fn=run.collate_fn)))
    one = to_device(one, run.device, False)
    for _ in range(owed):
        with _autocast(run):
            run.step_fn(run.raw_model, one)


def _call_step(run: Run, model: nn.Module, batch, where: str):
    """The step function; an exception from it (the user's code, usually) keeps its traceback
    and gains one line saying where in the run it happened and on what batch."""
    try:
        return run.step_fn(model, batch)
    except Exception as e:
        p = run.progress
        step = p.step + 1 if where == "training" else p.step  # the step being computed
        e.add_note(f"ironloop: raised in {where} at step {step}, epoch {p.epoch + 1}; "
                   f"batch: {describe(batch)}")
        raise


def _autocast(run: Run):
    return autocast(run.precision, run.device)
