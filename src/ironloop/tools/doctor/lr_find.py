"""9. The LR range test (Smith 2015; fastai's lr_find), on a copy of the model and optimizer.

The LR grows exponentially from ``start`` to ``end`` over at most ``steps`` optimizer steps,
each on the next training batch. The loss is smoothed with a bias-corrected exponential moving
average, and the sweep stops when the smoothed loss exceeds 4x its minimum (divergence). The
suggestion is the LR where the smoothed loss falls fastest against log(LR) ("steepest descent").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ironloop.data.loader import to_device
from ironloop.engine.gradients import clip_gradients
from ironloop.tools.doctor.findings import Finding
from ironloop.tools.doctor.subject import DoctorSubject

METHOD = "steepest descent of the smoothed loss against log(LR)"


def sweep(s: DoctorSubject, start: float = 1e-7, end: float = 10.0, steps: int = 100,
          beta: float = 0.98) -> tuple[list[float], list[float]]:
    """(lrs, smoothed losses) until divergence or ``end``."""
    with s.borrowed():  # the sweep trains the model itself: its weights come back after
        return _sweep(s, start, end, steps, beta)


def _sweep(s: DoctorSubject, start: float, end: float, steps: int,
           beta: float) -> tuple[list[float], list[float]]:
    model, opt = s.copy()
    factor = (end / start) ** (1 / max(steps - 1, 1))
    lrs: list[float] = []
    smoothed: list[float] = []
    avg, best, lr = 0.0, math.inf, start
    batches: Iterator[Any] = iter(())
    for i in range(steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(s.loader())
            batch = next(batches)
        batch = to_device(batch, s.device, False)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = s.loss(model, batch)[0]
        value = float(loss.detach())  # host sync: the doctor, not the hot path
        if not math.isfinite(value):
            break
        avg = beta * avg + (1 - beta) * value
        smooth = avg / (1 - beta ** (i + 1))  # bias correction for the first steps
        if smooth > 4 * best:
            break
        best = min(best, smooth)
        lrs.append(lr)
        smoothed.append(smooth)
        loss.backward()
        clip_gradients(model.parameters(), s.cfg.clip.max_norm, s.cfg.clip.mode)
        opt.step()
        lr *= factor
    return lrs, smoothed


def suggest(lrs: list[float], losses: list[float]) -> float | None:
    """The LR of the steepest fall of the loss against log(LR), before the minimum."""
    if len(lrs) < 5:
        return None
    lowest = min(range(len(losses)), key=losses.__getitem__)
    slopes = [(losses[i + 1] - losses[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i]))
              for i in range(max(lowest, 1))]
    return lrs[min(range(len(slopes)), key=slopes.__getitem__)]


def plot(lrs: list[float], losses: list[float], best: float | None, configured: float,
         out: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.0), dpi=120)
    ax = fig.subplots()
    ax.plot(lrs, losses, lw=1.3, label="smoothed loss")
    if best is not None:
        ax.axvline(best, color="C2", ls="--", label=f"suggested {best:.2e} ({METHOD})")
    ax.axvline(configured, color="C3", ls=":", label=f"optim.lr = {configured:.2e}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="loss (smoothed)",
           title="LR range test")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def check_lr_find(s: DoctorSubject, out: Path, steps: int = 100) -> list[Finding]:
    """Run the sweep, write ``out`` (lr_find.png), and compare the suggestion with optim.lr."""
    lrs, losses = sweep(s, steps=steps)
    best = suggest(lrs, losses)
    lr = s.cfg.optim.lr
    plot(lrs, losses, best, lr, out)
    if best is None:
        return [Finding("lr_find", "warning", f"the loss diverged within {len(lrs)} steps of "
                        f"the sweep (from 1e-7)", "the model is unstable at any LR",
                        "check the initial_loss and probabilities findings first")]
    at_min = lrs[min(range(len(losses)), key=losses.__getitem__)]
    measured = (f"suggested LR {best:.2e} ({METHOD}); lowest loss at {at_min:.2e}; "
                f"optim.lr={lr:g}; plot in {out}")
    if lr > at_min:
        return [Finding("lr_find", "warning", measured,
                        "optim.lr is past the loss minimum of the sweep, where it diverges",
                        f"lower optim.lr to about {best:.1e}")]
    if lr < best / 30:
        return [Finding("lr_find", "warning", measured,
                        "optim.lr is far below where the loss falls fastest: training will "
                        "be slow or flat", f"raise optim.lr to about {best:.1e}")]
    return [Finding("lr_find", "info", measured, "", "")]
