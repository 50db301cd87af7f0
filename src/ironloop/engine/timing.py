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
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

#: The parts of the breakdown, in the order they happen. "other" is the loop's own bookkeeping.
PARTS = ("data", "copy", "forward", "backward", "optimizer", "average", "checkpoint", "validation",
         "other")
#: Parts that make up a training step (the rest is checkpoints and validation).
STEP_PARTS = ("data", "copy", "forward", "backward", "optimizer", "average", "other")


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
        self.epoch = dict.fromkeys(PARTS, 0.0)
        self.total = dict.fromkeys(PARTS, 0.0)
        self.steps = 0                       # optimizer steps timed, this process
        self._last = time.perf_counter()
        self._pending: list[tuple[str, torch.cuda.Event]] = []
        self._prev_event: torch.cuda.Event | None = None
        self._pool: list[torch.cuda.Event] = []
        self.trace = Trace(trace_dir, trace_steps) if enabled and trace_dir else None

    # -- marks ---------------------------------------------------------------------------------

    def start_epoch(self) -> None:
        """The epoch's clock starts here; time since the previous mark belongs to the run."""
        if not self.enabled:
            return
        self.mark("other")
        self.flush()
        _add(self.total, self.epoch)
        self.epoch = dict.fromkeys(PARTS, 0.0)

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
            self.epoch[part] += now - self._last
            self._last = now
        if part == "optimizer":
            self.steps += 1
            if self.trace is not None:
                self.trace.step()

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
                self.epoch[part] += self._prev_event.elapsed_time(event) / 1000.0
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
        self.epoch = dict.fromkeys(PARTS, 0.0)
        return row

    def finish(self) -> dict[str, float]:
        """The run's totals (this process), everything included; stops a running trace."""
        if self.trace is not None:
            self.trace.stop()
        if not self.enabled:
            return {}
        self.mark("other")
        self.flush()
        _add(self.total, self.epoch)
        self.epoch = dict.fromkeys(PARTS, 0.0)
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


# -- the end-of-run table ----------------------------------------------------------------------


def table(total: dict[str, float], steps: int, device: torch.device, sync: bool,
          run: RunSettings, tokens_per_s: float | None = None) -> str:
    """The run's time split as a text table, plus the advice its numbers call for; and the
    training throughput in tokens/s when the step reports its tokens."""
    if not total:
        return ""
    whole = sum(total.values()) or 1e-12
    how = ("wall time" if device.type != "cuda" else
           "wall time, synchronized around forward/backward" if sync else "CUDA events")
    lines = [f"time split ({how}; {whole:.2f} s, {steps} optimizer steps):",
             f"  {'part':<11}{'seconds':>9}{'share':>8}{'ms/step':>10}"]
    for part in PARTS:
        sec = total.get(part, 0.0)
        if part == "average" and not sec:
            continue  # a run without weight averaging (average.kind=none)
        per = f"{1000 * sec / steps:.2f}" if steps and part in STEP_PARTS else ""
        lines.append(f"  {part:<11}{sec:9.3f}{100 * sec / whole:7.1f}%{per:>10}")
    step_time = sum(total.get(p, 0.0) for p in STEP_PARTS)
    if sync and step_time:
        gpu = total.get("forward", 0.0) + total.get("backward", 0.0)
        lines.append(f"  GPU compute (forward + backward): {100 * gpu / step_time:.1f}% "
                     f"of step time")
    if tokens_per_s:
        lines.append(f"  tokens/s (training, every process): {tokens_per_s:,.0f}")
    lines += [f"  advice: {a}" for a in advice(total, run)]
    return "\n".join(lines)


@dataclass(frozen=True)
class RunSettings:
    """What the run already uses, so that advice names only a step that is still open."""

    device: str = "cpu"           # the device's type: cpu, cuda, mps
    num_workers: int = 0          # data.num_workers
    cores: int = 1                # the cores this process may run on
    threads: int = 1              # torch's intra-op threads in the run (run.threads, resolved)
    pin_memory: bool = False      # data.pin_memory, as applied (CUDA only)
    optimizer: str = "loop"       # the optimizer's kernel: fused, foreach, or loop (per tensor)
    fused_open: bool = False      # a fused kernel exists for this optimizer and device
    checkpoint_async: bool = False
    checkpoint_every_steps: int = 0  # 0: at epoch ends only
    precision: str = "fp32"
    bf16_open: bool = False       # this device runs bf16 natively (CUDA with bf16 support)


