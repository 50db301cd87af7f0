"""The engine's half of ``fit()``: build the run from its resolved config, resume it if asked,
train, and write the results (``train_run``).

The front door a user calls, ``ironloop.fit`` (tools/recipe.py), parses and resolves the config
once, holds run.dir's lock, sets run.threads, names collective timeouts and runs the preflight
doctor, then calls ``train_run``. This module is wiring only: the run is built in ``build.py``,
the decisions live in small classes (BestTracker, EpochSampler, build_scheduler) and the loop
itself lives in ``loop.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ironloop.callbacks import fire
from ironloop.config import Config
from ironloop.data.bundle import DataBundle
from ironloop.data.loader import is_sliced
from ironloop.data.source import open_data, resolve_batch_size
from ironloop.engine import build, evaluate, loop, optim, step_fns
from ironloop.engine.oom import out_of_memory
from ironloop.engine.precision import resolve_device, resolve_precision
from ironloop.engine.run import Run
from ironloop.engine.train_module import check_model
from ironloop.errors import ConfigError, DataError, UserError
from ironloop.guard.faults import Faults
from ironloop.outputs.console import say, test_line
from ironloop.outputs.readers import read_jsonl
from ironloop.outputs.time_split import RunSettings, steps_timed, table, tuned_none
from ironloop.parallel import data_parallel
from ironloop.parallel.world import (
    all_reduce_sum,
    check_env,
    collective_timeout,
    env_int,
    env_world_size,
    init_from_env,
    shutdown,
)
from ironloop.state import global_batch
from ironloop.state.checkpointer import Checkpointer, Peeked
from ironloop.state.export import save_safetensors
from ironloop.state.io import write_atomic
from ironloop.state.rng import seed_everything
from ironloop.state.run_dir import FINAL, FINAL_AVG, RunDir


@dataclass
class FitResult:
    """What ``fit`` returns.

    Attributes:
        model: the trained model (the best weights when early stopping restored them).
        results: results.json's content: the final and best metrics, steps, seconds, the
            guard's counts.
        run_dir: the run's directory (run.dir), where every file of the run lies.
    """

    model: nn.Module
    results: dict
    run_dir: Path


def as_config(config: Config | dict | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        dotted = {k: v for k, v in config.items() if "." in k}
        nested = {k: v for k, v in config.items() if "." not in k}
        return Config.from_dict(nested).with_overrides(dotted)
    raise ConfigError(f"config must be an ironloop.Config, a dict or None, "
                      f"not {type(config).__name__}")


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """``run.threads``: torch's intra-op threads for the run (0 = leave torch's default), set
    before anything is built and given back afterwards, since one process may call fit() more
    than once (tune's trials, notebooks). DataLoader workers set their own to 1."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(before)


def is_rank0() -> bool:
    """Rank 0 under torchrun (or the only process): the one that holds run.dir's lock."""
    return os.environ.get("RANK", "0") == "0"


def train_run(cfg: Config, model: nn.Module, data: DataBundle, given: build.Given,
              peeked: Peeked | None = None) -> FitResult:
    """Build the run and train it: ``cfg`` is the run's config, already resolved (``resolved``),
    and the caller holds run.dir's lock, run.threads and the named collective timeouts (the
    front door, ``ironloop.tools.recipe.fit``). Nothing here parses or rewrites the config.
    ``peeked``: the resume's read of its checkpoint (``peek``), which the run resumes from."""
    started = time.time()
    device = resolve_device(cfg.run.device, _env_local_rank())
    world = init_from_env(device.type, cfg.dist.timeout_s)
    precision = resolve_precision(cfg.train.precision, device, world.is_main)
    seed_everything(cfg.run.seed + world.rank)
    faults = Faults(cfg.fault)
    opened = open_data(cfg, data.train, data.val, data.test, world.rank, world.size, device,
                       poison=faults.poison)
    run, _ = build.build_run(cfg, model.to(device), opened, device, world, precision, given,
                             faults, peeked)
    collective_timeout(world, cfg.dist.timeout_s)  # setup had the generous joining timeout
    first_step = run.progress.step  # after any resume: this process's steps start here
    with run.hooks.preempt:  # SIGTERM/SIGINT/SIGUSR1 end the run at a step, saved (preempt.py)
        _train(run)
    result = _finish(run, started, first_step)
    del run  # the DDP wrapper goes before its process group (see parallel.world.shutdown)
    shutdown(world)
    return result


def check_arguments(model, train_data) -> None:
    """fit()'s two required arguments, each refused in one line before anything runs."""
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, not {type(model).__name__}; pass the "
                        f"model instance (a function: wrap it in an nn.Module's forward)")
    check_model(model)  # on the meta device, or nothing to train: before anything is built
    if train_data is None:
        raise DataError("train_data is None; pass the training split: a Dataset, a "
                        "DataLoader, a Hugging Face datasets.Dataset or an (inputs, targets) "
                        "pair")


