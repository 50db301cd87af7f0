"""Where ``ironloop tune`` spends its budget: which group of rows goes first, what a row is
expected to cost, and when a screen is clear enough that its setting stays on for the next
screens. Pure decisions on rows and figures: the package (``__init__.py``) wires them in.

A screen is one measurement, and paired runs cost ``2 * PAIRS`` trials. Paying for pairs after
every group spent the H200's budget on the first group's pairs (workers, 3.49x) and left none
for the next (pin_memory screened at 5.17x, never confirmed). So a setting that screens
*clearly* faster stays on while the next groups are screened (each screen learns on top of
it), and the settings kept that way are confirmed once, together, by paired runs at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ironloop.tools.tune.rows import (
    Row,
    compile_rows,
    cpus,
    cuda_graph_rows,
    loader_extra_rows,
    loader_rows,
    micro_batch_rows,
    pin_rows,
    precision_rows,
)
from ironloop.tools.tune.trials import Subject

#: A screen is clearly faster when it projects more than this much faster than the best so far
#: and its slowest window beats the best's fastest: well beyond NOISE (5%), so one lucky
#: measurement rarely keeps a setting on, and the combination's pairs still decide.
CLEAR = 0.20


@dataclass
class Group:
    """Rows tried together, one group at a time: ``makers`` build the rows on top of the
    settings on so far (run in order: persistent workers only mean something once workers
    are on); ``parts`` are the time split's parts the group can speed up, ``factor`` by about
    how much (a prior, used only to order the groups)."""

    name: str
    makers: tuple[Callable[[dict], list[Row]], ...]
    kind: str = "free"       # "free": may stay on and be applied; "trajectory": reported
    parts: tuple[str, ...] = ()
    factor: float = 1.0
    extra_s: Callable[[], float] = lambda: 0.0  # seconds beyond a trial's usual (a compile)


def expected_gain(split: dict | None, parts: tuple[str, ...], factor: float) -> float:
    """Amdahl's bound on the run-time gain of making ``parts`` ``factor`` times faster, from
    the baseline's time split (seconds per part). Without a split every group expects 1.0."""
    if not split or not parts or factor <= 1.0:
        return 1.0
    whole = sum(split.values())
    if whole <= 0:
        return 1.0
    share = min(1.0, sum(split.get(p, 0.0) for p in parts) / whole)
    return 1.0 / ((1.0 - share) + share / factor)


def order(groups: list[Group], split: dict | None) -> list[Group]:
    """The groups by expected gain, largest first: the budget goes where the gain is, and a
    group cut off by the budget is the one expected to gain least. Ties (no split) keep the
    order given."""
    return sorted(groups, key=lambda g: -expected_gain(split, g.parts, g.factor))


def row_cost(trial_s: float, extra_s: float = 0.0) -> float:
    """A row's expected seconds before it starts: trials are measured in work (the baseline's
    steps at the baseline's measured step time, ``trial_s`` with its set-up), so a faster
    setting takes about as long; plus its one-off extra (a compile)."""
    return trial_s + extra_s


def confirm_cost(trial_s: float, pairs: int, extra_s: float = 0.0) -> float:
    """Seconds the paired runs of one combination take: ``pairs`` pairs of two trials."""
    return 2 * pairs * trial_s + pairs * extra_s


def clearly_faster(row: Row, best: Row, clear: float = CLEAR) -> bool:
    """The screen alone is evidence enough to keep ``row`` on for the next screens."""
    if row.status != "ok" or best.measure is None:
        return False
    beats_windows = row.measured.spread[0] > best.measured.spread[1]
    return row.run_s < best.run_s * (1 - clear) and beats_windows


def apportion(rows: list[Row], ratios: list[float], median: float) -> list[float]:
    """Each kept row's share of the combination's confirmed gain ``median``: its screened gain
    over what it was screened on (``ratios``), scaled so that the shares multiply to ``median``
    (the table's speedup is the product of the chosen rows' gains)."""
    logs = [math.log(max(r, 1e-9)) for r in ratios]
    total = sum(logs)
    if len(rows) == 1 or total <= 0:
        return [median] + [1.0] * (len(rows) - 1)
    return [math.exp(math.log(median) * x / total) for x in logs]


def groups(subject: Subject, device: torch.device, base_run: float,
           compile_extra: Callable[[], float]) -> list[Group]:
    """The groups of rows in their default order, each with the time-split parts it can speed
    up and a rough factor (priors that only order them). Workers and threads are one group,
    since they share the cores; the loader extras follow them. ``base_run``: the baseline's
    projected run; ``compile_extra``: the seconds to hold for a compile, asked when it starts."""
    model = subject.make_model()
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    cuda = device.type == "cuda"
    return [
        Group("loader", (lambda cur: loader_rows(subject, cur),
                         lambda cur: loader_extra_rows(subject, cur)),
              parts=("data",), factor=float(max(2, min(8, cpus())))),
        Group("pin", (lambda cur: pin_rows(subject, device),), parts=("copy",), factor=2.0),
        Group("precision", (lambda cur: precision_rows(subject, device),), kind="trajectory",
              parts=("forward", "backward"), factor=2.0 if cuda else 1.3),
        Group("micro-batch", (lambda cur: micro_batch_rows(subject, has_bn),),
              kind="trajectory", parts=("optimizer", "other"), factor=2.0),
        Group("compile", (lambda cur: compile_rows(subject, base_run),),
              parts=("forward", "backward"), factor=1.3, extra_s=compile_extra),
        Group("cuda_graph", (lambda cur: cuda_graph_rows(subject, device),),
              parts=("forward", "backward", "optimizer", "other"), factor=1.2),
    ]