def advice(total: dict[str, float], run: RunSettings) -> list[str]:
    """What the numbers call for, one line per bottleneck, naming only what ``run`` does not
    do already; a bottleneck with no setting left to change gets no line."""
    step_time = sum(total.get(p, 0.0) for p in STEP_PARTS)
    whole = sum(total.values())
    if not step_time or not whole:
        return []
    share = {p: total.get(p, 0.0) / step_time for p in STEP_PARTS}
    lines = [_data_advice(share["data"], run), _copy_advice(share["copy"], run),
             _optimizer_advice(share, run), _precision_advice(share, run),
             _checkpoint_advice(total.get("checkpoint", 0.0) / whole, run)]
    return [line for line in lines if line]


def _data_advice(data: float, run: RunSettings) -> str:
    if data <= 0.10:
        return ""
    steps, workers = [], run.num_workers
    if run.num_workers < run.cores:
        steps.append(f"raise data.num_workers (now {run.num_workers}; {run.cores} cores)")
        workers = max(run.num_workers + 1, min(run.cores, 2))  # the workers that would run
    leave = max(1, run.cores - workers)
    if run.device == "cpu" and workers and run.threads > leave:
        # torch's threads spin-wait between ops on the cores the workers need
        steps.append(f"set run.threads={leave} (now {run.threads}) so torch leaves the "
                     f"workers their cores")
    if run.device == "cuda" and not run.pin_memory:
        steps.append("set data.pin_memory=true")
    if not steps:
        steps.append(f"the {run.num_workers} workers already have every core: make "
                     f"__getitem__ cheaper (decode once and cache, lighter augmentation)")
    return (f"data wait is {100 * data:.0f}% of step time: {'; '.join(steps)}; "
            f"`{tune_command()}` measures the options on this run and writes a faster config")


def _copy_advice(copy: float, run: RunSettings) -> str:
    if copy <= 0.10 or run.device != "cuda":
        return ""
    step = ("keep the dataset on the device (pinned memory is already on)" if run.pin_memory
            else "set data.pin_memory=true")
    return f"host-to-device copies are {100 * copy:.0f}% of step time: {step}"


def _optimizer_advice(share: dict[str, float], run: RunSettings) -> str:
    opt = share["optimizer"]
    if opt <= 0.3 or opt <= share["forward"] + share["backward"] or run.optimizer == "fused":
        return ""
    if run.fused_open:
        step = f"set optim.fused=true (now the {run.optimizer} kernel)"
    elif run.optimizer == "loop":
        step = "set optim.foreach=true (one kernel per step for all tensors)"
    else:
        return ""  # foreach, and no fused kernel here: nothing left to switch on
    return (f"the optimizer step is {100 * opt:.0f}% of step time, more than forward + "
            f"backward: {step}")


def _precision_advice(share: dict[str, float], run: RunSettings) -> str:
    compute = share["forward"] + share["backward"]
    if compute <= 0.6 or run.precision != "fp32" or not run.bf16_open:
        return ""
    return (f"forward + backward are {100 * compute:.0f}% of step time in fp32: "
            f"train.precision=bf16 runs them faster on this device (it changes the "
            f"trajectory; `{tune_command()} --apply-trajectory-changes` measures it)")


def _checkpoint_advice(stall: float, run: RunSettings) -> str:
    if stall <= 0.10:
        return ""
    every = run.checkpoint_every_steps
    fewer = f"raise checkpoint.every_steps (now {every}) or set it to 0 (epoch ends only)"
    if not run.checkpoint_async:
        step = "set checkpoint.async=true" + (f", or {fewer}" if every else "")
    elif every:
        step = f"checkpoint.async is already on: {fewer}"
    else:
        return ""  # async, at epoch ends only: nothing left but fewer epochs
    return f"checkpoint writes stall the run {100 * stall:.0f}% of the time: {step}"


def tune_command(argv: list[str] | None = None) -> str:
    """How to tune this run: ``ironloop tune`` with the config and overrides of an ``ironloop
    train`` (or ``doctor``) command line, else the Python call."""
    argv = sys.argv if argv is None else argv
    if len(argv) > 2 and argv[1] in ("train", "doctor"):
        config = next((a for a in argv[2:] if a.endswith((".yaml", ".yml"))
                       and not a.startswith("-")), None)
        if config is not None:
            overrides = [a for a in argv[2:] if "=" in a and not a.startswith("-")]
            return shlex.join(["ironloop", "tune", config, *overrides])
    return "ironloop.tune(model, train_data, config)"
