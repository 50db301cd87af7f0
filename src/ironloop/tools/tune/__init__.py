"""``ironloop tune``: measure the settings that make this run faster, and hand back a config.

On the user's own model, data and step, within a time budget::

    probe (3 steps: how long is a step?) -> plan the trials -> baseline
    settings that cannot change the trajectory (state/drift.py's FREE keys), greedily, each on
    top of the winners so far: data.num_workers x run.threads (together: the main process's
    threads take the cores the workers need) -> loader extras -> pin_memory (CUDA)
    settings that change it, on top of those: precision -> a larger micro-batch with the same
    global batch -> the largest micro-batch that fits (CUDA)
    train.compile last, when the budget and the run's length can repay a compile
    -> the table, RUN_DIR/tune.json, RUN_DIR/tuned.yaml

Each group is measured once per setting (a screen); the fastest settings that project more
than ``NOISE`` faster than the config they would replace are then measured in pairs against a
fresh measurement of that config (after a first winner: of the winner), interleaved (A B, B A,
A B, B A: a load that drifts during the pairs favours neither side). A setting wins when every
one of ``PAIRS`` paired ratios says it is faster and their median is more than ``NOISE`` faster
(``paired``; these and the ``Tuner`` that runs the rows are in ``tuner.py``): one lucky or
unlucky measurement cannot decide. Nothing else is applied: when nothing wins, tuned.yaml is
the input.
A trial that fails is reported and skipped. Settings that change the training trajectory are
reported apart and applied only with ``apply_trajectory_changes``.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ironloop.config import Config, load_config
from ironloop.data import build_data
from ironloop.engine.fit import as_config
from ironloop.engine.precision import resolve_device
from ironloop.errors import ConfigError, UserError, flag, speaking_python
from ironloop.state.rng import preserved_rng
from ironloop.tools.models import model_for
from ironloop.tools.tune import output, spend
from ironloop.tools.tune.rows import Row, loader_rows
from ironloop.tools.tune.stop import clean_stale, stop_on_signals
from ironloop.tools.tune.trials import Subject
from ironloop.tools.tune.tuner import COMPILE_RESERVE, Tuner

#: Seconds the whole tune may take unless told otherwise: about 2 minutes on 2 CPU cores.
DEFAULT_BUDGET = 120.0


@dataclass
class TuneResult:
    """What ``tune`` found: ``chosen`` are the trajectory-free overrides in tuned.yaml;
    ``trajectory`` the winners of the second table (in tuned.yaml only when applied)."""

    baseline: Row
    rows: list[Row]
    chosen: dict
    trajectory: dict
    applied_trajectory: bool
    speedup: float
    config: Config                    # the tuned config
    info: dict                        # device, cores, load, budget, the run's planned length
    paths: dict = field(default_factory=dict)  # tune.json, tuned.yaml




# -- the entry points ---------------------------------------------------------------------------


def run_tune(subject: Subject, budget: float,
             progress: str = "auto") -> tuple[Tuner, dict, dict]:
    """Measure; return the tuner (its rows), the chosen free overrides and the trajectory
    winners."""
    if not 0 < budget < math.inf:  # nan fails every comparison; inf never ends
        raise ConfigError(f"{flag('budget')}={budget}: must be a finite number of seconds > 0 "
                          f"(default {DEFAULT_BUDGET:.0f})")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("ironloop tune runs in one process: start it without torchrun")
    device = resolve_device(subject.cfg.run.device)
    with preserved_rng(), output.progress_bar(progress, budget) as bar:
        tuner = Tuner(subject, budget, bar)
        baseline = tuner.start(
            planned_rows=len(loader_rows(subject, {})) + 6)
        current: dict = {}   # free settings chosen in their own pairs
        kept: list[Row] = []  # free settings kept on from a clear screen, not yet confirmed
        best, trajectory, extra_on = baseline, {}, 0.0
        groups = spend.groups(subject, device, baseline.run_s, lambda: (
            COMPILE_RESERVE if tuner.left() - tuner.reserved > COMPILE_RESERVE + tuner.est_s
            else 0.0))
        for g in spend.order(groups, baseline.measured.time_split):
            for make_rows in g.makers:
                on = {**current, **{k: v for r in kept for k, v in r.overrides.items()}}
                extra_s = g.extra_s()
                winner = tuner.group(make_rows(on), on, best, extra_s, keep=g.kind == "free")
                if winner is None:
                    continue
                if g.kind == "trajectory":
                    trajectory.update(winner.overrides)  # reported; never on for the screens
                    continue
                extra_on = max(extra_on, extra_s)  # a compile on: its reserve in the pairs
                if winner.kept:
                    kept.append(winner)
                else:
                    current = {**current, **winner.overrides}
                best = winner
        tuner.largest_fit({**current, **{k: v for r in kept for k, v in r.overrides.items()}},
                          device)
        current = tuner.confirm(current, kept, extra_on)
    return tuner, current, trajectory


def tune(model: torch.nn.Module, train_data, config: Config | dict | None = None, *,
         loss_fn=None, step_fn=None, num_classes: int | None = None, optimizer=None,
         scheduler=None, budget: float = DEFAULT_BUDGET,
         apply_trajectory_changes: bool = False) -> TuneResult:
    """Measure faster settings for ``fit(model, train_data, config=config, ...)``.

    Each trial trains a fresh copy of ``model`` for a short measured run (never ``model``
    itself) with checkpoints off, in a temporary directory. Writes ``run.dir/tune.json`` and
    ``run.dir/tuned.yaml`` (the config's keys that differ from the defaults, with the chosen
    ones: ``ironloop.load_config(path)`` reads it back); ``result.config`` is the tuned Config,
    for ``fit(..., config=result.config)``. ``optimizer`` and ``scheduler`` must be factories here
    (``f(params)``, ``f(optimizer)``): each trial builds its own.
    """
    for name, value in (("optimizer", optimizer), ("scheduler", scheduler)):
        if isinstance(value, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
            raise UserError(f"tune: pass {name} as a factory (e.g. lambda params: "
                            f"torch.optim.AdamW(params)), not an instance: every trial "
                            f"trains its own copy of the model")
    cfg = as_config(config)
    if isinstance(train_data, torch.utils.data.DataLoader) and train_data.batch_size:
        cfg = cfg.with_overrides({"train.batch_size": train_data.batch_size})  # as fit() does
    pristine = copy.deepcopy(model)
    subject = Subject(cfg, lambda: copy.deepcopy(pristine), train_data,
                      {"loss_fn": loss_fn, "step_fn": step_fn, "num_classes": num_classes,
                       "optimizer": optimizer, "scheduler": scheduler})
    try:
        size = f" on {subject.samples:,} training samples"
    except TypeError:  # a dataset without len(): tuned.yaml's header names the model only
        size = ""
    tuned = f"a {type(model).__name__}{size}"
    with speaking_python():  # its notices and errors name tune()'s and fit()'s arguments
        return _finish(subject, budget, apply_trajectory_changes, None, [], tuned)


def tune_config(path: str, overrides: list[str], budget: float = DEFAULT_BUDGET,
                apply_trajectory_changes: bool = False) -> TuneResult:
    """What ``ironloop tune CONFIG [key=value ...]`` does: the config's data and model."""
    subject = config_subject(load_config(path, overrides))
    return _finish(subject, budget, apply_trajectory_changes, Path(path), overrides)


