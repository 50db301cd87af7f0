"""The plots of a run's logs, one PNG each: the loss, the LR, the gradient norms and their
histogram, accuracy or validation curves, averaged weights against raw, and a resume's curve
(``tools/report.py`` writes them with the summary; ``tools/lab`` draws its own from these).
Readers are tolerant: missing keys, nulls, NaNs and a partial line left by a crash are skipped.
matplotlib is imported lazily and figures use the object API (``matplotlib.figure.Figure``),
which renders PNGs with Agg without switching pyplot's global backend (a notebook keeps its own).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from ironloop.outputs.readers import continuous, num

DPI = 120
SIZE = (7.0, 4.0)


def values_of(rows: Iterable[dict], key: str) -> list[float]:
    return [v for v in (num(r.get(key)) for r in rows) if v is not None]


def _xy(rows: Iterable[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(a, b) for r in rows
           if (a := num(r.get(x))) is not None and (b := num(r.get(y))) is not None]
    return [a for a, _ in pts], [b for _, b in pts]


def crash_steps(rows: Sequence[dict]) -> list[int]:
    """The last step logged before each point where the step counter goes back (a resume)."""
    steps = values_of(rows, "step")
    return [int(a) for a, b in pairwise(steps) if b <= a]


def clipped_fraction(rows: Sequence[dict], max_norm: float | None) -> float | None:
    """Share of optimizer steps whose pre-clip norm exceeded ``max_norm``: sum(clipped)/sum(steps)
    over rows carrying both; else the share of logged grad_norm values above ``max_norm``; None
    when neither is known (no counts, and clipping disabled or no norms)."""
    clipped, steps = _xy(rows, "clipped", "steps")
    if sum(steps) > 0:
        return sum(clipped) / sum(steps)
    norms, thr = values_of(rows, "grad_norm"), _threshold(max_norm)
    return sum(v > thr for v in norms) / len(norms) if norms and thr else None


def _threshold(max_norm: Any) -> float | None:
    v = num(max_norm)
    return v if v and v > 0 else None


def _figure(nrows: int = 1, ncols: int = 1, size=SIZE, **kw):
    from ironloop.extras import require

    Figure = require("matplotlib.figure", "plots", "drawing plots").Figure
    fig = Figure(figsize=size, dpi=DPI)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw).ravel()


def _save(fig, out: Path | str) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    fig.clear()  # frees the artists now; the Figure was never registered with pyplot
    return out


def _note(ax, msg: str, ticks: bool = True) -> None:
    ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes, color="0.4",
            zorder=5, bbox={"facecolor": "white", "edgecolor": "none"})
    if not ticks:
        ax.set_xticks([])
        ax.set_yticks([])


def _spans(values: Sequence[float], decades: float) -> bool:
    return bool(values) and min(values) > 0 and max(values) / min(values) > 10**decades


def _finish(ax, drawn: bool, empty: str, **labels) -> None:
    if drawn:
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)  # grid behind histogram bars too
    else:
        _note(ax, empty, ticks=False)
    ax.set(**labels)


def coinciding(runs: dict[str, list[dict]], x: str, key: str) -> list[tuple[list[str], tuple]]:
    """([names], (xs, ys)) per distinct curve: variants whose curves are identical (checkpointing
    does not change the weights, so the lab's later steps often are) share one entry."""
    groups: dict[tuple, list[str]] = {}
    for name, rows in runs.items():
        xs, ys = _xy(continuous(rows), x, key)
        if xs:
            groups.setdefault((tuple(xs), tuple(ys)), []).append(name)
    return [(names, curve) for curve, names in groups.items()]


def _per_step(runs: dict[str, list[dict]], key: str, out, log: bool, x: str = "step",
              xlabel: str = "optimizer step", **labels) -> Path:
    """One line per variant of ``key`` vs ``x`` (the optimizer step unless told otherwise);
    identical curves are drawn once, labelled with every name and "(identical)"."""
    fig, (ax,) = _figure()
    ys_all: list[float] = []
    for i, (names, (xs, ys)) in enumerate(coinciding(runs, x, key)):
        label = names[0] if len(names) == 1 else " = ".join(names) + " (identical)"
        # line styles cycle too, so overlapping variants stay distinguishable
        ax.plot(xs, ys, lw=1.3, label=label, ls=("-", "--", ":", "-.")[i // 10 % 4])
        ys_all += ys
    if log and _spans(ys_all, 2):
        ax.set_yscale("log")
    elif ys_all and not log:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    _finish(ax, bool(ys_all), f"no {labels['ylabel']} recorded", xlabel=xlabel, **labels)
    return _save(fig, out)


def plot_loss_curves(runs: dict[str, list[dict]], out, title: str = "Training loss",
                     x: str = "step", xlabel: str = "optimizer step") -> Path:
    """Train loss vs optimizer step (or another x key), one line per variant; log y when it
    spans > 2 decades. Variants with different steps per epoch compare better with x="epochs"."""
    return _per_step(runs, "loss", out, True, x=x, xlabel=xlabel, ylabel="train loss",
                     title=title)


def plot_lr(runs: dict[str, list[dict]], out) -> Path:
    return _per_step(runs, "lr", out, False, ylabel="learning rate", title="Learning rate")


def _clip_title(rows: Sequence[dict], max_norm: float | None) -> str:
    frac = clipped_fraction(rows, max_norm)
    if _threshold(max_norm) is None and not frac:
        return "clipping disabled"
    return "clipped: " + ("n/a" if frac is None else f"{frac:.1%} of optimizer steps")


def linear_bins(values: Sequence[float], n: int = 40) -> list[float]:
    """``n`` equal bins over the values' range; one bin a tenth of their size wide around them
    when that range is too narrow for ``n`` distinct edges (one value, or equal ones): numpy's
    own ``bins=n`` refuses a range of one value of 4e14 ("Too many bins for data range"), whose
    unit-wide default range holds fewer than ``n`` representable edges."""
    lo, hi = min(values), max(values)
    scale = max(abs(lo), abs(hi))
    if hi - lo > 1e-6 * scale:  # far above a float's resolution at this size
        return [lo + (hi - lo) * i / n for i in range(n + 1)]
    pad = 0.05 * scale or 0.5
    return [lo - pad, hi + pad]


def plot_grad_norm_hist(rows: list[dict], max_norm: float | None, out) -> Path:
    """Histogram of logged pre-clip norms, the clip threshold, the clipped fraction in the title."""
    import numpy as np

    fig, (ax,) = _figure()
    norms, thr = values_of(rows, "grad_norm"), _threshold(max_norm)
    if norms:
        bins: Any
        if _spans(norms, 1.5):
            bins = np.logspace(math.log10(min(norms)), math.log10(max(norms)), 41)
            ax.set_xscale("log")
        else:
            bins = linear_bins(norms)
        ax.hist(norms, bins=bins, color="C0", label=f"logged steps (n={len(norms)})")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # headroom for the legend
        if thr is not None:
            ax.axvline(thr, color="C3", ls="--", lw=1.5, label=f"clip threshold = {thr:g}")
    _finish(ax, bool(norms), "no grad norm recorded", xlabel="pre-clip global grad norm",
            ylabel="count", title=f"Gradient norm distribution ({_clip_title(rows, max_norm)})")
    return _save(fig, out)


def _interval_clip(row: dict, thr: float | None) -> float:
    """Share of the steps a metrics row covers that were clipped (its own norm when uncounted)."""
    c, n = num(row.get("clipped")), num(row.get("steps"))
    if c is not None:
        return min(1.0, c / n) if n else float(c > 0)
    return float(thr is not None and (num(row.get("grad_norm")) or 0) > thr)


def plot_grad_norm(rows: list[dict], max_norm: float | None, out) -> Path:
    """Pre-clip norm vs step, the threshold, red dots sized by the share of steps clipped."""
    fig, (ax,) = _figure()
    rows, thr = continuous(rows), _threshold(max_norm)
    xs, ys = _xy(rows, "step", "grad_norm")
    if xs:
        ax.plot(xs, ys, lw=1.0, color="C0", label="pre-clip grad norm")
        hit = [(x, y, _interval_clip(r, thr)) for r in rows
               for x, y in [(num(r.get("step")), num(r.get("grad_norm")))] if y is not None]
        hit = [h for h in hit if h[2] > 0]
        if hit:
            x, y, share = zip(*hit)
            ax.scatter(x, y, s=[4 + 20 * v for v in share], color="C3", zorder=3,
                       label="clipped since last log (size: share)")
        if thr is not None:
            ax.axhline(thr, color="C3", ls="--", lw=1.2, label=f"clip threshold = {thr:g}")
        if _spans(ys, 2):
            ax.set_yscale("log")
    _finish(ax, bool(xs), "no grad norm recorded", xlabel="optimizer step",
            ylabel="pre-clip global grad norm",
            title=f"Gradient norm ({_clip_title(rows, max_norm)})")
    return _save(fig, out)


def as_percent(values: list[float]) -> list[float]:
    """Accuracies as %: fractions are scaled by 100; values already above 1 are kept."""
    return values if values and max(values) > 1 else [v * 100 for v in values]


def plot_accuracy(epoch_rows: list[dict], out) -> Path:
    """Left: train and val loss per epoch. Right: val accuracy (%) per epoch, or a language
    model's val perplexity."""
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = _figure(1, 2, size=(9.0, 4.0))
    rows = continuous(epoch_rows, "epoch")
    drawn = False
    for key in ("train_loss", "val_loss"):
        xs, ys = _xy(rows, "epoch", key)
        if xs:
            left.plot(xs, ys, marker="o", label=key.replace("_", " "))
            drawn = True
    _finish(left, drawn, "no epochs recorded", xlabel="epoch", ylabel="loss",
            title="Loss per epoch")
    _accuracy_or_perplexity(right, rows, "epoch", "epoch")
    for ax in (left, right):
        if ax.get_xticks().size:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, out)


def plot_validation(eval_rows: list[dict], out) -> Path:
    """A step-based run (no epoch ended), from evals.jsonl: val loss vs step on the left; on
    the right val accuracy, or for a language model (no accuracy) val perplexity."""
    fig, (left, right) = _figure(1, 2, size=(9.0, 4.0))
    rows = continuous(eval_rows)
    xs, ys = _xy(rows, "step", "val_loss")
    if xs:
        left.plot(xs, ys, marker="o", ms=3, color="C0", label="val loss")
    _finish(left, bool(xs), "no evaluations recorded", xlabel="optimizer step",
            ylabel="validation loss", title="Validation loss per evaluation")
    _accuracy_or_perplexity(right, rows, "step", "optimizer step")
    return _save(fig, out)


def _accuracy_or_perplexity(ax, rows: list[dict], x: str, xlabel: str) -> None:
    """The right panel: val accuracy (%), else val perplexity (a language model's), each on
    its own labelled axis; a note when the run recorded neither."""
    xs, ys = _xy(rows, x, "val_acc")
    if xs:
        ax.plot(xs, as_percent(ys), marker="o", ms=3, color="C2")
        ax.grid(alpha=0.3)
        ax.set(xlabel=xlabel, ylabel="validation accuracy (%)", title="Validation accuracy")
        return
    xs, ys = _xy(rows, x, "val_ppl")
    if xs:
        ax.plot(xs, ys, marker="o", ms=3, color="C1")
        ax.grid(alpha=0.3)
        if _spans(ys, 1):
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel="validation perplexity", title="Validation perplexity")
        return
    _note(ax, "no validation accuracy or perplexity recorded", ticks=False)
    ax.set(xlabel=xlabel, title="Validation accuracy")


def averaged_pairs(eval_rows: list[dict]) -> list[tuple[str, str]]:
    """(raw key, averaged key) for every metric evaluated with both weights (average.kind):
    val_loss / val_avg_loss, val_clean_acc / val_avg_clean_acc, ..."""
    keys = dict.fromkeys(k for r in eval_rows for k in r)
    return [(f"val_{k.removeprefix('val_avg_')}", k) for k in keys
            if k.startswith("val_avg_") and f"val_{k.removeprefix('val_avg_')}" in keys]


def plot_averaged(eval_rows: list[dict], out) -> Path:
    """Raw and averaged weights per evaluation: losses on the left, the other metrics
    (accuracy, F1, ...) on the right; raw solid, averaged dashed, one colour per metric."""
    fig, (left, right) = _figure(1, 2, size=(9.0, 4.0))
    rows = continuous(eval_rows)
    drawn = {left: False, right: False}
    pairs = averaged_pairs(rows)
    for i, (raw, avg) in enumerate(pairs):
        ax = left if raw.endswith("_loss") else right
        for key, style, shade in ((raw, "-", f"C{2 * i}"), (avg, "--", f"C{2 * i + 1}")):
            xs, ys = _xy(rows, "step", key)
            if xs:
                ax.plot(xs, ys, style, marker="o", ms=3, color=shade,
                        label=key.replace("_", " "))
                drawn[ax] = True
    for ax, what in ((left, "loss"), (right, "metric")):
        _finish(ax, drawn[ax], f"no averaged {what} recorded", xlabel="optimizer step",
                title=f"Raw and averaged weights: {what}")
    return _save(fig, out)


def plot_resume_curve(metric_rows, epoch_rows, out, resumes: Sequence[dict] = (),
                      crash_step: int | Sequence[int] | None = None) -> Path:
    """Train loss (top) and val acc at each epoch end (bottom) vs step, each as one trajectory,
    with a red line at each crash step and a green dashed line at each resume step."""
    fig, (top, bottom) = _figure(2, 1, size=(7.0, 5.5), sharex=True)
    xs, ys = _xy(continuous(metric_rows), "step", "loss")
    if xs:
        top.plot(xs, ys, lw=1.2, color="C0", label="train loss")
        top.set_yscale("log" if _spans(ys, 2) else "linear")
    ax, ay = _xy(continuous(epoch_rows, "epoch"), "step", "val_acc")
    if ax:
        bottom.plot(ax, as_percent(ay), marker="o", color="C2", label="val acc (epoch end)")
    else:
        _note(bottom, "no validation accuracy recorded")
    crashes = [crash_step] if isinstance(crash_step, (int, float)) else list(crash_step or ())
    for panel in (top, bottom):
        for c in crashes:
            panel.axvline(c, color="red", lw=1.5, label=f"crash (step {int(c)})")
        for s in values_of(resumes, "step"):
            panel.axvline(s, color="green", ls="--", lw=1.5, label=f"resumed from step {int(s)}")
        panel.grid(alpha=0.3)
    top.legend(fontsize="small")
    top.set(ylabel="train loss", title="Crash and resume")
    bottom.set(xlabel="optimizer step", ylabel="validation accuracy (%)")
    return _save(fig, out)