def peek(cfg: Config, resume) -> Peeked | None:
    """The checkpoint a resume (``resume``: what --resume names) starts from, read once before
    the run is built: ``resolved`` keeps the global batch from it, and the run resumes from
    the same read (``train_run``). The caller holds run.dir's lock: nothing writes the folder
    meanwhile."""
    return Checkpointer(RunDir(cfg.run.dir)).peek(resume) if resume else None


def resolved(cfg: Config, train_data, step_fn, val_data=None,
             peeked: Peeked | None = None) -> Config:
    """The run's config, complete before anything reads it: a passed DataLoader keeps its
    batch size, a resume on another number of ranks (``peeked``: the checkpoint it starts
    from, ``peek``) keeps the run's global batch (state/global_batch.py), the LM step reports
    perplexity, and with several validation sets the default early_stop.metric (val_loss) is
    the first set's loss. Written once, to config.yaml and into every checkpoint."""
    check_env()  # WORLD_SIZE=two, or set without MASTER_ADDR: one line before anything
    cfg = resolve_batch_size(cfg, train_data)
    cfg = global_batch.keep(cfg, env_world_size(), peeked.state if peeked else None)
    if isinstance(val_data, dict) and val_data and cfg.early_stop.metric == "val_loss":
        first = next(iter(val_data))  # no val_loss without an unnamed set
        cfg = cfg.with_overrides({"early_stop.metric": f"val_{first}_loss"})
    if step_fns.is_lm(step_fn, cfg.train.step_fn) and not cfg.eval.perplexity:
        cfg = cfg.with_overrides({"eval.perplexity": True})  # on by default for the LM step
    return cfg


def _train(run: Run) -> None:
    """The loop between the callbacks' start and end; outputs are closed whatever happens."""
    p = run.progress
    try:
        fire(run, "on_train_start", {"step": p.step, "epoch": p.epoch})
        loop.train(run)
        fire(run, "on_train_end", {"step": p.step, "epoch": p.epoch,
                                   "best": run.tracker.best})
    except torch.OutOfMemoryError as e:
        raise out_of_memory(run, e) from None  # checkpoints stay as they are
    finally:
        closing = time.perf_counter()
        run.outputs.close()  # waits for an in-flight async write and the remote's uploads
        # Not training time, as an epoch end's save is not (loop.end_epoch): a slow store's
        # bounded wait at the end would otherwise lower samples/s.
        run.meter.exclude(time.perf_counter() - closing)
        if run.guard is not None:
            run.guard.close()
        run.data.close()


def _env_local_rank() -> int:
    return env_int("LOCAL_RANK", 0)


def _finish(run: Run, started: float, first_step: int = 0) -> FitResult:
    """Restore the best weights, evaluate on test, write final.safetensors and results.json.
    ``first_step``: the step this process started at (the time table counts its steps)."""
    module, run_dir = run.module, run.outputs.dir
    train_seconds = run.meter.train_seconds()
    best = run.tracker.best_weights
    restored = best is not None and run.cfg.early_stop.patience > 0
    if restored and best is not None:
        module.raw_model.load_state_dict(best)
    test, tested = evaluate.test_metrics(run, restored)
    results = _results(run, test, train_seconds, restored, started)
    if test:  # issue 44: printed, with its perplexity, and which weights it measured
        results.update(test_ppl=test.get("ppl"), test_weights=tested)
        say(run.world.is_main, test_line(test, tested))
    weights = data_parallel.full_model_state(module.raw_model)  # a collective under FSDP2
    averaged = _final_average(run)
    if run.world.is_main:
        save_safetensors(weights, run_dir / FINAL)
        if averaged is not None:
            save_safetensors(averaged, run_dir / FINAL_AVG)
        write_atomic(run_dir.results, json.dumps(results, indent=2) + "\n")
        if results.get("time_split"):
            timer = run.outputs.timer
            skipped = run.guard.taken_back if run.guard is not None else 0
            counted = steps_timed(timer.steps, run.progress.step - first_step, skipped)
            print(table(results["time_split"], timer.steps, module.device, timer.sync,
                        settings_of(run), results.get("tokens_per_s"), counted))
    return FitResult(model=module.raw_model, results=results, run_dir=run_dir.path)


