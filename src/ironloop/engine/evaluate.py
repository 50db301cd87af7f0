"""Evaluation: validate in eval mode under inference_mode, track the best, step a plateau
schedule, log evals.jsonl, fire on_eval_end. The same ``run_evaluation`` serves the step path
(``eval.every_steps``) and the epoch end."""

from __future__ import annotations

import time

import torch

from ironloop.callbacks import fire
from ironloop.data.counting import counted
from ironloop.data.loader import EvalSampler, make_loader, to_device
from ironloop.data.seeding import derive_seed
from ironloop.data.source import EvalBatching, eval_loader, eval_sampler
from ironloop.data.workers import iterating
from ironloop.engine.run import Run
from ironloop.engine.step_fns import METRIC_INPUTS
from ironloop.engine.tokens import perplexity
from ironloop.errors import ConfigError
from ironloop.parallel import data_parallel
from ironloop.parallel.world import sum_over_ranks
from ironloop.state.rng import preserved_rng, seed_everything


def timed_evaluation(run: Run) -> tuple[dict[str, float], bool]:
    """``run_evaluation`` charged to the 'validation' part of the time split and kept out of
    the training time (samples/s stays about training). Returns (val metrics, new best)."""
    timer = run.outputs.timer
    with timer.part("validation"):
        started = time.perf_counter()
        val, improved = run_evaluation(run)
        run.meter.exclude(time.perf_counter() - started)
    return val, improved


def run_evaluation(run: Run) -> tuple[dict[str, float], bool]:
    """One evaluation, from the step path or an epoch end: validate, track the best (and
    early-stopping patience), step plateau, log evals.jsonl. Returns (val metrics, new best)."""
    cfg, p, module, tracker = run.cfg, run.progress, run.module, run.tracker
    started = time.perf_counter()
    val = validation_metrics(run)
    metric = cfg.early_stop.metric
    if metric not in val:
        raise ConfigError(f"early_stop.metric={metric!r}: this run reports "
                          f"{', '.join(val)}; monitor one of those")
    improved = tracker.update(val[metric], p.epoch)
    if improved and cfg.early_stop.patience > 0:
        tracker.best_weights = {k: v.detach().to("cpu", copy=True)
                                for k, v in module.raw_model.state_dict().items()}
    if module.scheduler is not None and module.schedule_on == "eval":
        # ReduceLROnPlateau: once per evaluation, with the metric
        module.scheduler.step(val[metric])  # type: ignore[arg-type]  # plateau's step takes it
    row = {"step": p.step, "epoch": p.epoch + 1, **val, "lr": module.lr,
           "seconds": time.perf_counter() - started}
    run.last_eval = row
    run.outputs.write("evals", row)
    fire(run, "on_eval_end", row)
    return val, improved


def validation_metrics(run: Run) -> dict[str, float]:
    """The raw weights' metrics on each validation set as ``val_<metric>`` (one set) or
    ``val_<set>_<metric>`` (several), then with weight averaging on the averaged weights' as
    ``val_avg_<metric>`` / ``val_avg_<set>_<metric>``."""
    # (the key of the set's batching in data/source.py, its name, the set)
    val_sets = run.data.val_sets
    sets = [(f"val_{name}" if name else "val", name, ds) for name, ds in val_sets.items()]
    val = {}
    for split, _, dataset in sets:
        val.update(_prefixed(run, f"{split}_", evaluate(run, dataset, split)))
    average = run.module.average
    averaged = average.module if average is not None else None
    for split, name, dataset in sets if averaged is not None else ():
        val.update(_prefixed(run, f"val_avg_{name}_" if name else "val_avg_",
                             evaluate(run, dataset, split, averaged)))
    return val


def test_metrics(run: Run, restored: bool) -> tuple[dict[str, float], str]:
    """The test split's metrics (``ppl`` too with eval.perplexity) and the weights that gave
    them: the best when a best exists (early stopping restored it, or best.pt holds it, as
    word_language_model tests its best model), else the last. ({}, '') without a test split."""
    test_set = run.data.test
    if test_set is None or not len(test_set):
        return {}, ""
    best = None if restored else run.outputs.checkpoints.best_weights()
    if best is None:
        return _prefixed(run, "", evaluate(run, test_set, "test")), "best" if restored else "last"
    # The best weights go into the live model, and the last ones back after: a deep copy would
    # share whatever the forward reaches outside the module tree (minGPT's ``self.mlpf =
    # lambda x: m.c_proj(m.act(m.c_fc(x)))`` calls the original's layers), and test a hybrid.
    model = run.module.raw_model
    last = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best)
    try:
        return _prefixed(run, "", evaluate(run, test_set, "test")), "best"
    finally:
        model.load_state_dict(last)  # final.safetensors and the caller keep the last weights


