"""Early stopping and best-metric tracking: a pure decision, no model, no I/O."""

from __future__ import annotations

import math

from ironloop.errors import ConfigError


class BestTracker:
    """Tracks the best value of one monitored metric and how long since it improved.

    ``patience`` 0 means it never asks to stop (it still tracks the best, for best.pt).
    """

    def __init__(self, mode: str, patience: int = 0, min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.mode, self.patience, self.min_delta = mode, patience, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.best_epoch = -1
        self.bad_epochs = 0
        # A CPU copy of the best weights, kept when early stopping restores them at the end;
        # not in the state_dict (a resume reads them back from best.pt).
        self.best_weights: dict | None = None

    def update(self, value: float, epoch: int) -> bool:
        """Record one epoch's value; returns True when it is a new best."""
        gain = (self.best - value) if self.mode == "min" else (value - self.best)
        if gain > self.min_delta:  # NaN never counts as an improvement
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
            return True
        self.bad_epochs += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_epochs >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.bad_epochs = state["bad_epochs"]


def check_monitor(metric: str, step: str, perplexity: bool, validates: bool,
                  prefixes: tuple[str, ...] = ("val_",), extra: tuple[str, ...] = ()) -> None:
    """``early_stop.metric`` against the metrics the run will report, before any training (a
    mistake found after the first epoch left its outputs behind). ``step``: 'classification'
    or 'lm' (the built-in steps, whose metrics are known), anything else a user's step_fn,
    whose metric names only its evaluation tells (checked there). ``prefixes``: one per
    validation set and weight set (val_, val_clean_, val_avg_, ...); ``extra``: the
    whole-split metrics' names."""
    known = {"classification": ["loss", "acc"], "lm": ["loss"]}.get(step)
    if not validates or known is None:
        return
    names = [*known, *(["ppl"] if perplexity else []), *extra]
    reported = [f"{p}{n}" for p in prefixes for n in names]
    if metric not in reported:
        raise ConfigError(f"early_stop.metric={metric!r}: this run reports "
                          f"{', '.join(reported)}; monitor one of those")
