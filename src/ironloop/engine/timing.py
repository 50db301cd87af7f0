"""Where the time goes: a step-time breakdown the loop marks at fixed points.

The loop calls ``timer.mark(part)`` right after each piece of work; the time since the previous
mark is charged to ``part``. Because every interval is charged to exactly one part, the parts
of an epoch add up to the epoch's time by construction, and nothing is measured twice::

    for batch in loader:   mark("data")       # waiting for the DataLoader (and label checks)
    (the copy)             mark("copy")       # host-to-device copy; ~0: data/prefetch.py
                                              # issues it one batch ahead, during "data"
    step_fn(model, batch)  mark("forward")    # forward + loss
    backward               mark("backward")
    optimizer_step         mark("optimizer")  # unscale, clip, step, scheduler
    log / progress bar     mark("other")      # bookkeeping; checkpoint writes are wrapped
    validation             mark("validation")

Two one-off parts stay out of every epoch's split and out of the per-step figures: "startup",
from building the run to its first epoch (loggers such as MLflow starting, a remote's first
uploads), and "closing", after the last epoch (the test split, waiting for uploads).

How a mark reads the clock:

- **CPU**: wall time (``time.perf_counter``).
- **CUDA** (default): a CUDA event is recorded on the current stream; the events are read once
  per log step (``flush``), so the breakdown adds no host sync per step. An interval between two
  events is the GPU's timeline, idle time included: time the GPU spent waiting for the next batch
  shows up as ``data``, which is the question the breakdown answers.
- **CUDA with profile.sync=true**: the textbook method, ``torch.cuda.synchronize()`` before and
  after the forward and the backward, then wall time. Slower, but forward and backward are then
  the GPU's compute time, and the table reports them against the whole step.

``profile.trace=true`` also records a ``torch.profiler`` trace of a few steps into
``run.dir/trace`` (open it in TensorBoard or https://ui.perfetto.dev).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ironloop.outputs.time_split import EPOCH_PARTS, ONE_OFF, PARTS


class StepTimer:
    """Charges the time between consecutive marks to named parts, per epoch and per run.

    ``end_epoch()`` returns the epoch's split (seconds per part) for epochs.jsonl; time spent
    between epochs (the end-of-epoch checkpoint, written after the epoch line) goes to the run's
    totals only, so an epoch's parts add up to that epoch's ``seconds``.
    """

    def __init__(self, device: torch.device, enabled: bool = True, sync: bool = False,
                 trace_dir: Path | None = None, trace_steps: int = 3):
        self.enabled = enabled
        cuda = enabled and device.type == "cuda"
        self.sync = cuda and sync            # textbook: synchronize around forward/backward
        self.events = cuda and not sync      # CUDA events, read at log steps
        self.epoch = dict.fromkeys(EPOCH_PARTS, 0.0)
        self.total = dict.fromkeys(PARTS, 0.0)
        self.steps = 0                       # optimizer steps timed, this process
        self._last = self._built = time.perf_counter()
        self._begun = False                  # the first epoch has started
        self._pending: list[tuple[str, torch.cuda.Event]] = []
        self._prev_event: torch.cuda.Event | None = None
        self._pool: list[torch.cuda.Event] = []
        self.trace = Trace(trace_dir, trace_steps) if enabled and trace_dir else None

    # -- marks ---------------------------------------------------------------------------------

    def start_epoch(self) -> None:
        """The epoch's clock starts here; time since the previous mark belongs to the run.
        The first time, that is the run's set-up since the timer was built: "startup", a
        one-off cost (wall time on every device), kept out of the per-step parts."""
        if not self.enabled:
            return
        if not self._begun:
            self._begun = True
            now = time.perf_counter()
            self.total["startup"] += now - (self._built if self.events else self._last)
            self._last = now
            if self.events:  # the first event: later intervals are measured from it
                self.mark("startup")
        self.mark("other")
        self.flush()
        _add(self.total, self.epoch)
        self.epoch = dict.fromkeys(EPOCH_PARTS, 0.0)

    def mark(self, part: str) -> None:
        """Charge the time since the previous mark to ``part``."""
        if not self.enabled:
            return
        if self.events:
            event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
            event.record()  # asynchronous: no host sync
            self._pending.append((part, event))
        else:
            if self.sync and part in ("copy", "forward", "backward"):
                # The textbook method: wait for the GPU before and after forward and backward
                # ("copy" ends right before the forward). A host sync, on purpose.
                torch.cuda.synchronize()
            now = time.perf_counter()
            # _charge, inline: six marks a step, and a small model's step feels each call
            (self.total if part in ONE_OFF else self.epoch)[part] += now - self._last
            self._last = now
        if part == "optimizer":
            self.steps += 1
            if self.trace is not None:
                self.trace.step()

    def _charge(self, part: str, seconds: float) -> None:
        """One-off parts go to the run's totals only, never into an epoch's split."""
        (self.total if part in ONE_OFF else self.epoch)[part] += seconds

    @contextlib.contextmanager
    def part(self, part: str) -> Iterator[None]:
        """The block's time charged to ``part`` (checkpoint writes, evaluations); what came
        before it since the previous mark, to 'other'."""
        self.mark("other")
        try:
            yield
        finally:
            self.mark(part)

    def wrap(self, part: str, fn: Callable) -> Callable:
        """``fn`` with its time charged to ``part``."""
        def timed(*args, **kwargs):
            with self.part(part):
                return fn(*args, **kwargs)
        return timed

    def flush(self) -> None:
        """Read the recorded CUDA events: a host sync, so call it at log steps only."""
        if not self._pending:
            return
        self._pending[-1][1].synchronize()  # host sync (the log step syncs anyway)
        for part, event in self._pending:
            if self._prev_event is not None:
                self._charge(part, self._prev_event.elapsed_time(event) / 1000.0)
                self._pool.append(self._prev_event)
            self._prev_event = event
        self._pending.clear()

    # -- reading -------------------------------------------------------------------------------

    def end_epoch(self) -> dict[str, float]:
        """The epoch's split in seconds per part (for epochs.jsonl); starts counting the next."""
        if not self.enabled:
            return {}
        self.flush()
        row = {k: round(v, 6) for k, v in self.epoch.items()}
        _add(self.total, self.epoch)
        self.epoch = dict.fromkeys(EPOCH_PARTS, 0.0)
        return row

    def finish(self) -> dict[str, float]:
        """The run's totals (this process), everything included; stops a running trace."""
        if self.trace is not None:
            self.trace.stop()
        if not self.enabled:
            return {}
        self.mark("closing")  # since the last epoch's end: one-off, like the start-up
        self.flush()
        _add(self.total, self.epoch)
        self.epoch = dict.fromkeys(EPOCH_PARTS, 0.0)
        return {k: round(v, 6) for k, v in self.total.items()}


def _add(into: dict, more: dict) -> None:
    for k, v in more.items():
        into[k] += v


class Trace:
    """A torch.profiler trace of ``steps`` optimizer steps after one wait and one warm-up step."""

    def __init__(self, out_dir: Path, steps: int):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.remaining = 2 + steps
        self.prof: profile | None = profile(activities=activities, record_shapes=True,
                            schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                            on_trace_ready=tensorboard_trace_handler(str(out_dir)))
        self.prof.__enter__()

    def step(self) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.remaining -= 1
        if self.remaining <= 0:
            self.stop()

    def stop(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
