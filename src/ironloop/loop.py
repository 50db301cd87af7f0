"""The training loop, in the order it runs.

One optimizer step covers a window of ``accumulation_steps`` micro-batches (fewer for the
ragged last window of an epoch)::

    optimizer.zero_grad(set_to_none=True)
    for each micro-batch of the window:
        with autocast:                        # fp16/bf16, or nothing for fp32
            loss = step_fn(model, batch)      # forward + loss, a mean over the micro-batch
        backward(loss * n_micro / n_window)   # exact: the window's mean gradient, ragged or not
    scaler.unscale_(optimizer)                # fp16 only; unscale BEFORE clipping
    grad_norm = clip(parameters)              # the pre-clip norm is what gets logged
    optimizer.step(); scaler.update()         # scaler.step skips the step on inf/NaN (fp16)
    scheduler.step()                          # per-step schedules, AFTER optimizer.step
    [crash knob] -> [log line] -> [checkpoint] -> [max_steps?]

and at the end of each epoch: validate (eval mode, inference_mode) -> epoch line -> plateau
scheduler step with the monitored metric -> best tracking -> checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm

from ironloop import parallel
from ironloop.config import Config
from ironloop.data.loader import (EpochSampler, EvalSampler, batch_size_of, make_loader,
                                  to_device)
from ironloop.distributed import World, sum_over_ranks
from ironloop.early_stop import BestTracker
from ironloop.errors import ConfigError, DataError
from ironloop.logs import RunLog
from ironloop.precision import autocast
from ironloop.progress import Meter, Progress

StepFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


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

    @property
    def finished(self) -> bool:
        return self.progress.step >= self.total_steps or self.tracker.should_stop


def train(run: Run) -> None:
    """Run epochs until the configured epochs, max_steps or early stopping end the run."""
    while run.progress.epoch < run.cfg.train.epochs and not run.finished:
        train_epoch(run)
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
    bar = _progress_bar(run)
    run.model.train()
    run.meter.start_epoch()
    micro = window = 0
    for batch in loader:
        if micro == 0:
            window = min(global_batch * accum, n - p.offset)  # samples in this step, all ranks
            run.optimizer.zero_grad(set_to_none=True)
        if run.check_labels is not None:
            run.check_labels(batch)  # on the host copy, before it can become a CUDA assert
        n_micro = batch_size_of(batch)
        p.offset += min(global_batch, n - p.offset)
        last = micro == accum - 1 or p.offset >= n
        batch = to_device(batch, run.device, non_blocking)
        # DDP/FSDP sync gradients on every backward; inside a window only the last one needs to.
        with parallel.micro_sync(run.model, last):
            with _autocast(run):
                loss, _ = run.step_fn(run.model, batch)
            # Weight by samples, not 1/accum: micro-batch gradients then sum to the window's
            # mean gradient, ragged last window included. DDP averages over ranks, hence * world.
            scaled = loss * (n_micro * world / window)
            (run.scaler.scale(scaled) if run.scaler else scaled).backward()
        run.meter.add_micro(loss, n_micro)
        micro += 1
        if not last:
            continue
        micro = 0
        optimizer_step(run)
        bar.update(1)
        after_step(run, bar)
        if run.progress.step >= run.total_steps:
            break
    bar.close()


def optimizer_step(run: Run) -> None:
    """unscale -> clip -> step -> scaler update -> per-step scheduler, in that order."""
    cfg, opt, scaler = run.cfg, run.optimizer, run.scaler
    skipped = None
    if scaler is not None:
        scaler.unscale_(opt)  # clipping must see the true gradients, not the scaled ones
    grad_norm, clipped = clip_gradients(run.raw_model.parameters(), cfg.clip.max_norm,
                                        cfg.clip.mode)
    if scaler is not None:
        # Read before step(): found_inf is on the device, so counting skips costs no sync.
        # (scaler.step itself syncs once to decide whether to skip: that is torch's design.)
        found = scaler._found_inf_per_device(opt)  # private, stable since torch 1.x
        skipped = torch.stack([f.to(run.device) for f in found.values()]).sum().clamp(max=1)
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    run.step_lr = float(opt.param_groups[0]["lr"])  # the LR this step used, for the logs
    if run.scheduler is not None and run.cadence == "step":
        run.scheduler.step()  # after optimizer.step, once per optimizer step
    run.progress.step += 1
    run.meter.add_step(grad_norm, clipped, skipped)


def clip_gradients(params, max_norm: float, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip in place; return the PRE-clip global L2 norm and whether clipping acted.

    Both stay on the device. ``max_norm`` 0 disables clipping but still measures the norm.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        zero = torch.zeros(())
        return zero, zero.bool()
    grads = [p.grad for p in params]
    sharded = parallel.is_sharded(grads[0])
    if mode == "norm" and max_norm > 0 and not sharded:
        norm = nn.utils.clip_grad_norm_(params, max_norm)  # returns the pre-clip norm
        return norm, norm > max_norm
    # Under FSDP2 the grads are shards: the norm of the whole is a collective (full_tensor).
    norm = parallel.full_tensor(_total_norm(grads))
    if mode == "norm" and max_norm > 0:
        nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # clip_grad_norm_'s second half
        return norm, norm > max_norm
    if mode == "value" and max_norm > 0:
        peak = torch.stack([parallel.full_tensor(g.detach().abs().max()) for g in grads])
        clipped = peak.max() > max_norm
        nn.utils.clip_grad_value_(params, max_norm)
        return norm, clipped
    return norm, torch.zeros((), dtype=torch.bool, device=norm.device)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if hasattr(nn.utils, "get_total_norm"):  # torch >= 2.6
        return nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def after_step(run: Run, bar) -> None:
    cfg, p = run.cfg, run.progress
    if cfg.fault.crash_at_step and p.step == cfg.fault.crash_at_step:
        os._exit(1)  # the lab's fault knob: die like a preempted job, writing nothing more
    if p.step % cfg.log.every_steps == 0:
        row = run.meter.flush_window()  # host sync: only at log steps
        row = {"step": p.step, "epoch": p.epoch + 1, "loss": row.pop("loss"), "lr": run.step_lr,
               **row, "time": time.time()}
        if run.log is not None:
            run.log.write("metrics", row)
        bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", refresh=False)
    if cfg.checkpoint.every_steps and p.step % cfg.checkpoint.every_steps == 0:
        run.save(False)


def end_epoch(run: Run) -> None:
    """Validate, log the epoch, step plateau, track the best, checkpoint."""
    cfg, p = run.cfg, run.progress
    stats = run.meter.flush_epoch()  # host sync, once per epoch
    started = time.perf_counter()
    lr = run.step_lr
    val = {f"val_{k}": v for k, v in evaluate(run, run.val_data).items()} if run.val_data else {}
    val_seconds = time.perf_counter() - started
    improved = False
    metric = cfg.early_stop.metric
    if val:
        if metric not in val:
            raise ConfigError(f"early_stop.metric={metric!r}: this run reports "
                              f"{', '.join(val)}; monitor one of those")
        improved = run.tracker.update(val[metric], p.epoch)
        if improved and cfg.early_stop.patience > 0:
            run.best_state = {k: v.detach().to("cpu", copy=True)
                              for k, v in run.raw_model.state_dict().items()}
        if run.scheduler is not None and run.cadence == "epoch":
            run.scheduler.step(val[metric])  # ReduceLROnPlateau: once per epoch, with the metric
    p.epoch += 1
    p.offset = 0
    row = {"epoch": p.epoch, "step": p.step, "train_loss": stats.pop("train_loss"),
           "val_loss": val.get("val_loss"), "val_acc": val.get("val_acc"), "lr": lr,
           "seconds": stats["train_seconds"] + val_seconds, "val_seconds": val_seconds, **stats,
           **{k: v for k, v in val.items() if k not in ("val_loss", "val_acc")}}
    if run.log is not None:
        run.log.write("epochs", row)
        _print(run, _epoch_line(row, cfg.train.epochs))
    run.save(improved)
    run.meter.exclude(time.perf_counter() - started)


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
            loss, metrics = run.step_fn(model, batch)
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


def classification_step(loss_fn) -> StepFn:
    """The default step for ``(inputs, targets)`` batches: loss, and accuracy when evaluating."""

    def step(model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x, y = batch[0], batch[1]
        out = model(x)
        loss = loss_fn(out, y)
        if model.training or y.is_floating_point() or out.ndim != 2:
            return loss, {}
        return loss, {"acc": (out.argmax(-1) == y).float().mean()}

    return step


def label_checker(num_classes: int) -> Callable[[Any], None]:
    """Reject class labels outside [0, C) on the host, with a message instead of a CUDA assert."""

    def check(batch) -> None:
        y = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.device.type != "cpu":
            return
        lo, hi = int(y.min()), int(y.max())  # host tensors: no device sync
        if lo < 0 or hi >= num_classes:
            raise DataError(f"labels must be class indices in [0, {num_classes}), found a batch "
                            f"with labels in [{lo}, {hi}]; fix the targets or the number of "
                            f"classes (the model's output size)")

    return check


def _autocast(run: Run):
    return autocast(run.precision, run.device)


def _progress_bar(run: Run):
    mode = run.cfg.log.progress
    show = run.world.is_main and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
    done = run.progress.offset // (run.sampler.global_batch * run.cfg.train.accumulation_steps)
    return tqdm(total=run.steps_per_epoch, initial=done, disable=not show, leave=False,
                desc=f"epoch {run.progress.epoch + 1}/{run.cfg.train.epochs}", unit="step",
                dynamic_ncols=True)


def _print(run: Run, line: str) -> None:
    if run.world.is_main:
        tqdm.write(line)


def _epoch_line(row: dict, epochs: int) -> str:
    parts = [f"epoch {row['epoch']}/{epochs}", f"step {row['step']}",
             f"train_loss {row['train_loss']:.4f}"]
    if row.get("val_loss") is not None:
        parts.append(f"val_loss {row['val_loss']:.4f}")
    if row.get("val_acc") is not None:
        parts.append(f"val_acc {100 * row['val_acc']:.2f}%")
    parts += [f"lr {row['lr']:.2e}", f"{row['seconds']:.1f}s",
              f"{row['samples_per_s']:.0f} samples/s"]
    if row.get("clipped_frac"):
        parts.append(f"clipped {100 * row['clipped_frac']:.0f}%")
    if row.get("skipped"):
        parts.append(f"fp16-skipped {row['skipped']}")
    return "  ".join(parts)

