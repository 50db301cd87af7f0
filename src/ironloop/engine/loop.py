"""The training loop, in the order it runs.

One optimizer step covers a window of ``accumulation_steps`` micro-batches (fewer for the
ragged last window of an epoch)::

    [a stateful step's state (carry.py) starts empty at the top of an epoch]
    optimizer.zero_grad(set_to_none=True)
    for each micro-batch of the window:
        with autocast:                        # fp16/bf16, or nothing for fp32
            loss = step_fn(model, batch)      # forward + loss, a mean over the micro-batch
        backward(loss * n_micro / n_window)   # exact: the window's mean gradient, ragged or not
                                              # (a step that returns a weight: loss * weight)
    [grads *= ranks / window weight]          # per-token steps only (tokens.py)
    scaler.unscale_(optimizer)                # fp16 only; unscale BEFORE clipping
    grad_norm = norm(gradients)               # the pre-clip norm is what gets logged
    ok = guard verdict, on the device         # guard/hook.py: no host read
    clip(parameters, grad_norm)
    optimizer.step(); scaler.update()         # a bad step is skipped inside the fused kernel
    scheduler.step()                          # per-step schedules, AFTER optimizer.step
    [settle, when due]                        # engine/settle.py: the guard's lagged read
    [crash knob] -> [log line] -> on_step_end
    -> [evaluate, every eval.every_steps] -> [checkpoint] -> on_checkpoint
    -> [preempted? checkpoint, events.jsonl line, raise Preempted] -> [finished?]

and at the end of each epoch: [evaluate, when eval.every_steps is 0] -> epoch line ->
on_epoch_end -> checkpoint -> on_checkpoint. A run that max_steps ends inside an epoch instead:
[evaluate the final weights, unless this step just was] -> checkpoint (``end_mid_epoch``).

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
from ironloop.data.loader import batch_size_of
from ironloop.data.prefetch import prefetch
from ironloop.data.stream import StreamOrder
from ironloop.dist import parallel
from ironloop.engine.evaluate import autocast_for, call_step, run_evaluation
from ironloop.engine.gradients import clip_to_norm, grad_norm_of
from ironloop.engine.run import Run
from ironloop.engine.settle import due, mark, settle, step_schedule
from ironloop.engine.tokens import WindowWeight, mfu
from ironloop.guard.hook import RolledBack, lr_scaled
from ironloop.outputs import console


def train(run: Run) -> None:
    """Run epochs until the configured epochs, max_steps or early stopping end the run.

    A run that max_steps stops mid-epoch leaves that epoch open: it checkpoints where it is,
    and a resume with a larger max_steps finishes the same epoch in the same order.

    Every epoch trains in train mode; the model then goes back to the mode it was handed over
    in (a model passed in eval mode comes back in eval mode), also when the run raises."""
    handed_over_training = run.raw_model.training
    try:
        _epochs(run)
    finally:
        run.model.train(handed_over_training)


def _epochs(run: Run) -> None:
    run.meter.start_clock()  # training time starts now, not while fit() was setting up
    while run.progress.epoch < run.cfg.train.epochs and not run.finished:
        try:
            train_epoch(run)
        except RolledBack:
            continue  # the guard restored an earlier state: go on from its epoch and offset
        if run.progress.offset < run.sampler.usable:  # stopped by max_steps, mid-epoch
            end_mid_epoch(run)
            return
        end_epoch(run)


def train_epoch(run: Run) -> None:
    cfg, p, sampler = run.cfg, run.progress, run.sampler
    accum, world = cfg.train.accumulation_steps, run.world.size
    n, global_batch = sampler.usable, sampler.global_batch
    sampler.set_epoch(p.epoch, p.offset)  # resume = start slicing at the offset: no replay
    if run.carry is not None:
        run.carry.start_epoch(p.offset)  # a fresh state at the top of an epoch, not on resume
    stream = isinstance(sampler, StreamOrder)  # a stream reads itself, from its own state
    # A map-style run has one DataLoader for the run: its workers persist across epochs.
    loader = sampler.batches() if stream else run.loader
    bar = console.progress_bar(run)
    run.model.train()
    run.timer.start_epoch()
    run.lag_mark = mark(run)
    micro = window = 0
    weights = WindowWeight()  # a step that weights its loss (tokens): the window's total
    # Batches arrive on the device, the next one's copy already started (data/prefetch.py); the
    # label check runs on each host batch first, before it can become a CUDA assert.
    for batch in prefetch(loader, run.device, run.check_labels, ahead=not stream):
        run.timer.mark("data")
        if micro == 0:
            n = sampler.usable  # a stream learns its end a window ahead (data/stream.py)
            window = min(global_batch * accum, n - p.offset)  # samples in this step, all ranks
            run.optimizer.zero_grad(set_to_none=True)
        n_micro = batch_size_of(batch)
        p.offset += min(global_batch, n - p.offset)
        last = micro == accum - 1 or p.offset >= n
        run.timer.mark("copy")  # near 0: the copy ran while the previous step computed
        # DDP/FSDP sync gradients on every backward; inside a window only the last one needs to.
        with parallel.micro_sync(run.model, last):
            with autocast_for(run):
                loss, _, weight = call_step(run, run.model, batch, "training")
            run.timer.mark("forward")
            if weight is not None and (accum > 1 or world > 1):
                # Per token: this micro-batch's sum; the window's total divides it before the
                # optimizer step (tokens.py), ragged windows and uneven ranks included.
                scaled = loss * weight
                weights.add(weight)
            else:
                # Weight by samples, not 1/accum: micro-batch gradients then sum to the window's
                # mean gradient, ragged last window included. DDP averages over ranks: * world.
                scale = n_micro * world / window
                scaled = loss if scale == 1.0 else loss * scale  # x * 1.0 is x: skip the op
            (run.scaler.scale(scaled) if run.scaler else scaled).backward()
        run.timer.mark("backward")
        run.meter.add_micro(loss, n_micro, weight)
        micro += 1
        if not last:
            continue
        micro = 0
        weights.normalise(run.params, run.world)  # no-op unless the step weights its loss
        optimizer_step(run)
        run.timer.mark("optimizer")
        bar.update(1)
        after_step(run, bar)
        run.timer.mark("other")
        if run.preempt is not None and run.preempt.should_stop():  # a bool, no device sync
            _preempted(run)  # saves this step and raises Preempted
        if run.finished:  # max_steps, or early stopping at a step-path evaluation
            break
    settle(run)  # the epoch's last verdicts, before its line and its checkpoint
    bar.close()


def optimizer_step(run: Run) -> None:
    """unscale -> norm -> guard verdict -> clip -> step -> scaler update -> per-step scheduler.
    The step is counted as good; the guard's verdict stays on the device, a bad step changes
    nothing there, and ``settle`` takes it back from the counters later (engine/settle.py)."""
    cfg, opt, scaler = run.cfg, run.optimizer, run.scaler
    skipped = None
    if scaler is not None:
        scaler.unscale_(opt)  # clipping must see the true gradients, not the scaled ones
        # Read before step(): found_inf is on the device, so counting skips costs no sync.
        found = scaler._found_inf_per_device(opt)  # private, stable since torch 1.x
        skipped = torch.stack([f.to(run.device) for f in found.values()]).sum().clamp(max=1)
    params = [p for p in run.params if p.grad is not None]  # no module walk per step
    grad_norm = grad_norm_of(params)
    # The guard looks before clipping: a NaN norm would make the clip turn every gradient NaN.
    ok = None if run.guard is None else run.guard.check(run, grad_norm, skipped)
    if ok is not None and cfg.clip.mode == "norm" and cfg.clip.max_norm > 0:
        # A bad step is not clipped: its guard.jsonl line names the parameters whose gradients
        # are non-finite, which a clip by a non-finite norm would make all of them.
        grad_norm = torch.where(ok, grad_norm, 0.0)
    clipped = clip_to_norm(params, grad_norm, cfg.clip.max_norm, cfg.clip.mode)
    with lr_scaled(opt, run.guard):  # the rollbacks' LR factor, on top of the schedule
        if run.guard is not None:
            run.guard.step(run, ok)  # skipped on the device when ok is false (guard/hook.py)
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        run.step_lr = float(opt.param_groups[0]["lr"])  # the LR this step used, for the logs
    step_schedule(run)  # after optimizer.step, once per optimizer step
    run.progress.step += 1
    run.meter.add_step(grad_norm, clipped, skipped, ok)


def after_step(run: Run, bar) -> None:
    cfg, p = run.cfg, run.progress
    if run.guard is not None and due(run) and settle(run):
        return  # the guard found this step bad: it never happened, nothing to log or save
    if cfg.fault.crash_at_step and p.step == cfg.fault.crash_at_step:
        os._exit(1)  # the lab's fault knob: die like a preempted job, writing nothing more
    if cfg.fault.oom_at_step and p.step == cfg.fault.oom_at_step:
        raise torch.OutOfMemoryError(f"injected by fault.oom_at_step={p.step}")
    if p.step % cfg.log.every_steps == 0:
        row = run.meter.flush_window()  # host sync: only at log steps
        run.timer.flush()  # reads the step timer's CUDA events: the stream is synced already
        row = {"step": p.step, "epoch": p.epoch + 1, "loss": row.pop("loss"), "lr": run.step_lr,
               **row, "time": time.time()}
        if cfg.profile.peak_tflops and "tokens_per_s" in row:  # model-FLOPs utilisation
            row["mfu"] = mfu(sum(q.numel() for q in run.params), row["tokens_per_s"],
                             cfg.profile.peak_tflops)
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


def _preempted(run: Run) -> None:
    """A signal asked the run to stop (engine/preempt.py): checkpoint this step unless
    after_step just did, say so in events.jsonl, and end the run with Preempted."""
    run.preempt.saving()  # from here a second signal kills at once; the old checkpoint stays
    saved = run.cfg.checkpoint.enabled
    # A checkpoint holds settled counters: read the guard's pending verdicts first (a host
    # read, once, on the way out). A bad latest step was taken back: save even if after_step did.
    taken_back = run.guard is not None and settle(run)
    if saved and (taken_back or not _saved_by_after_step(run)):
        run.save(False)
    stop = run.preempt.stopped(run.progress.step, saved)
    if run.log is not None:
        run.log.write("events", {"event": "preempted", "signal": stop.signal_name,
                                 "step": run.progress.step, "epoch": run.progress.epoch,
                                 "saved": saved, "time": time.time()})
    raise stop


def end_mid_epoch(run: Run) -> None:
    """max_steps ended the run inside an epoch: evaluate the final weights once (unless this
    step was just evaluated), as any evaluation (evals.jsonl, on_eval_end, charged to
    validation), print it, and checkpoint where the run stands."""
    p = run.progress
    if run.val_data and run.last_eval.get("step") != p.step:
        run.timer.mark("other")
        started = time.perf_counter()
        improved = run_evaluation(run)[1]
        run.meter.exclude(time.perf_counter() - started)
        run.timer.mark("validation")
        console.say(run, console.eval_line(run.last_eval, run.total_steps, "final evaluation"))
        run.save(improved)
    elif not _saved_by_after_step(run):
        run.save(False)


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


