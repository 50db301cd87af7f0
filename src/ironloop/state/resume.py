"""What a checkpoint holds, and putting it back.

A checkpoint is one explicit dict with named keys (nothing registered behind the user's back),
made only of tensors and plain containers so that ``torch.load(weights_only=True)`` opens it.
"""

from __future__ import annotations

import torch

from ironloop.version import __version__
from ironloop.callbacks import callbacks_state, load_callbacks_state
from ironloop.state.io import FORMAT_VERSION, load_model_state
from ironloop.errors import CheckpointError
from ironloop.state.rng import rng_state, set_rng_state


def collect_state(run) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "ironloop_version": __version__,
        "torch_version": str(torch.__version__),
        "config": run.cfg.to_dict(),
        "model": run.raw_model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "world_size": run.world.size,  # the drift check compares global batches across resumes
        "progress": run.progress.state_dict(),
        "sampler": {**run.sampler.state_dict(), "epoch": run.progress.epoch,
                    "offset": run.progress.offset},
        "meter": run.meter.state_dict(),
        "tracker": run.tracker.state_dict(),
        "rng": rng_state(),
        "callbacks": callbacks_state(run.callbacks),
        "evaluation": run.last_eval,
        "schedule_steps": run.schedule_steps,  # kept when a resume extends the run
        "loggers": run.log.ids() if run.log is not None else {},  # W&B / MLflow run ids
        "guard": run.guard.state_dict() if getattr(run, "guard", None) is not None else None,
        # a stateful step's state (an RNN's hidden state), so a resume mid-epoch goes on with it
        "carry": run.carry.state_dict() if getattr(run, "carry", None) is not None else None,
    }


def restore_state(run, state: dict, source: str) -> None:
    """Load every part; a checkpoint that does not fit gets a CheckpointError naming it."""
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{source} has checkpoint format {version}, this ironloop reads "
                              f"{FORMAT_VERSION}; resume it with the ironloop that wrote it")
    load_model_state(run.raw_model, state["model"], source)
    try:
        run.optimizer.load_state_dict(state["optimizer"])
        if run.scheduler is not None and state["scheduler"] is not None:
            run.scheduler.load_state_dict(state["scheduler"])
        if run.scaler is not None and state["scaler"] is not None:
            run.scaler.load_state_dict(state["scaler"])
        run.sampler.load_state_dict(state["sampler"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{source} does not fit this run's optimizer, schedule or data "
                              f"({e}); resume with the config it was written with") from e
    run.progress.load_state_dict(state["progress"])
    run.meter.load_state_dict(rank_meter(state["meter"], run.world.rank, run.world.size))
    run.tracker.load_state_dict(state["tracker"])
    load_callbacks_state(run.callbacks, state.get("callbacks"))
    run.last_eval = state.get("evaluation") or {}
    if getattr(run, "carry", None) is not None:
        run.carry.load_state_dict(state.get("carry"))
    set_rng_state(state["rng"])
    guard = state.get("guard") or {}  # absent in checkpoints from before the guard
    if getattr(run, "guard", None) is not None:
        run.guard.load_state_dict(guard)
    run.sampler.set_skip(guard.get("skip", []))  # honoured even with guard.enabled=false


def rank_meter(meter: dict, rank: int, size: int) -> dict:
    """This rank's meter state from a checkpoint's, so that the logged means (sums over every
    rank's samples, see engine/progress.py) continue as if the run had not stopped.

    On the world size that wrote it, each rank gets its own sums back. On another, rank 0 gets
    the sums of every rank that wrote it and the others start from zero: the sums over ranks,
    and so the logged losses, are the same up to the order of the additions. Counts that every
    rank shares (steps, clipped and skipped steps, the training time) come from rank 0.
    """
    ranks = meter.get("ranks")
    if not ranks:  # one process wrote it, or an ironloop from before per-rank meters
        return meter
    if len(ranks) == size:
        return ranks[rank]

    def loss_and_samples(get, into: dict) -> None:  # element 0 of totals: the loss sum
        totals = get(ranks[0])["totals"].clone()
        totals[0] = sum(get(r)["totals"][0] for r in ranks) if rank == 0 else 0.0
        into["totals"] = totals
        into["samples"] = sum(get(r)["samples"] for r in ranks) if rank == 0 else 0

    merged = {**ranks[0]}
    loss_and_samples(lambda r: r, merged)
    for mark in ("window_mark", "epoch_mark"):
        merged[mark] = {**ranks[0][mark]}
        loss_and_samples(lambda r, mark=mark: r[mark], merged[mark])
    return merged
