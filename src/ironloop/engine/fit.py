"""``fit()``: build the run from a config, resume it if asked, train, and write the results.

This module is wiring only: the run is built in ``build.py``, the decisions live in small
classes (BestTracker, EpochSampler, build_scheduler) and the loop itself lives in ``loop.py``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ironloop.config import Config
from ironloop.data.inputs import map_style
from ironloop.data.loader import TensorData, derive_seed
from ironloop.data.stream import as_stream, refuse_eval_stream
from ironloop.dist import parallel
from ironloop.dist.world import (all_reduce_sum, collective_timeout, init_from_env,
                                 name_timeouts, shutdown)
from ironloop.engine import build, evaluate
from ironloop.engine.oom import out_of_memory
from ironloop.engine.preempt import Preemption
from ironloop.engine.precision import resolve_device, resolve_precision
from ironloop.engine.run import Run
from ironloop.engine.timing import table
from ironloop.errors import CheckpointError, ConfigError, DataError
from ironloop.engine import loop
from ironloop.callbacks import fire
from ironloop.guard.faults import poison_sample
from ironloop.outputs import records
from ironloop.outputs.readers import read_jsonl
from ironloop.state import dcp as sharded
from ironloop.state import lock, rundir
from ironloop.state.export import save_safetensors
from ironloop.state.io import write_atomic
from ironloop.state.resume import restore_state


@dataclass
class FitResult:
    model: nn.Module
    results: dict
    run_dir: Path


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


def _holding_run_dir(fn):
    """fit() holds run.dir's lock from its start to its end (rank 0 under torchrun), so nothing
    in run.dir is read, written or deleted while another process owns it (state/lock.py)."""

    @functools.wraps(fn)
    def wrapper(model, train_data, val_data=None, config=None, **kwargs):
        with lock.hold(Path(as_config(config).run.dir), os.environ.get("RANK", "0") == "0"):
            return fn(model, train_data, val_data, config, **kwargs)

    return wrapper


@_holding_run_dir
@name_timeouts
def fit(model: nn.Module, train_data, val_data=None, config: Config | dict | None = None, *,
        loss_fn=None, step_fn=None, test_data=None, num_classes: int | None = None,
        optimizer=None, scheduler=None, callbacks=None,
        resume: bool | str | None = False, overwrite: bool = False,
        allow_config_change: bool = False, from_config: bool = False) -> FitResult:
    """Train ``model`` on ``train_data`` and return the trained model and its results.

    Args:
        model: any ``nn.Module``; the default step calls ``model(inputs)`` on ``(inputs,
            targets)`` batches.
        train_data, val_data, test_data: a Dataset, a DataLoader (its sampler, collate_fn and
            batch size are kept), a Hugging Face ``datasets.Dataset``, or an (inputs, targets)
            pair.
        config: a Config, a dict (nested sections or "dotted.keys"), or None for the defaults.
        loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the batch. Default: the
            ``loss.*`` config (``loss.name`` may be 'module:function').
        step_fn: ``step_fn(model, batch) -> (loss, {name: scalar tensor}[, weight])`` for
            anything that is not ``(inputs, targets)`` classification. Loss and metrics are
            means over the batch's weight (its samples, or the tokens a third value gives:
            see engine/tokens.py). A third parameter ``state`` makes it stateful (carry.py).
            Default: ``train.step_fn`` ('module:function' or 'lm'), else the classification
            step.
        num_classes: checks that labels lie in [0, C); inferred from the model when omitted.
        optimizer: a torch optimizer over the model's parameters, or ``factory(params)``
            returning one. Default: the ``optim.*`` config.
        scheduler: a torch LR scheduler, or ``factory(optimizer)`` returning one. It steps after
            every optimizer step; a ReduceLROnPlateau steps after every evaluation with the
            monitored metric. Default: the ``schedule.*`` config.
        callbacks: ``ironloop.callbacks.Callback`` objects; see that module for the hooks.
        resume: True = the newest valid checkpoint in run.dir (fresh start when none);
            a path = that checkpoint.
        overwrite: delete a previous run's outputs in run.dir before starting.
        allow_config_change: resume even when keys that change the training trajectory differ
            from the checkpoint's config (see ``ironloop.state.drift``).
        from_config: the model and data were built from model.name / data.name (what
            ``ironloop train`` does); otherwise config.yaml names the user's classes.
    """
    cfg = as_config(config)
    started = time.time()
    user_fns = {"loss_fn": loss_fn, "step_fn": step_fn}  # for the record: step_fn is rebound
    cfg, data = _splits(cfg, train_data, val_data, test_data)
    device = resolve_device(cfg.run.device, _env_local_rank())
    world = init_from_env(device.type, cfg.dist.timeout_s)
    precision = resolve_precision(cfg.train.precision, device, world.is_main)
    seed_everything(cfg.run.seed + world.rank)

    run, strategy = build.build_run(cfg, model.to(device), data, device, world, precision, loss_fn,
                               step_fn, num_classes, optimizer, scheduler, callbacks)
    run_dir = Path(cfg.run.dir)
    used = records.used(run.raw_model, run.optimizer, run.scheduler, from_config,
                        {"train": data.train, "val": data.val, "test": data.test}, **user_fns)
    state, source = rundir.prepare_run_dir(run_dir, cfg, resume, overwrite, world,
                                     records.config_record(cfg.to_dict(), used),
                                     allow_config_change)
    if state is not None:
        _restore(run, state, source, strategy, run_dir)
    if world.is_main:
        records.write_run_json(run_dir, records.environment(device, world.size),
                               resumed=state is not None)
    manager = build.open_outputs(run, run_dir, resume, state, source) if world.is_main else None
    if strategy == "fsdp" and cfg.checkpoint.enabled:
        manager = build.open_sharded(run, run_dir)  # every rank writes its shards
    build.wire_save(run, manager)
    if run.guard is not None:
        run.guard.start(run, state is not None, bool(resume), manager and manager.wait)
    run.preempt = Preemption(world.distributed, cfg.dist.timeout_s)
    collective_timeout(world, cfg.dist.timeout_s)  # setup had the generous joining timeout
    with run.preempt:  # SIGTERM/SIGINT/SIGUSR1 end the run at a step, saved (preempt.py)
        _train(run, manager)
    result = _finish(run, data.test, run_dir, started)
    if world.is_main and result.results.get("time_split"):
        print(table(result.results["time_split"], run.timer.steps, device, run.timer.sync,
                    result.results.get("tokens_per_s")))
    shutdown(world)
    return result


class _Splits(NamedTuple):
    train: Any
    val: Any
    test: Any
    collate_fn: Any  # a DataLoader's own collate_fn, kept
    sampler: Any = None  # a DataLoader's own sampler, kept (data/samplers.py)


def _splits(cfg: Config, train_data, val_data, test_data) -> tuple[Config, _Splits]:
    """The datasets fit() trains and evaluates on, and the config a DataLoader's batch size
    implies."""
    stream = as_stream(train_data, "train_data")  # an IterableDataset: data/stream.py
    if stream:
        train_set, collate_fn, loader_bs, sampler = stream, None, stream.batch_size, None
    else:
        train_set, collate_fn, loader_bs, sampler = map_style(train_data, "train_data")
    refuse_eval_stream(val_data, "val_data")
    refuse_eval_stream(test_data, "test_data")
    val_set = _eval_subset(map_style(val_data, "val_data").dataset, cfg)
    test_set = map_style(test_data, "test_data").dataset
    if not stream and len(train_set) == 0:
        raise DataError("the training split is empty (0 samples): check the dataset's path, "
                        "filter or split (data.val_fraction); there is nothing to train on")
    train_set = poison_sample(train_set, cfg.fault.nan_sample)  # a fault knob; -1 = off
    if loader_bs and loader_bs != cfg.train.batch_size:
        cfg = cfg.with_overrides({"train.batch_size": loader_bs})
    _check_needs_val(cfg, val_set)
    return cfg, _Splits(train_set, val_set, test_set, collate_fn, sampler)


def _restore(run: Run, state: dict, source: str, strategy: str, run_dir: Path) -> None:
    """Put a checkpoint back into the run: a sharded .dcp directory, or one file."""
    if sharded.is_sharded(Path(source)):  # model and optimizer come from DCP, resharded
        sharded.load_sharded(Path(source), run.raw_model, run.optimizer)
        state = {**state, "model": run.raw_model.state_dict(),
                 "optimizer": run.optimizer.state_dict()}
    elif strategy == "fsdp":
        raise CheckpointError(f"{source} is a single-file checkpoint (from ddp or one "
                              f"process); dist.strategy=fsdp resumes only sharded .dcp "
                              f"checkpoints. Resume it with dist.strategy=ddp")
    restore_state(run, state, source)
    run.best_state = rundir.best_weights(run_dir, run.cfg)
    if run.schedule_steps:  # an extended run keeps the schedule's length (see drift.py)
        run.schedule_steps = state.get("schedule_steps") or run.schedule_steps
        _hold_onecycle(run)


def _train(run: Run, manager) -> None:
    """The loop between the callbacks' start and end; outputs are closed whatever happens."""
    try:
        fire(run, "on_train_start", {"step": run.progress.step, "epoch": run.progress.epoch})
        loop.train(run)
        fire(run, "on_train_end", {"step": run.progress.step, "epoch": run.progress.epoch,
                                   "best": run.tracker.best})
    except torch.OutOfMemoryError as e:
        raise out_of_memory(run, e) from None  # checkpoints stay as they are
    finally:
        if manager is not None:
            manager.close()  # exit waits for an in-flight async write
        if run.log is not None:
            run.log.close()
        if run.guard is not None:
            run.guard.close()
        if run.loader is not None:
            run.loader.close()  # the workers that persisted across epochs exit


