"""One tune trial: a short ``fit()`` of the user's own model, data and step, timed per step.

A trial is the real loop with ``train.max_steps`` set, checkpoints off, no validation, loggers
off and ``run.dir`` in a temporary directory, so it never writes into the user's run directory.
A callback stamps the clock after every optimizer step. The first ``warmup`` steps (workers
starting, compilation, the allocator warming up) are left out. A trial is measured in work, not
steps: it runs until its steady steps have taken ``measure_s`` seconds (so a setting 3x faster
than the baseline is measured over 3x the steps, not over a third of the time, which its
workers' prefetched batches would fill), and those steps are cut into ``repeats`` windows: a
trial's figure is the median of its windows' samples/s, and the windows' min-max is its spread.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ironloop.callbacks import Callback
from ironloop.config import Config
from ironloop.errors import Preempted
from ironloop.tools.recipe import fit_without_preflight as fit
from ironloop.tools.tune.stop import Stopped, record_signals, trial_prefix


@dataclass
class Plan:
    """How many optimizer steps a trial runs and how they are cut into measured windows."""

    warmup: int   # steps left out: workers starting, compilation, first allocations
    window: int   # steps per measured window (at the baseline's speed, when measure_s is set)
    repeats: int  # measured windows
    measure_s: float = 0.0  # seconds of steady steps to measure; 0: window x repeats steps

    #: With ``measure_s``, a trial may take this many times the planned steps (a faster setting)
    FASTER = 64

    @property
    def steps(self) -> int:
        return self.warmup + self.window * self.repeats

    @property
    def cap(self) -> int:
        """The trial's train.max_steps: the planned steps, or room for a faster setting."""
        return self.steps if not self.measure_s else \
            self.warmup + self.FASTER * self.window * self.repeats


@dataclass
class Subject:
    """What is tuned: the resolved config, a fresh copy of the model per trial, the training
    data as the user gave it, and the rest of fit()'s arguments."""

    cfg: Config
    make_model: Callable[[], nn.Module]
    train: Any
    fit_kwargs: dict = field(default_factory=dict)

    @property
    def samples(self) -> int:
        """Training samples (the sampler's epoch on one process)."""
        data = self.train
        if isinstance(data, torch.utils.data.DataLoader):
            data = data.dataset
        if isinstance(data, (tuple, list)):
            data = data[0]
        return len(data)


@dataclass
class Measure:
    """A trial's figures. Rates are samples per second of training (no validation)."""

    samples_per_s: float               # median over the windows
    spread: tuple[float, float]        # the slowest and fastest window
    windows: list[float]
    step_ms: float                     # median milliseconds per optimizer step
    extra_s: float                     # one-off seconds in the warm-up beyond its steady steps
    seconds: float                     # the whole trial, set-up included
    peak_mb: float | None = None       # CUDA: peak allocated; CPU: the process's peak RSS
    time_split: dict | None = None     # seconds per part (timing.PARTS), the whole trial

    def to_dict(self) -> dict:
        return {"samples_per_s": round(self.samples_per_s, 3),
                "spread": [round(x, 3) for x in self.spread],
                "windows": [round(x, 3) for x in self.windows],
                "step_ms": round(self.step_ms, 4), "extra_s": round(self.extra_s, 3),
                "seconds": round(self.seconds, 3), "peak_mb": self.peak_mb,
                "time_split": self.time_split}


class TrialFailed(Exception):
    """A trial that could not be measured: the message says why, in one line. ``overrun``:
    it was stopped at its deadline rather than failing."""

    def __init__(self, message: str, overrun: bool = False):
        super().__init__(message)
        self.overrun = overrun


class _Overrun(Exception):
    """Raised from the clock callback to end a trial that ran past its deadline."""


class _Enough(Exception):
    """Raised from the clock callback once the trial has measured its ``measure_s``."""


