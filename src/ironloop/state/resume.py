"""What a checkpoint holds, and putting it back.

A checkpoint is one explicit dict with named keys (nothing registered behind the user's back),
made only of tensors and plain containers so that ``torch.load(weights_only=True)`` opens it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ironloop.errors import CheckpointError
from ironloop.state.io import FORMAT_VERSION, load_model_state
from ironloop.state.rng import rng_state, set_rng_state
from ironloop.version import __version__


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def collect_state(config: dict, model: nn.Module, parts: Mapping[str, Stateful | None],
                  **values: Any) -> dict:
    """A checkpoint's dict: the format and versions, the config, the model's and every part's
    state_dict (None for a part the run does not have), the RNG, and plain ``values``."""
    return {
        "format_version": FORMAT_VERSION,
        "ironloop_version": __version__,
        "torch_version": str(torch.__version__),
        "config": config,
        "model": model.state_dict(),
        **{name: None if part is None else part.state_dict() for name, part in parts.items()},
        "rng": rng_state(),
        **values,
    }


def restore_state(state: dict, source: str, model: nn.Module,
                  parts: Mapping[str, Stateful | None]) -> None:
    """Check the format, then load the model and each part present in both the run and the
    checkpoint; a checkpoint that does not fit gets a CheckpointError naming it. The RNG is
    restored last (``restore_rng``), after the caller's own values."""
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{source} has checkpoint format {version}, this ironloop reads "
                              f"{FORMAT_VERSION}; resume it with the ironloop that wrote it")
    load_model_state(model, state["model"], source)
    try:
        for name, part in parts.items():
            if part is not None and state.get(name) is not None:
                part.load_state_dict(state[name])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{source} does not fit this run's optimizer, schedule or data "
                              f"({e}); resume with the config it was written with") from e


def restore_rng(state: dict) -> None:
    set_rng_state(state["rng"])


def rank_meter(meter: dict, rank: int, size: int) -> dict:
    """This rank's meter state from a checkpoint's, so that the logged means (sums over every
    rank's samples and tokens, see engine/progress.py) continue as if the run had not stopped.

    On the world size that wrote it, each rank gets its own sums back. On another, rank 0 gets
    the sums (loss, samples, tokens) of every rank that wrote it and the others start from zero:
    the sums over ranks, and so the logged losses, are the same up to the order of the
    additions. Counts that every rank shares (steps, clipped and skipped steps, the training
    time) come from rank 0.
    """
    ranks = meter.get("ranks")
    if not ranks:  # one process wrote it, or an ironloop from before per-rank meters
        return meter
    if len(ranks) == size:
        return ranks[rank]

    def summed_on_rank_0(get, into: dict) -> None:
        totals = get(ranks[0])["totals"].clone()
        # the loss sum (element 0) and the tokens (3, absent before token weights) are summed
        # over the ranks at every log, as the samples are (Meter._since)
        for i in [i for i in (0, 3) if i < len(totals)]:
            totals[i] = sum(get(r)["totals"][i] for r in ranks) if rank == 0 else 0.0
        into["totals"] = totals
        into["samples"] = sum(get(r)["samples"] for r in ranks) if rank == 0 else 0

    merged = {**ranks[0]}
    summed_on_rank_0(lambda r: r, merged)
    for mark in ("window_mark", "epoch_mark"):
        merged[mark] = {**ranks[0][mark]}
        summed_on_rank_0(lambda r, mark=mark: r[mark], merged[mark])
    return merged
