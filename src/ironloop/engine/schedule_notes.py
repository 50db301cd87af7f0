"""What the LR schedule will do that the user may not have asked for, said before the first step.

Two pure functions, each returning the warning to print (or nothing):

- ``ignored_settings``: a config key the chosen schedule overrides, so setting it changes
  nothing (onecycle with ``schedule.max_lr`` sets the LR itself: ``optim.lr`` is ignored).
- ``extension_warning``: a resume that makes the run longer than its finite schedule. The
  schedule keeps the length it was built with (state/drift.py), so every step past its end runs
  at the LR of its last step, for cosine and onecycle (near) zero: the weights barely change.
"""

from __future__ import annotations

from ironloop.config import Config, OptimConfig
from ironloop.errors import option

#: A held LR at or below this share of the schedule's peak trains (almost) nothing.
NEAR_ZERO = 0.01
#: torch's OneCycleLR defaults (engine/optim.py does not change them): the LR starts at
#: max_lr / DIV and ends at max_lr / (DIV * FINAL_DIV).
ONECYCLE_DIV, ONECYCLE_FINAL_DIV = 25.0, 1e4


def ignored_settings(cfg: Config) -> list[str]:
    """Warnings for keys the schedule overrides. A key left at its default is not the user's
    choice and is not named."""
    s, lr = cfg.schedule, cfg.optim.lr
    if s.name == "onecycle" and s.max_lr > 0 and lr != OptimConfig().lr and lr != 0:
        return [f"warning: optim.lr={lr:g} has no effect: schedule.name=onecycle with "
                f"schedule.max_lr={s.max_lr:g} sets the LR itself (from "
                f"{s.max_lr / ONECYCLE_DIV:.3g} up to {s.max_lr:g}, then down). To change the "
                f"LR, set schedule.max_lr (or schedule.max_lr=0 for a peak of 10 x optim.lr)"]
    return []


def end_lr(cfg: Config) -> float:
    """The LR at the last step of a finite schedule (cosine, warmup_cosine, onecycle)."""
    s = cfg.schedule
    if s.name == "onecycle":
        peak = s.max_lr or 10 * cfg.optim.lr
        return peak / (ONECYCLE_DIV * ONECYCLE_FINAL_DIV)
    return s.eta_min


def peak_lr(cfg: Config) -> float:
    s = cfg.schedule
    return (s.max_lr or 10 * cfg.optim.lr) if s.name == "onecycle" else cfg.optim.lr


def extension_warning(name: str, built_for: int, step: int, total: int, held: float,
                      peak: float) -> str | None:
    """The warning for a run resumed at ``step`` that now ends at ``total``, past the end of
    its ``name`` schedule (``built_for`` steps), whose steps past that end run at ``held``
    (the schedule's peak: ``peak``). None when no step runs past the schedule."""
    if not built_for or total <= max(built_for, step):
        return None
    first = max(built_for, step) + 1
    share = held / peak if peak > 0 else 0.0
    effect = ("the weights will barely change" if share <= NEAR_ZERO
              else f"{share:.0%} of its peak {peak:g}")
    return (f"warning: the run now ends at step {total}, past its LR schedule: {name} was built "
            f"for {built_for} steps and keeps that length on a resume, so steps {first}-{total} "
            f"({total - first + 1} of them) run at the LR of its last step, lr {held:.3g} "
            f"({effect}). To train them at a schedule of the new length, start a fresh run "
            f"with that length ({option('overwrite')}, or another run.dir)")