class _Clock(Callback):
    """Stamps the clock after every optimizer step; ends the trial at its deadline, or once
    its steady steps (after ``plan.warmup``) have taken ``plan.measure_s``, or at the first
    step's end after a SIGINT or SIGTERM (tools/tune/stop.py)."""

    def __init__(self, deadline: float, plan: Plan | None = None):
        self.deadline, self.plan = deadline, plan
        self.start = 0.0
        self.stamps: list[float] = []
        self.signals: list[str] = []  # names of the signals received while the trial trained

    def on_train_start(self, run, metrics: dict) -> None:
        record_signals(self.signals)
        self.start = time.perf_counter()

    def on_step_end(self, run, metrics: dict) -> None:
        if self.signals:
            raise Stopped(self.signals[0])
        now = time.perf_counter()
        self.stamps.append(now)
        if now > self.deadline:
            raise _Overrun
        p = self.plan
        if p is not None and p.measure_s and len(self.stamps) >= p.warmup + 2 * p.repeats \
                and now - self.stamps[p.warmup - 1] >= p.measure_s:
            raise _Enough


def samples_in_step(step: int, n: int, window: int) -> int:
    """Samples optimizer step ``step`` (1-based) trained on, one process: a full window except
    the ragged last step of each epoch."""
    per_epoch = math.ceil(n / window)
    return window if (step - 1) % per_epoch < per_epoch - 1 else n - (per_epoch - 1) * window


def window_rates(stamps: list[float], warmup: int, window: int, n: int,
                 step_samples: int) -> list[float]:
    """Samples/s of each full window of ``window`` steps after the first ``warmup`` steps."""
    rates = []
    first = warmup  # stamps[i] is the end of step i + 1
    while first + window < len(stamps) + 1 and first >= 1:
        end = first + window
        seconds = stamps[end - 1] - stamps[first - 1]
        samples = sum(samples_in_step(s, n, step_samples) for s in range(first + 1, end + 1))
        rates.append(samples / max(seconds, 1e-9))
        first = end
    return rates


def trial_config(cfg: Config, overrides: dict, steps: int, run_dir: Path, n: int) -> Config:
    """The user's config with the trial's overrides, made into a short measured run that writes
    only into ``run_dir`` (a temporary directory) and evaluates nothing."""
    trial = cfg.with_overrides(overrides)
    window = trial.train.batch_size * trial.train.accumulation_steps
    epochs = math.ceil(steps / math.ceil(n / window)) + 1  # max_steps, not epochs, ends it
    quiet = {"run.dir": str(run_dir), "train.max_steps": steps, "train.epochs": epochs,
             "checkpoint.enabled": False, "log.progress": "off", "log.tensorboard": False,
             "log.wandb": False, "log.mlflow": False, "profile.trace": False,
             "profile.breakdown": True, "early_stop.patience": 0, "eval.every_steps": 0,
             # the lab's and the guard's fault knobs would crash or poison a trial on purpose
             "fault.crash_at_step": 0, "fault.oom_at_step": 0, "fault.nan_at_step": [],
             "fault.nan_sample": -1}
    if trial.schedule.name == "plateau":  # it steps on evaluations, and a trial has none
        quiet["schedule.name"] = "constant"
    return trial.with_overrides(quiet)


