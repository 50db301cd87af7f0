"""Evaluation: validate in eval mode under inference_mode, track the best, step a plateau
schedule, log evals.jsonl, fire on_eval_end. The same ``run_evaluation`` serves the step path
(``eval.every_steps``) and the epoch end."""

from __future__ import annotations

import time

import torch
from torch import nn

from ironloop.callbacks import fire
from ironloop.data.loader import EvalSampler, batch_size_of, make_loader, to_device
from ironloop.dist import parallel
from ironloop.dist.world import sum_over_ranks
from ironloop.engine.precision import autocast
from ironloop.engine.steps import describe, unpack
from ironloop.engine.tokens import perplexity
from ironloop.errors import ConfigError


def run_evaluation(run) -> tuple[dict[str, float], bool]:
    """One evaluation, from the step path or an epoch end: validate, track the best (and
    early-stopping patience), step plateau, log evals.jsonl. Returns (val metrics, new best)."""
    cfg, p = run.cfg, run.progress
    started = time.perf_counter()
    val = {f"val_{k}": v for k, v in evaluate(run, run.val_data).items()}
    if cfg.eval.perplexity and "val_loss" in val:  # exp of the loss per token (tokens.py)
        val["val_ppl"] = perplexity(val["val_loss"])
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
def evaluate(run, dataset) -> dict[str, float]:
    """Mean loss and metrics over a dataset, in eval mode; restores the previous mode, also
    when the step raises."""
    was_training = run.raw_model.training
    run.raw_model.eval()
    try:
        return _evaluate(run, dataset)
    finally:
        run.raw_model.train(was_training)


def _evaluate(run, dataset) -> dict[str, float]:
    model = run.raw_model
    if run.carry is not None:  # a stateful step gets the evaluation state, empty at first
        run.carry.start_evaluation()
    # Every sample exactly once over all ranks: the training sampler's tail drop is for DDP's
    # backward, and evaluation has none.
    sampler = EvalSampler(len(dataset), run.cfg.train.batch_size, run.cfg.run.seed,
                          shuffle=False, rank=run.world.rank, world_size=run.world.size)
    loader = make_loader(dataset, sampler, num_workers=run.cfg.data.num_workers,
                         pin_memory=run.cfg.data.pin_memory and run.device.type == "cuda",
                         collate_fn=run.collate_fn, seed_samples=run.cfg.data.seed_samples)
    sums, names, count, batches = None, [], 0, 0
    # A step's weighted sums (tokens over a whole split) add up in float64 (float32 on MPS);
    # per-sample sums stay float32, where a batch's accuracy x its size rounds to its count.
    wide = torch.float32 if run.device.type == "mps" else torch.float64
    for batch in loader:
        if run.check_labels is not None:
            run.check_labels(batch)
        n = batch_size_of(batch)
        batch = to_device(batch, run.device, run.device.type == "cuda")
        with autocast_for(run):
            loss, metrics, weight = call_step(run, model, batch, "evaluation")
        names = ["loss", *metrics]
        values = torch.stack([loss.float(), *(m.float() for m in metrics.values())])
        values = values * n if weight is None else values.to(wide) * weight
        sums = values if sums is None else sums + values
        count = count + (n if weight is None else weight)  # samples, or the step's tokens
        batches += 1
    _pad_forwards(run, dataset, batches)
    # A rank that saw no sample (fewer samples than ranks) still joins the all-reduce there.
    return sum_over_ranks(names, sums, count, run.world)


def _pad_forwards(run, dataset, batches: int) -> None:
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
        with autocast_for(run):
            run.step_fn(run.raw_model, one)


def call_step(run, model: nn.Module, batch, where: str):
    """The step function's (loss, metrics, weight or None); an exception from it (the user's
    code, usually) keeps its traceback and gains one line saying where in the run it happened
    and on what batch."""
    try:
        return unpack(run.step_fn(model, batch))
    except Exception as e:
        p = run.progress
        step = p.step + 1 if where == "training" else p.step  # the step being computed
        e.add_note(f"ironloop: raised in {where} at step {step}, epoch {p.epoch + 1}; "
                   f"batch: {describe(batch)}")
        raise


def autocast_for(run):
    return autocast(run.precision, run.device)