def _final_average(run: Run) -> dict | None:
    """The averaged weights for final_avg.safetensors (SWA: BatchNorm statistics recomputed
    over the training split), or None without averaging."""
    average, cfg = run.module.average, run.cfg
    if average is None:
        return None
    batches = run.data.once_over_train(cfg.train.batch_size, run.world.rank, run.world.size)
    return average.final_weights(batches, run.module.device)


def settings_of(run: Run) -> RunSettings:
    """What the run uses, for the time table's advice (it names only what is still open)."""
    cfg, module = run.cfg, run.module
    device = module.device
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return RunSettings(
        device=device.type, num_workers=cfg.data.num_workers, cores=cores,
        threads=torch.get_num_threads(), pin_memory=cfg.data.pin_memory,
        optimizer=optim.kernel(module.optimizer), fused_open=optim.fused_open(module.optimizer),
        foreach_open=optim.takes(module.optimizer, "foreach"), closure=module.takes_closure,
        optimizer_class=optim.foreign(module.optimizer, cfg.optim),
        checkpoint_async=cfg.checkpoint.async_write,
        checkpoint_every_steps=cfg.checkpoint.every_steps, precision=module.precision,
        bf16_open=device.type == "cuda" and torch.cuda.is_bf16_supported(),
        sliced=is_sliced(run.data.train, run.data.collate_fn),
        tuned_none=tuned_none(cfg.run.dir))


def _results(run: Run, test: dict, train_seconds: float, restored: bool,
             started: float) -> dict[str, Any]:
    """results.json's content."""
    cfg, p, tracker, last_eval = run.cfg, run.progress, run.tracker, run.last_eval
    meter, module, timer = run.meter, run.module, run.outputs.timer
    # max_steps ended the run mid-epoch: that epoch has no epochs.jsonl line (it stays open for
    # a longer resume); the loop evaluated the final weights once (loop.end_mid_epoch).
    mid_epoch = p.offset > 0
    last = last_eval if mid_epoch and last_eval.get("step") == p.step else {}
    final_val = {k.removeprefix("val_"): v for k, v in last.items() if k.startswith("val_")}
    epochs = read_jsonl(run.outputs.dir.log("epochs")) if run.world.is_main else []
    accs = [r["val_acc"] for r in epochs if r.get("val_acc") is not None]
    # the open epoch's training so far and its final evaluation (loop.end_mid_epoch)
    open_seconds = train_seconds - meter.epoch_mark.get("train_seconds", 0.0) + \
        last.get("seconds", 0.0) if mid_epoch else 0.0
    results: dict[str, Any] = {
        "best_val_acc": max(accs) if accs else None,
        "final_val_acc": final_val.get("acc", accs[-1] if accs else None),
        "best_epoch": tracker.best_epoch + 1 if tracker.best_epoch >= 0 else None,
        "monitor": {cfg.early_stop.metric: tracker.best},
        "test_acc": test.get("acc"), "test_loss": test.get("loss"),
        # 1-based like the console: the epochs the run trained in, the open one included
        "steps": p.step, "epochs": p.epoch + (1 if mid_epoch else 0),
        "stopped_early": tracker.should_stop, "restored_best": restored,
        "stopped_by_callback": run.hooks.stop_requested,
        "precision": module.precision, "device": str(module.device),
        "threads": torch.get_num_threads(),  # run.threads, or torch's default it resolved to
        # as epochs.jsonl counts them (training + epoch-end validation), the open epoch too
        "seconds": sum(r.get("seconds", 0.0) for r in epochs) + open_seconds,
        "train_seconds": train_seconds,  # every process's training time, without validation
        "wall_seconds_this_process": time.time() - started,
        **(run.guard.totals() if run.guard is not None else {}),
        # seconds per part, this process (time_split.PARTS)
        "time_split": timer.finish() or None,
    }
    split = module.metrics  # whole-split metrics on the test split too: test_<name>
    results.update({f"test_{k}": test[k] for k in (split.metrics if split else ()) if k in test})
    if mid_epoch:
        results["stopped_mid_epoch"] = {"epoch": p.epoch + 1, "val_loss": final_val.get("loss")}
    tokens = float(all_reduce_sum(meter.tokens.clone(), run.world))  # host sync, once
    if tokens:  # the step reports its tokens (its loss weight)
        results.update(tokens=tokens, tokens_per_s=tokens / max(train_seconds, 1e-9))
    if last_eval.get("val_ppl") is not None:
        results["final_val_ppl"] = last_eval["val_ppl"]
    if not math.isfinite(tracker.best):
        results["monitor"] = {cfg.early_stop.metric: None}
    return results