def run_trial(subject: Subject, overrides: dict, plan: Plan, deadline: float) -> Measure:
    """Measure the subject with ``overrides``; raises TrialFailed with the reason."""
    n = subject.samples
    started = time.perf_counter()
    plan = loader_warmup(plan, subject.cfg.with_overrides(overrides))
    clock = _Clock(deadline, plan)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    split = None
    with tempfile.TemporaryDirectory(prefix=trial_prefix()) as tmp:
        cfg = trial_config(subject.cfg, overrides, plan.cap, Path(tmp), n)
        try:
            # fit() prints its time table and notices: the tune prints its own table.
            with contextlib.redirect_stdout(io.StringIO()):
                result = fit(subject.make_model(), subject.train, None, cfg,
                             callbacks=[clock], **subject.fit_kwargs)
            split = result.results.get("time_split")
        except (_Overrun, _Enough):
            pass
        except Stopped:
            raise  # a signal between fit()'s handlers (tools/tune/stop.py): not the trial's
        except Preempted as e:  # fit() stopped at the end of a step: the tune stops with it
            raise Stopped(e.signal_name) from None
        except Exception as e:  # noqa: BLE001 - OOM, worker crash, compile error: fail the trial
            raise TrialFailed(one_line(e)) from None
        finally:
            _clean_up(cfg)
    if clock.signals:  # after the trial's last step: the tune stops all the same
        raise Stopped(clock.signals[0])
    step_samples = cfg.train.batch_size * cfg.train.accumulation_steps
    plan = windows(plan, len(clock.stamps))
    plan = windows(replace(plan, warmup=settled(clock.stamps, clock.start, plan,
                                                buffered(cfg))), len(clock.stamps))
    rates = window_rates(clock.stamps, plan.warmup, plan.window, n, step_samples)
    if len(rates) < min(2, plan.repeats):
        raise TrialFailed(f"stopped at its time limit after {len(clock.stamps)} of {plan.steps} "
                          f"steps: far slower than the baseline, or the budget ran out",
                          overrun=True)
    steps = [b - a for a, b in zip(clock.stamps[plan.warmup - 1:], clock.stamps[plan.warmup:])]
    step_s = statistics.median(steps) if steps else 0.0
    warm = clock.stamps[plan.warmup - 1] - clock.start if clock.stamps else 0.0
    return Measure(samples_per_s=statistics.median(rates), spread=(min(rates), max(rates)),
                   windows=rates, step_ms=1000 * step_s,
                   extra_s=max(0.0, warm - plan.warmup * step_s),
                   seconds=time.perf_counter() - started, peak_mb=_peak_mb(cuda),
                   time_split=split)


def windows(plan: Plan, stamped: int) -> Plan:
    """A trial measured in seconds: its steady steps, cut into ``repeats`` equal windows."""
    if not plan.measure_s:
        return plan
    return replace(plan, window=max(1, (stamped - plan.warmup) // plan.repeats))


def settled(stamps: list[float], start: float, plan: Plan, depth: int) -> int:
    """The warm-up to leave out: the planned steps, or more when a step in the first half was
    far slower than the second half's (a compile, a recompile, a stall): the steps after it
    drain the ``depth`` batches the workers buffered meanwhile, so they come for free too.
    Never so many that fewer than two windows are left."""
    durations = [b - a for a, b in zip([start, *stamps], stamps)]
    half = len(durations) // 2
    if half < 2:
        return plan.warmup
    typical = statistics.median(durations[half:])
    slow = [i for i, d in enumerate(durations[:half]) if d > 5 * typical]
    warmup = max(plan.warmup, slow[-1] + 1 + depth) if slow else plan.warmup
    return warmup if len(stamps) - warmup >= 2 * plan.window else plan.warmup


def buffered(cfg: Config) -> int:
    """Batches the DataLoader's workers hold ready: ``prefetch_factor`` (2 by default) each."""
    return cfg.data.num_workers * (getattr(cfg.data, "prefetch_factor", None) or 2)


def loader_warmup(plan: Plan, cfg: Config) -> Plan:
    """Workers fill their buffer while the first batch is awaited: the steps that drain it
    come for free once, so they belong to the warm-up, not to a window."""
    return replace(plan, warmup=max(plan.warmup, 1 + buffered(cfg)))


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, short enough for a table cell."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}"[:160]


def _peak_mb(cuda: bool) -> float:
    if cuda:
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    # The process's high-water mark (Linux reports KiB): an upper bound for the trial.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _clean_up(cfg: Config) -> None:
    """Free what a trial left behind before the next one is timed."""
    if cfg.train.compile:
        torch._dynamo.reset()  # compiled graphs of this trial's model copy
    if torch.cuda.is_available():
        gc.collect()  # a full collection costs most of a second on a busy CPU: CUDA only
        torch.cuda.empty_cache()
