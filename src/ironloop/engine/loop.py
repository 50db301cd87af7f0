"""The training loop, in the order it runs.

The optimizer step itself is the train module's (``engine/train_module.py``); when to log,
evaluate and checkpoint is the cadence's (``engine/cadence.py``), when to settle the guard's
late verdicts ``LateSettle.due``'s (``engine/settle.py``). One optimizer step covers a
window of ``accumulation_steps`` micro-batches (fewer for the ragged last window of an epoch)::

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
    ok = guard verdict, on the device         # guard/verdict.py: no host read
    clip(parameters, grad_norm)
    optimizer.step(); scaler.update()         # a bad step is skipped inside the fused kernel
                                              # (LBFGS: step(closure), its first call the
                                              # loss above; TrainModule.closure)
    scheduler.step()                          # per-step schedules, AFTER optimizer.step
    [average.update(), when due]              # engine/average.py: EMA/SWA, on the device
    [run.settle(), when due]                  # engine/settle.py: the guard's lagged read
    (several optimizers: the step function does zero_grad to the step itself, once per
     optimizer on its own parameters, and there is no accumulation; engine/several.py)
    (train.cuda_graph: after 3 eager windows, the window's micro-batches, unscale to
     scheduler, are one CUDA graph replay; the host's bookkeeping follows it, engine/cuda_graph.py)
    [fault knobs] -> [log line] -> on_step_end
    -> [evaluate, every eval.every_steps] -> [checkpoint] -> on_checkpoint
    -> [preempted? checkpoint, events.jsonl line, raise Preempted] -> [finished?]

and at the end of each epoch: [evaluate, when eval.every_steps is 0 or, at the run's last epoch
end, when the last step was not evaluated] -> epoch line ->
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

``timer.mark(part)`` after each piece of work charges the time since the previous mark to
that part (data, copy, forward, backward, optimizer, average, other, validation; timing.py).
"""

from __future__ import annotations

import time

from ironloop.callbacks import fire
from ironloop.data.counting import check_rows, counted, rank_share
from ironloop.data.prefetch import prefetch
from ironloop.engine.evaluate import run_evaluation, timed_evaluation
from ironloop.engine.run import Run
from ironloop.engine.tokens import WindowWeight, mfu
from ironloop.guard.reporter import RolledBack
from ironloop.outputs import console
from ironloop.outputs.console import EpochProgress
from ironloop.parallel import data_parallel


def train(run: Run) -> None:
    """Run epochs until the configured epochs, max_steps or early stopping end the run.

    A run that max_steps stops mid-epoch leaves that epoch open: it checkpoints where it is,
    and a resume with a larger max_steps finishes the same epoch in the same order.

    Every epoch trains in train mode; the model then goes back to the mode it was handed over
    in (a model passed in eval mode comes back in eval mode), also when the run raises."""
    module = run.module
    handed_over_training = module.raw_model.training
    try:
        _epochs(run)
    finally:
        module.model.train(handed_over_training)


def _epochs(run: Run) -> None:
    run.meter.start_clock()  # training time starts now, not while fit() set up
    p, source = run.progress, run.data.source
    while p.epoch < run.cfg.train.epochs and not run.finished:
        try:
            train_epoch(run)
        except RolledBack:
            continue  # the guard restored an earlier state: go on from its epoch and offset
        if p.offset < source.usable:  # max_steps, mid-epoch
            end_mid_epoch(run)
            return
        end_epoch(run)


def progress_bar(run: Run) -> EpochProgress:
    """The epoch's progress display (bar and/or plain lines), on rank 0."""
    return EpochProgress(run.cfg.log, run.progress, run.plan(), run.world.is_main)


