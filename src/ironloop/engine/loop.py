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

import torch

from ironloop.callbacks import fire
from ironloop.data.loader import batch_size_of, make_loader, to_device
from ironloop.dist import parallel
from ironloop.engine.evaluate import autocast_for, call_step, run_evaluation
from ironloop.engine.gradients import clip_to_norm, grad_norm_of
from ironloop.engine.run import Run
from ironloop.guard.hook import RolledBack, lr_scaled
from ironloop.outputs import console


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
            with autocast_for(run):
                loss, _ = call_step(run, run.model, batch, "training")
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
        console.say(run, console.eval_line(run.last_eval, run.total_steps))
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
        console.say(run, console.epoch_line(row, run))
    fire(run, "on_epoch_end", row)
    saving = time.perf_counter()
    # Validation and logging are not training time. Exclude them BEFORE the save: the
    # checkpoint records the training time so far.
    run.meter.exclude(saving - started)
    run.save(improved)
    run.meter.exclude(time.perf_counter() - saving)


