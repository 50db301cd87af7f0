"""A finite divergence the guard's checks do not catch: the loss growing far past where it
started (a loss of 1e30 is finite, so no NaN/inf check fires, and the spike check is opt-in).

``LossGrowth`` reads only the losses the log steps already brought to the host (metrics.jsonl's
``loss``), so it adds no device sync. It warns once per process, when a logged loss exceeds
``log.loss_growth`` x the run's first logged loss; a loss that starts at or below 0 (a
log-likelihood bound, say) has no relative bound and is never judged. The baseline is part of
the checkpoint (``state_dict``): a run resumed late, its loss long since fallen, is judged
against where the run started, not against the first loss the resumed process logged.
"""

from __future__ import annotations

import math

from ironloop.outputs.numbers import number


class LossGrowth:
    """Warn once when the logged loss grows past ``factor`` x the run's first logged value.

    ``max_norm`` and ``spike_factor`` are the run's ``clip.max_norm`` and
    ``guard.spike_factor``: the advice suggests only what is off, and names what is on."""

    def __init__(self, factor: float, max_norm: float = 0.0, spike_factor: float = 0.0):
        self.factor = factor
        self.max_norm = max_norm
        self.spike_factor = spike_factor
        self.start: float | None = None
        self.warned = False

    def state_dict(self) -> dict:
        """The baseline (the run's first logged loss), for the checkpoint. ``warned`` is not
        kept: a resumed process that still diverges says so once more."""
        return {"start": self.start}

    def load_state_dict(self, state: dict | None) -> None:
        """Put the run's baseline back (None: a checkpoint from before it was kept, or written
        before the first log step; this process's first logged loss becomes the baseline)."""
        self.start = (state or {}).get("start")

    def check(self, step: int, loss: float) -> str | None:
        """The warning line for this log step's (host) loss, or None."""
        if not self.factor or self.warned or not math.isfinite(loss):
            return None  # a non-finite loss is the guard's to report
        if self.start is None:
            self.start = loss
            return None
        if self.start <= 0 or loss <= self.factor * self.start:
            return None
        self.warned = True
        return (f"warning: the loss grew to {number(loss)} at step {step}, "
                f"{number(loss / self.start)} x its first logged value {number(self.start)} "
                f"(log.loss_growth={self.factor:g}): the run is diverging{self._advice()}")

    def _advice(self) -> str:
        """What to try, for this run: a knob already on is named, not suggested again."""
        on = []
        tips = ["lower optim.lr"]
        if self.max_norm:
            on.append(f"clip.max_norm={self.max_norm:g}")
        else:
            tips.append("set clip.max_norm")
        if self.spike_factor:
            on.append(f"guard.spike_factor={self.spike_factor:g}")
        else:
            tips.append("turn on guard.spike_factor to skip such steps")
        said = f" with {' and '.join(on)} on" if on else ""
        return f"{said}; " + (", ".join(tips[:-1]) + ", or " + tips[-1] if len(tips) > 2
                              else " or ".join(tips))