def train_epoch(run: Run) -> None:
    module, p, source, timer = run.module, run.progress, run.data.source, run.outputs.timer
    accum = run.cfg.train.accumulation_steps
    n, global_batch = source.usable, source.global_batch
    source.set_epoch(p.epoch, p.offset)  # resume = start slicing at the offset: no replay
    if module.carry is not None:
        module.carry.start_epoch(p.offset)  # a fresh state at the top of an epoch, not on resume
    bar = progress_bar(run)
    module.model.train()
    timer.start_epoch()
    if run.guard is not None:
        run.guard.begin(module, p)  # the counters are exact here
    micro = window = 0
    weights = WindowWeight()  # a step that weights its loss (tokens): the window's total
    samples_first = getattr(module.step_fn, "samples_first", False)  # the default step
    # Batches arrive on the device, the next one's copy already started (data/prefetch.py); the
    # label check runs on each host batch first, before it can become a CUDA assert.
    for batch in prefetch(source.batches(), module.device, module.check_labels,
                          ahead=source.prefetch_ahead):
        timer.mark("data")
        if micro == 0:
            n = source.usable  # a stream learns its end a window ahead (data/stream.py)
            window = min(global_batch * accum, n - p.offset)  # samples in this step, all ranks
            module.zero_grad()  # set_to_none, unless a CUDA graph owns the gradients
        taken = min(global_batch, n - p.offset)  # the samples the order drew, all ranks
        # Counted by the loop, not by the batch's shape (data/counting.py): a graph's first
        # tensor has a row per node. The default step reads batch[0] as one row per sample.
        drawn = rank_share(taken, run.world.rank, run.world.size)
        if samples_first:
            check_rows(batch, drawn)
        n_micro = counted(batch, drawn)
        p.offset += taken
        last = micro == accum - 1 or p.offset >= n
        timer.mark("copy")  # near 0: the copy ran while the previous step computed
        if module.several is not None:  # the step updates each optimizer itself (several.py)
            module.several_step(batch, n_micro, p, run.meter)  # no accumulation: one batch
        else:
            loss = micro_step(run, batch, n_micro, window, last, weights) \
                if module.graph is None else module.graph.collect(batch, n_micro)  # cuda_graph
            micro += 1
            if not last:
                continue
            micro = 0
            window_step(run, batch, loss, window, weights)
        timer.mark("optimizer")
        if module.average is not None and module.average.due(p.step):
            module.average.update()  # on the device, no host read (engine/average.py)
            timer.mark("average")
        after_step(run, bar)
        bar.update(1)  # after the log line: a progress line shows this step's loss and LR
        timer.mark("other")
        if run.hooks.should_stop():  # a bool, no device sync
            _preempted(run)  # saves this step and raises Preempted
        if run.finished:  # max_steps, or early stopping at a step-path evaluation
            break
    run.settle()  # the epoch's last verdicts, before its line and its checkpoint
    bar.close()


def window_step(run: Run, batch, loss, window: int, weights: WindowWeight) -> None:
    """The optimizer step at a window's end: the train module's, or the window as one graph
    replay (train.cuda_graph, engine/cuda_graph.py)."""
    module, p = run.module, run.progress
    if module.graph is not None:
        module.graph.step(p, run.meter, run.world, window)
    else:
        weights.normalise(module.params, run.world)  # no-op unless the step weights its loss
        # LBFGS's closure recomputes this batch; None for any other optimizer
        module.optimizer_step(p, run.meter, run.world, module.closure(batch, loss))


def micro_step(run: Run, batch, n_micro: int, window: int, last: bool,
               weights: WindowWeight):
    """Forward and backward of one micro-batch, its loss scaled so that the window's
    gradients sum to the window's mean gradient. Returns the micro-batch's loss."""
    module, world, timer = run.module, run.world.size, run.outputs.timer
    accum = run.cfg.train.accumulation_steps
    # DDP/FSDP sync gradients on every backward; inside a window only the last one needs to.
    with data_parallel.micro_sync(module.model, last):
        with module.autocast():
            loss, _, weight = module.forward(module.model, batch, "training", run.progress)
        timer.mark("forward")
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
        module.backward(scaled)
    timer.mark("backward")
    run.meter.add_micro(loss, n_micro, weight)
    return loss


def after_step(run: Run, bar: EpochProgress) -> None:
    """Settle when due, then the fault knobs, the log line, on_step_end, a step-path
    evaluation and a checkpoint, as the cadence says."""
    p, cadence = run.progress, run.cadence
    if run.settle_due() and run.settle():
        return  # the guard found this step bad: it never happened, nothing to log or save
    run.hooks.at_step(p.step)
    row = log_step(run, bar) if cadence.logs(p.step) else {"step": p.step, "epoch": p.epoch + 1}
    fire(run, "on_step_end", row)
    improved = False
    if cadence.evaluates(p.step):
        improved = timed_evaluation(run)[1]
        console.say(run.world.is_main, console.eval_line(run.last_eval, cadence.total_steps))
    if cadence.saves(p.step):
        run.save(improved)


def log_step(run: Run, bar: EpochProgress) -> dict:
    """The metrics.jsonl line of a log step (a host read: log steps only)."""
    p, meter, timer = run.progress, run.meter, run.outputs.timer
    window = meter.flush_window()  # host sync: only at log steps
    timer.flush()  # reads the step timer's CUDA events: the stream is synced already
    row = {"step": p.step, "epoch": p.epoch + 1, "loss": window.pop("loss"), "lr": run.module.lr,
           **window, "time": time.time()}
    if run.cfg.profile.peak_tflops and "tokens_per_s" in row:  # model-FLOPs utilisation
        row["mfu"] = mfu(sum(q.numel() for q in run.module.params), row["tokens_per_s"],
                         run.cfg.profile.peak_tflops)
    run.outputs.write("metrics", row)
    bar.set_postfix(loss=row["loss"], lr=row["lr"], refresh=False)  # console formats them
    grown = run.outputs.growth.check(p.step, row["loss"])  # the loss already read above: no sync
    if grown:
        console.say(run.world.is_main, grown)
    return row


