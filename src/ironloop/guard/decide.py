"""The guard's decision, kept apart from the wiring (``reporter.py``): is this step bad (non-finite,
or a spike against the recent median), when to roll back, when to stop. A pure class with a
state_dict, unit-tested without a model."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

MAX_EVENTS = 20  # bad steps remembered for the stop message


class GuardPolicy:
    """Bad / skip / roll back / stop decisions on host floats. No torch, no run: unit-testable.

    A step is bad when its loss or grad norm is non-finite, or (``spike_factor > 0``) when either
    exceeds ``median + spike_factor * 1.4826 * MAD`` of the last ``spike_window`` good steps (a
    robust z-score). The first ``spike_warmup`` good steps stay out of the window (the loss falls
    fast there), bad steps never enter it, and detection starts once the window is full.
    """

    def __init__(self, max_bad_steps: int = 3, max_rollbacks: int = 3, lr_backoff: float = 0.5,
                 spike_factor: float = 0.0, spike_window: int = 100, spike_warmup: int = 100):
        self.max_bad_steps, self.max_rollbacks = max_bad_steps, max_rollbacks
        self.lr_backoff = lr_backoff
        self.spike_factor, self.spike_window, self.spike_warmup = (spike_factor, spike_window,
                                                                    spike_warmup)
        self.consecutive = 0      # bad steps in a row, now
        self.bad_steps = 0        # bad steps in the whole run
        self.rollbacks = 0        # every rollback, those the inputs explain included
        self.input_rollbacks = 0  # rollbacks that only left out samples with NaN/inf inputs
        self.lr_factor = 1.0      # applied on top of the schedule at every optimizer step
        self.skip: list[int] = []           # sample indices the sampler leaves out, sorted
        self.pending: list[list[int]] = []  # the windows of the current run of bad steps
        # [step, reason] of the last MAX_EVENTS bad steps, with a third item, the cause, when
        # one is known: "inputs" (NaN/inf input samples) or "injected" (fault.nan_at_step)
        self.events: list[list] = []
        self.bad_inputs: list[int] = []     # the samples found with NaN/inf inputs, sorted
        self.rolled_from: list[int] = []    # the steps of the last MAX_EVENTS rollbacks
        self.good = 0             # good steps seen
        self.losses: list[float] = []  # the spike window (good steps after warm-up only)
        self.norms: list[float] = []
        self.logged = 0           # guard.jsonl lines written: a resume truncates to this

    def classify(self, loss: float, grad_norm: float) -> str | None:
        """The reason a step is bad, or None for a good step."""
        if not math.isfinite(loss):
            return "nonfinite_loss"
        if not math.isfinite(grad_norm):
            return "nonfinite_grad"
        if self.spike_factor > 0 and len(self.losses) >= self.spike_window and (
                _spikes(loss, self.losses, self.spike_factor)
                or _spikes(grad_norm, self.norms, self.spike_factor)):
            return "spike"
        return None

    def observe(self, step: int, loss: float, grad_norm: float,
                window: Callable[[], list[int]] = list) -> str | None:
        """Classify and record one step; returns its bad reason or None. ``window()`` (the
        step's sample indices) is called on bad steps only. The reference for the device
        verdict (``verdict.py``), which classifies on the device and records through
        ``record_good``/``record_bad`` when the hook settles."""
        reason = self.classify(loss, grad_norm)
        if reason is None:
            self.record_good(loss, grad_norm)
        else:
            self.record_bad(step, reason, window())
        return reason

    def record_good(self, loss: float = math.nan, grad_norm: float = math.nan) -> None:
        """A good step ends any run of bad ones (and feeds the host spike window, when the host
        classifies; the hook keeps that window on the device instead)."""
        self.consecutive, self.pending = 0, []
        self.good += 1
        if self.spike_factor > 0 and self.good > self.spike_warmup and math.isfinite(loss):
            self.losses = [*self.losses, loss][-self.spike_window:]
            self.norms = [*self.norms, grad_norm][-self.spike_window:]

    def record_bad(self, step: int, reason: str, window: list[int], cause: str = "") -> None:
        """``cause``: what explains the step, when something does ("inputs", "injected")."""
        self.consecutive += 1
        self.bad_steps += 1
        self.pending.append(list(window))
        event = [step, reason, cause] if cause else [step, reason]
        self.events = [*self.events, event][-MAX_EVENTS:]

    def causes(self) -> set[str]:
        """The causes of the latest run of bad steps ("" for one nothing explains: the model's
        own NaN, a gradient or loss spike)."""
        latest = self.events[-max(self.consecutive, 1):]
        return {e[2] if len(e) > 2 else "" for e in latest} or {""}

    @property
    def must_roll_back(self) -> bool:
        return self.consecutive >= self.max_bad_steps

    @property
    def must_stop(self) -> bool:
        """A rollback is due but the allowed ones are used up (those the inputs explained do
        not count: see ``roll_back``)."""
        return self.must_roll_back and \
            self.rollbacks - self.input_rollbacks >= self.max_rollbacks

    def roll_back(self, inputs: list[int] | None = None, step: int = 0) -> list[int]:
        """Count a rollback, back the LR off, skip the pending windows; returns the new skips.

        ``inputs``: the samples whose inputs are non-finite, found in the bad window. They
        explain the bad step: only they join the skip list, the LR stays, and the rollback is
        not one of ``max_rollbacks`` (each bad sample causes at most one: it is never read
        again). The LR backs off only for bad steps the inputs do not explain."""
        self.rollbacks += 1
        self.rolled_from = [*self.rolled_from, step][-MAX_EVENTS:]
        if inputs:
            added = sorted(set(inputs) - set(self.skip))
            self.input_rollbacks += 1
            self.bad_inputs = sorted(set(self.bad_inputs).union(inputs))
        else:
            added = sorted({i for w in self.pending for i in w} - set(self.skip))
            self.lr_factor *= self.lr_backoff
        self.skip = sorted(set(self.skip).union(added))
        self.consecutive, self.pending = 0, []
        return added

    def totals(self) -> dict:
        return {"bad_steps": self.bad_steps, "rollbacks": self.rollbacks,
                "skipped_samples": len(self.skip)}

    _STATE = ("consecutive", "bad_steps", "rollbacks", "input_rollbacks", "lr_factor", "skip",
              "pending", "events", "good", "losses", "norms", "logged", "bad_inputs", "rolled_from")

    def state_dict(self) -> dict:
        return {k: _copy(getattr(self, k)) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:
            if k in state:
                setattr(self, k, _copy(state[k]))


def _copy(v):
    return [_copy(x) for x in v] if isinstance(v, (list, tuple)) else v


def _spikes(x: float, history: list[float], factor: float) -> bool:
    """x above median + factor * robust sigma (1.4826 * MAD). Sigma is floored at 1% of the
    median so that a flat history does not turn noise into spikes."""
    med = statistics.median(history)
    sigma = 1.4826 * statistics.median(abs(h - med) for h in history)
    return x > med + factor * max(sigma, 0.01 * abs(med), 1e-12)
