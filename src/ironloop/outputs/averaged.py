"""Whether the averaged weights (``average.kind``) beat the raw ones, in words: the console's
evaluation and epoch lines, the report's summary and its diagnosis all say it this way.

One evaluation row is judged on the metrics whose direction is known: the loss (lower is
better) and the accuracy (higher is better), ``val_avg_loss`` against ``val_loss`` and so on;
with named sets, the first set's. Other metrics (F1, an MSE metric, ...) are not judged: their
direction is the user's. Figures equal to the 4 figures shown (outputs/numbers.py) are "as
good as" each other. When loss and accuracy disagree, as early in a run they often do, the
words say which is which.
"""

from __future__ import annotations

from typing import NamedTuple

from ironloop.outputs.numbers import number
from ironloop.outputs.readers import num

#: The judged metrics: key suffix -> whether lower is better.
JUDGED = {"_loss": True, "_acc": False}


class MetricPair(NamedTuple):
    """One metric of one evaluation, for both weights."""

    raw_key: str     # val_loss, val_acc, or val_<set>_loss, ...
    avg_key: str     # val_avg_loss, val_avg_acc, or val_avg_<set>_loss, ...
    raw: float
    avg: float
    lower_is_better: bool

    @property
    def outcome(self) -> str:
        """"better", "worse" or "as good": the averaged weights against the raw ones."""
        if number(self.avg) == number(self.raw):
            return "as good"
        return "better" if (self.avg < self.raw) == self.lower_is_better else "worse"

    def figures(self) -> str:
        """``val_avg_loss 0.1081 < val_loss 0.1636``; accuracies in %, as the console shows
        them."""
        sign = "=" if self.outcome == "as good" else "<" if self.avg < self.raw else ">"
        return f"{self.avg_key} {self._show(self.avg)} {sign} {self.raw_key} {self._show(self.raw)}"

    def _show(self, v: float) -> str:
        return f"{100 * v:.2f}%" if self.raw_key.endswith("_acc") else number(v)


class Comparison(NamedTuple):
    """The judged metrics of one evaluation row."""

    pairs: list[MetricPair]

    @property
    def outcome(self) -> str:
        """The pairs' common outcome, or "mixed"."""
        outcomes = {p.outcome for p in self.pairs}
        return outcomes.pop() if len(outcomes) == 1 else "mixed"

    def words(self, figures: bool = True) -> str:
        """``averaged weights better than raw (val_avg_loss 0.1081 < val_loss 0.1636)``, or
        ``averaged weights worse on val_loss, better on val_acc``; the figures in brackets only
        with ``figures`` (a console line shows them already)."""
        if self.outcome == "mixed":
            text = "averaged weights " + ", ".join(f"{p.outcome} on {p.raw_key}"
                                                   for p in self.pairs)
        else:
            than = "as raw" if self.outcome == "as good" else "than raw"
            text = f"averaged weights {self.outcome} {than}"
        if not figures:
            return text
        return f"{text} ({'; '.join(p.figures() for p in self.pairs)})"


def compare(row: dict) -> Comparison | None:
    """The judged metrics of one evaluation row, or None when it has none for the averaged
    weights (no average, or an evaluation that did not run it) or none that is finite."""
    prefix = _first_set(row)
    if prefix is None:
        return None
    pairs = []
    for suffix, lower in JUDGED.items():
        raw_key, avg_key = f"val_{prefix}{suffix[1:]}", f"val_avg_{prefix}{suffix[1:]}"
        raw, avg = num(row.get(raw_key)), num(row.get(avg_key))  # finite, or None
        if raw is not None and avg is not None:
            pairs.append(MetricPair(raw_key, avg_key, raw, avg, lower))
    return Comparison(pairs) if pairs else None


def last_compared(rows: list[dict]) -> tuple[dict, Comparison] | None:
    """The last evaluation row that ran the averaged weights, with its comparison; None when
    no row did."""
    for row in reversed(rows):
        found = compare(row)
        if found is not None:
            return row, found
    return None


def _first_set(row: dict) -> str | None:
    """"" for the plain ``val_avg_loss``, "clean_" for ``val_avg_clean_loss``: the first set
    the row holds an averaged loss for; None without one."""
    for key in row:
        if key.startswith("val_avg_") and key.endswith("_loss"):
            return key.removeprefix("val_avg_").removesuffix("loss")
    return None