def _hold_onecycle(run: Run) -> None:
    """A finished onecycle has stepped once past its end, to an extrapolated LR; a run extended
    beyond it gets the LR of the schedule's last step back (OneCycleLR's LR is closed-form)."""
    sched, end = run.scheduler, run.schedule_steps
    if not isinstance(sched, torch.optim.lr_scheduler.OneCycleLR) or run.total_steps <= end \
            or sched.last_epoch < end:
        return
    sched.last_epoch = end - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "get_lr outside step": that is what is wanted here
        lrs = sched.get_lr()
    for group, lr in zip(run.optimizer.param_groups, lrs):
        group["lr"] = lr


def _eval_subset(val_set, cfg: Config):
    """With eval.max_batches, the same fixed random subset of the val split at every
    evaluation (independent of run.seed), so evaluations compare like with like."""
    cap = cfg.eval.max_batches * cfg.train.batch_size * int(os.environ.get("WORLD_SIZE", "1"))
    if val_set is None or not cap or cap >= len(val_set):
        return val_set
    gen = torch.Generator().manual_seed(derive_seed("eval-subset"))
    idx = torch.randperm(len(val_set), generator=gen)[:cap].sort().values
    if isinstance(val_set, TensorData):  # keep the one-slice batch path
        return TensorData(val_set.x[idx], val_set.y[idx])
    return torch.utils.data.Subset(val_set, idx.tolist())