def _prefixed(run: Run, prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    out = {f"{prefix}{k}": v for k, v in metrics.items()}
    if run.cfg.eval.perplexity and "loss" in metrics:  # exp of the loss per token (tokens.py)
        out[f"{prefix}ppl"] = perplexity(metrics["loss"])
    return out


@torch.inference_mode()
def evaluate(run: Run, dataset, split: str = "val",
             model: torch.nn.Module | None = None) -> dict[str, float]:
    """Mean loss and metrics over a dataset (the run's ``split``, batched as its DataLoader
    said), in eval mode (``model``: the raw weights by default); restores the previous mode,
    also when the step raises.

    Evaluation draws from a stream of its own: the global generators (python, numpy, torch's
    CPU and CUDA ones) are put back afterwards, so adding ``val_data`` leaves a step that draws
    random numbers (a diffusion model's noise and timesteps) on the trajectory it had without
    it, and an exact resume needs no evaluation replayed. Inside, they are seeded from (seed,
    split, rank): every evaluation of a split draws the same noise, so its losses compare
    across evaluations, and a resumed run's evaluations match the uninterrupted run's."""
    model = run.module.raw_model if model is None else model
    was_training = model.training
    model.eval()
    try:
        with preserved_rng():
            seed_everything(derive_seed(run.cfg.run.seed, "evaluation", split, run.world.rank))
            return _evaluate(run, dataset, split, model)
    finally:
        model.train(was_training)


def _evaluate(run: Run, dataset, split: str, model: torch.nn.Module) -> dict[str, float]:
    module = run.module
    device = module.device
    if module.carry is not None:  # a stateful step gets the evaluation state, empty at first
        module.carry.start_evaluation()
    # Every sample exactly once over all ranks (a drop_last tail aside): the training
    # sampler's tail drop is for DDP's backward, and evaluation has none.
    data = run.data
    batching = data.batching.get(split) or \
        EvalBatching(run.cfg.train.batch_size, None, data.collate_fn)
    order = eval_sampler(dataset, batching, run.cfg, run.world.rank, run.world.size)
    loader = eval_loader(dataset, batching, run.cfg, run.world.rank, run.world.size, device,
                         order)
    drawn = order.batch_sizes()  # each batch's samples, as drawn (data/counting.py)
    sums, names, count, batches = None, [], 0, 0
    whole = module.metrics  # whole-split metrics (eval.metrics), or None
    if whole is not None:
        whole.reset()
    # A step's weighted sums (tokens over a whole split) add up in float64 (float32 on MPS);
    # per-sample sums stay float32, where a batch's accuracy x its size rounds to its count.
    wide = torch.float32 if device.type == "mps" else torch.float64
    with iterating(loader) as each:  # its workers end here, even if a forward raises
        for batch in each:
            if module.check_labels is not None:
                module.check_labels(batch)
            n = counted(batch, next(drawn))
            batch = to_device(batch, device, device.type == "cuda")
            with module.autocast():
                loss, metrics, weight = module.forward(model, batch, "evaluation", run.progress)
            inputs = metrics.pop(METRIC_INPUTS, None)  # (preds, target): fed, not averaged
            if whole is not None:
                whole.update(inputs)
            names = ["loss", *metrics]
            values = torch.stack([loss.float(), *(m.float() for m in metrics.values())])
            values = values * n if weight is None else values.to(wide) * weight
            sums = values if sums is None else sums + values
            count = count + (n if weight is None else weight)  # samples, or the step's tokens
            batches += 1
    _pad_forwards(run, dataset, batches, batching, model)
    # A rank that saw no sample (fewer samples than ranks) still joins the all-reduce there.
    result = sum_over_ranks(names, sums, count, run.world)
    if whole is not None:  # torchmetrics syncs over the ranks in compute(): every rank calls it
        result.update(whole.compute())
    return result


def _pad_forwards(run: Run, dataset, batches: int, batching: EvalBatching,
                  model: torch.nn.Module) -> None:
    """Under FSDP2 each forward is a collective: a rank with fewer evaluation batches runs
    discarded forwards on one sample until every rank has run as many."""
    module = run.module
    owed = data_parallel.extra_forwards(model, run.world, len(dataset), batching.batch_size,
                                   batches)
    if owed <= 0:
        return
    one = next(iter(make_loader(dataset, EvalSampler(1, 1, 0, False), num_workers=0,
                                pin_memory=False, collate_fn=batching.collate_fn)))
    one = to_device(one, module.device, False)
    for _ in range(owed):
        with module.autocast():
            module.step_fn(model, one)