def _preempted(run: Run) -> None:
    """A signal asked the run to stop (engine/preempt.py): checkpoint this step unless
    after_step just did, say so in events.jsonl, and end the run with Preempted."""
    preempt = run.hooks.preempt
    preempt.saving()  # from here a second signal kills at once; the old checkpoint stays
    p = run.progress
    saved = run.cfg.checkpoint.enabled
    # A checkpoint holds settled counters: read the guard's pending verdicts first (a host
    # read, once, on the way out). A bad latest step was taken back: save even if after_step
    # did.
    taken_back = run.settle()
    if saved and (taken_back or not run.cadence.saves(p.step)):
        run.save(False)
    checkpoints = run.outputs.checkpoints
    if saved and checkpoints is not None:
        # "saved": true only once the write is done (an async one too); a failed write raises
        # here, before the record could claim it
        checkpoints.wait()
    stop = preempt.stopped(p.step, saved)
    run.outputs.write("events", {"event": "preempted", "signal": stop.signal_name,
                                 "step": p.step, "epoch": p.epoch + 1, "saved": saved,
                                 "time": time.time()})
    raise stop


def end_mid_epoch(run: Run) -> None:
    """max_steps ended the run inside an epoch: evaluate the final weights once (unless this
    step was just evaluated), as any evaluation (evals.jsonl, on_eval_end, charged to
    validation), print it, and checkpoint where the run stands."""
    step, cadence = run.progress.step, run.cadence
    if cadence.validates and run.last_eval.get("step") != step:
        improved = timed_evaluation(run)[1]
        console.say(run.world.is_main,
                    console.eval_line(run.last_eval, cadence.total_steps, "final evaluation"))
        run.save(improved)
    elif not cadence.saves(step):
        run.save(False)


def _last_epoch(run: Run) -> bool:
    """This epoch end ends the run (train.epochs, max_steps or a callback's stop)."""
    return run.progress.epoch + 1 >= run.cfg.train.epochs or run.finished


def end_epoch(run: Run) -> None:
    """Evaluate (unless evaluations follow eval.every_steps), log the epoch, checkpoint."""
    p, meter, timer = run.progress, run.meter, run.outputs.timer
    stats = meter.flush_epoch()  # host sync, once per epoch
    lr = run.module.lr
    improved = False
    # Not timed_evaluation: the epoch's validation time starts here and is kept out of the
    # training time below, with the logging, in one piece.
    timer.mark("other")
    started = time.perf_counter()
    if run.cadence.validates and not run.cadence.eval_every:
        val, improved = run_evaluation(run)
    elif run.cadence.validates and _last_epoch(run) and run.last_eval.get("step") != p.step:
        # eval.every_steps did not land on the last step: evaluate the final weights once
        val, improved = run_evaluation(run)
        console.say(run.world.is_main, console.eval_line(
            run.last_eval, run.cadence.total_steps, "final evaluation"))
    else:  # step-path evaluations: the epoch line repeats the latest one
        val = {k: v for k, v in run.last_eval.items() if k.startswith("val_")}
    val_seconds = time.perf_counter() - started
    timer.mark("validation")
    p.epoch += 1
    p.offset = 0
    row = {"epoch": p.epoch, "step": p.step, "train_loss": stats.pop("train_loss"),
           "val_loss": val.get("val_loss"), "val_acc": val.get("val_acc"), "lr": lr,
           "seconds": stats["train_seconds"] + val_seconds, "val_seconds": val_seconds, **stats,
           **{k: v for k, v in val.items() if k not in ("val_loss", "val_acc")}}
    totals = run.guard.totals() if run.guard is not None else {}
    if totals.get("bad_steps"):  # only once there is news
        row.update(totals)
    if timer.enabled:
        row["time_split"] = timer.end_epoch()  # seconds per part; they add up to "seconds"
    run.outputs.write("epochs", row)
    console.say(run.world.is_main, console.epoch_line(row, run.plan(), run.last_eval))
    fire(run, "on_epoch_end", row)
    saving = time.perf_counter()
    # Validation and logging are not training time. Exclude them BEFORE the save: the
    # checkpoint records the training time so far.
    meter.exclude(saving - started)
    run.save(improved)
    meter.exclude(time.perf_counter() - saving)