def config_subject(cfg: Config) -> Subject:
    """What a config tunes: its data, built once, and its model as ``ironloop train`` builds it
    (tools/models.py's ``model_for``: the data factory's metadata included), rebuilt from the
    same seed for every trial."""
    bundle = build_data(cfg.data)
    return Subject(cfg, lambda: model_for(cfg, bundle), bundle.train,
                   {"num_classes": bundle.num_classes, "from_config": True})


def _finish(subject: Subject, budget: float, apply: bool, path: Path | None,
            overrides: list[str], tuned: str = "") -> TuneResult:
    stale = clean_stale()
    if stale:
        print(f"tune: removed {stale} trial director{'y' if stale == 1 else 'ies'} left in "
              f"{tempfile.gettempdir()} by tunes that were killed")
    # Ctrl-C or SIGTERM raise Stopped: nothing below writes tune.json or tuned.yaml then
    with stop_on_signals():
        tuner, chosen, trajectory = run_tune(subject, budget, subject.cfg.log.progress)
    applied = {**chosen, **(trajectory if apply else {})}
    assert tuner.baseline is not None  # run_tune measured it, or raised
    result = TuneResult(
        baseline=tuner.baseline, rows=tuner.rows, chosen=chosen, trajectory=trajectory,
        applied_trajectory=apply and bool(trajectory),
        speedup=math.prod(r.gain for r in tuner.rows if r.won and r.kind == "free"),
        config=subject.cfg.with_overrides(applied),
        info=output.context(subject, tuner, budget, path, overrides))
    output.write(result, subject.cfg, path, overrides, applied, tuned)
    return result
