"""A finite divergence the guard's checks do not catch: the loss growing far past where it
started (a loss of 1e30 is finite, so no NaN/inf check fires, and the spike check is opt-in).

``LossGrowth`` reads only the losses the log steps already brought to the host (metrics.jsonl's
``loss``), so it adds no device sync. It warns once per process, when a logged loss exceeds
``log.loss_growth`` x the first loss this process logged; a loss that starts at or below 0
(a log-likelihood bound, say) has no relative bound and is never judged.
"""

from __future__ import annotations

import math

from ironloop.outputs.numbers import number


class LossGrowth:
    """Warn once when the logged loss grows past ``factor`` x its first logged value."""

    def __init__(self, factor: float):
        self.factor = factor
        self.start: float | None = None
        self.warned = False

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
                f"(log.loss_growth={self.factor:g}): the run is diverging; lower "
                f"optim.lr, set clip.max_norm, or turn on guard.spike_factor to skip such steps")
