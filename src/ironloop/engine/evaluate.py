"""Evaluation: validate in eval mode under inference_mode, track the best, step a plateau
schedule, log evals.jsonl, fire on_eval_end. The same ``run_evaluation`` serves the step path
(``eval.every_steps``) and the epoch end."""

from __future__ import annotations

import time

import torch

from ironloop.callbacks import fire
from ironloop.data.loader import EvalSampler, batch_size_of, make_loader, to_device
from ironloop.data.source import EvalBatching, eval_loader
from ironloop.dist import parallel
from ironloop.dist.world import sum_over_ranks
from ironloop.engine.run import Run
from ironloop.engine.tokens import perplexity
from ironloop.errors import ConfigError


def timed_evaluation(run: Run) -> tuple[dict[str, float], bool]:
    """``run_evaluation`` charged to the 'validation' part of the time split and kept out of
    the training time (samples/s stays about training). Returns (val metrics, new best)."""
    with run.outputs.timer.part("validation"):
        started = time.perf_counter()
        val, improved = run_evaluation(run)
        run.counters.meter.exclude(time.perf_counter() - started)
    return val, improved


def run_evaluation(run: Run) -> tuple[dict[str, float], bool]:
    """One evaluation, from the step path or an epoch end: validate, track the best (and
    early-stopping patience), step plateau, log evals.jsonl. Returns (val metrics, new best)."""
    cfg, c, step = run.cfg, run.counters, run.step
    p = c.progress
    started = time.perf_counter()
    val = {f"val_{k}": v for k, v in evaluate(run, run.data.val, "val").items()}
    if cfg.eval.perplexity and "val_loss" in val:  # exp of the loss per token (tokens.py)
        val["val_ppl"] = perplexity(val["val_loss"])
    metric = cfg.early_stop.metric
    if metric not in val:
        raise ConfigError(f"early_stop.metric={metric!r}: this run reports "
                          f"{', '.join(val)}; monitor one of those")
    improved = c.tracker.update(val[metric], p.epoch)
    if improved and cfg.early_stop.patience > 0:
        c.best_state = {k: v.detach().to("cpu", copy=True)
                        for k, v in step.raw_model.state_dict().items()}
    if step.scheduler is not None and step.schedule_on == "eval":
        # ReduceLROnPlateau: once per evaluation, with the metric
        step.scheduler.step(val[metric])  # type: ignore[arg-type]  # plateau's step takes it
    row = {"step": p.step, "epoch": p.epoch + 1, **val, "lr": step.lr,
           "seconds": time.perf_counter() - started}
    c.last_eval = row
    if run.outputs.log is not None:
        run.outputs.log.write("evals", row)
    fire(run, "on_eval_end", row)
    return val, improved


@torch.inference_mode()
def evaluate(run: Run, dataset, split: str = "val") -> dict[str, float]:
    """Mean loss and metrics over a dataset (the run's ``split``, batched as its DataLoader
    said), in eval mode; restores the previous mode, also when the step raises."""
    model = run.step.raw_model
    was_training = model.training
    model.eval()
    try:
        return _evaluate(run, dataset, split)
    finally:
        model.train(was_training)


def _evaluate(run: Run, dataset, split: str) -> dict[str, float]:
    step, device = run.step, run.step.device
    model = step.raw_model
    if step.carry is not None:  # a stateful step gets the evaluation state, empty at first
        step.carry.start_evaluation()
    # Every sample exactly once over all ranks (a drop_last tail aside): the training
    # sampler's tail drop is for DDP's backward, and evaluation has none.
    batching = run.data.batching.get(split) or \
        EvalBatching(run.cfg.train.batch_size, None, run.data.collate_fn)
    loader = eval_loader(dataset, batching, run.cfg, run.world.rank, run.world.size, device)
    sums, names, count, batches = None, [], 0, 0
    # A step's weighted sums (tokens over a whole split) add up in float64 (float32 on MPS);
    # per-sample sums stay float32, where a batch's accuracy x its size rounds to its count.
    wide = torch.float32 if device.type == "mps" else torch.float64
    for batch in loader:
        if step.check_labels is not None:
            step.check_labels(batch)
        n = batch_size_of(batch)
        batch = to_device(batch, device, device.type == "cuda")
        with step.autocast():
            loss, metrics, weight = step.forward(model, batch, "evaluation",
                                                 run.counters.progress)
        names = ["loss", *metrics]
        values = torch.stack([loss.float(), *(m.float() for m in metrics.values())])
        values = values * n if weight is None else values.to(wide) * weight
        sums = values if sums is None else sums + values
        count = count + (n if weight is None else weight)  # samples, or the step's tokens
        batches += 1
    _pad_forwards(run, dataset, batches, batching)
    # A rank that saw no sample (fewer samples than ranks) still joins the all-reduce there.
    return sum_over_ranks(names, sums, count, run.world)


def _pad_forwards(run: Run, dataset, batches: int, batching: EvalBatching) -> None:
    """Under FSDP2 each forward is a collective: a rank with fewer evaluation batches runs
    discarded forwards on one sample until every rank has run as many."""
    step = run.step
    owed = parallel.extra_forwards(step.raw_model, run.world, len(dataset),
                                   batching.batch_size, batches)
    if owed <= 0:
        return
    one = next(iter(make_loader(dataset, EvalSampler(1, 1, 0, False), num_workers=0,
                                pin_memory=False, collate_fn=batching.collate_fn)))
    one = to_device(one, step.device, False)
    for _ in range(owed):
        with step.autocast():
            step.step_fn(step.raw_model, one)