def _env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _check_needs_val(cfg: Config, val_set) -> None:
    if val_set is not None and len(val_set) > 0:
        return
    if cfg.schedule.name == "plateau":
        raise ConfigError("schedule.name='plateau' needs validation data to monitor "
                          f"{cfg.early_stop.metric}; set data.val_fraction > 0 (or pass "
                          "val_data), or pick another schedule")
    if cfg.early_stop.patience > 0:
        raise ConfigError("early_stop.patience > 0 needs validation data; set "
                          "data.val_fraction > 0 (or pass val_data), or early_stop.patience=0")


def _finish(run: Run, test_set, run_dir: Path, started: float) -> FitResult:
    """Restore the best weights, evaluate on test, write final.safetensors and results.json."""
    cfg = run.cfg
    train_seconds = run.meter.train_seconds()
    # max_steps ended the run mid-epoch: that epoch has no epochs.jsonl line (it stays open for
    # a longer resume); the loop evaluated the final weights once (loop.end_mid_epoch).
    mid_epoch = run.progress.offset > 0
    last = run.last_eval if mid_epoch and run.last_eval.get("step") == run.progress.step else {}
    final_val = {k.removeprefix("val_"): v for k, v in last.items() if k.startswith("val_")}
    restored = run.best_state is not None and cfg.early_stop.patience > 0
    if restored:
        run.raw_model.load_state_dict(run.best_state)
    test = evaluate.evaluate(run, test_set) if test_set is not None and len(test_set) else {}
    epochs = read_jsonl(run_dir / "epochs.jsonl") if run.world.is_main else []
    accs = [r["val_acc"] for r in epochs if r.get("val_acc") is not None]
    results: dict[str, Any] = {
        "best_val_acc": max(accs) if accs else None,
        "final_val_acc": final_val.get("acc", accs[-1] if accs else None),
        "best_epoch": run.tracker.best_epoch + 1 if run.tracker.best_epoch >= 0 else None,
        "monitor": {cfg.early_stop.metric: run.tracker.best},
        "test_acc": test.get("acc"), "test_loss": test.get("loss"),
        "steps": run.progress.step, "epochs": run.progress.epoch,
        "stopped_early": run.tracker.should_stop, "restored_best": restored,
        "stopped_by_callback": run.stop_requested,
        "precision": run.precision, "device": str(run.device),
        "seconds": sum(r.get("seconds", 0.0) for r in epochs),
        "train_seconds": train_seconds,  # every process's training time, without validation
        "wall_seconds_this_process": time.time() - started,
        **(run.guard.guard.totals() if run.guard is not None else {}),
        "time_split": run.timer.finish() or None,  # seconds per part, this process (timing.PARTS)
    }
    if mid_epoch:
        results["stopped_mid_epoch"] = {"epoch": run.progress.epoch + 1,
                                        "val_loss": final_val.get("loss")}
    tokens = float(all_reduce_sum(run.meter.tokens.clone(), run.world))  # host sync, once
    if tokens:  # the step reports its tokens (its loss weight)
        results.update(tokens=tokens, tokens_per_s=tokens / max(train_seconds, 1e-9))
    if run.last_eval.get("val_ppl") is not None:
        results["final_val_ppl"] = run.last_eval["val_ppl"]
    if not math.isfinite(run.tracker.best):
        results["monitor"] = {cfg.early_stop.metric: None}
    weights = parallel.full_model_state(run.raw_model)  # a collective under FSDP2
    if run.world.is_main:
        save_safetensors(weights, run_dir / "final.safetensors")
        write_atomic(run_dir / "results.json", json.dumps(results, indent=2) + "\n")
    return FitResult(model=run.raw_model, results=results, run_dir=run_dir)

