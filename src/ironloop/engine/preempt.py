"""Preemption: SIGTERM, SIGINT or SIGUSR1 stop the run at the end of the optimizer step in
progress, with a durable checkpoint of that step, and exit code 75.

Schedulers send SIGTERM (SLURM, Kubernetes, spot instances) or a chosen signal (SLURM's
``--signal``) some seconds before they SIGKILL. The handler only records the signal; the loop
asks ``should_stop()`` once per optimizer step, a Python bool in one process. Under torchrun the
ranks must stop at the same step (a rank that stopped alone would leave the others waiting in
their next all-reduce), so each step's flag goes out in an asynchronous all-reduce (MAX) on a
gloo group of its own, and the result is read one step later: it is long done by then, so no
rank waits for it, and every rank reads the same value at the same step. That costs one extra
step before the save, and no device sync (the flag is a CPU tensor).

A second signal while the checkpoint is written kills the process at once (the kernel's default
action, so even a write stuck in C code stops): the checkpoint being written is a temp file
that a resume deletes, and the previous one is intact. A second signal before the save starts
(while the step finishes) does the same, unless it came within ``DUPLICATE_S`` of the first:
SLURM signals every process of a job step and torchrun forwards the signal too, so each rank
gets the same request twice.

A signal that came earlier, while torch loaded and the run was built, was kept by the CLI's
``EarlySignals`` (engine/slurm.py) and stops the run at its first step, with a checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from time import time as wall_clock  # apart from time.monotonic, which tests replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ironloop.engine.slurm import EarlySignals, SetupSignals
from ironloop.errors import Preempted

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
DUPLICATE_S = 2.0  # a repeat of the signal within this long is the same request


class Preemption:
    """Signal handlers (installed while the loop runs) and the per-step stop decision."""

    def __init__(self, distributed: bool, timeout_s: float = 600.0):
        self.signum: int | None = None
        self.signalled_at: float | None = None  # wall clock of the first signal
        self._first_at = 0.0
        self._previous: dict = {}
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) \
            if distributed else None
        # (work, flag) of the all-reduce sent at the previous step
        self._pending: tuple[Any, np.ndarray] | None = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
                early = self._previous[sig]
                if isinstance(early, EarlySignals) and early.signum is not None and \
                        self.signum is None:  # came while the run was being built
                    self.signum, self.signalled_at = early.signum, early.at
                    self._first_at = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # the setup's handler says "during setup": past the loop, the default action again
            signal.signal(sig, signal.SIG_DFL if isinstance(handler, SetupSignals) else handler)
        self._previous = {}
        if self._pending is not None:  # every rank sent it: it completes without waiting
            try:
                self._pending[0].wait()
            except RuntimeError:
                # A rank that already stopped (preempted at the agreed step, its part of the
                # save done) may have closed its end first; the flag is not needed any more.
                if exc[0] is None:
                    raise
            self._pending = None

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            self.signalled_at = wall_clock()  # for the record: when the request came
        elif time.monotonic() - self._first_at > DUPLICATE_S:
            os.write(2, f"ironloop: second {signal.Signals(signum).name}: exiting now without a "
                        f"checkpoint; the previous one is intact\n".encode())
            os._exit(128 + signum)

    def should_stop(self) -> bool:
        """Once per optimizer step, on every rank, at the same point of the step."""
        if self._group is None:
            return self.signum is not None
        # The flag lives in host memory (a numpy array under a CPU tensor, reduced by gloo):
        # reading it after the wait is a memory read, never a device sync or a tensor read.
        held = np.array([0 if self.signum is None else 1], dtype=np.int32)
        work = dist.all_reduce(torch.from_numpy(held), op=dist.ReduceOp.MAX, group=self._group,
                               async_op=True)
        previous, self._pending = self._pending, (work, held)
        if previous is None:
            return False
        previous[0].wait()
        return bool(previous[1][0])

    def saving(self) -> None:
        """From here on a signal kills at once: the save below is the last thing the run does,
        and only the kernel's default action stops a write that is inside C code."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def stopped(self, step: int, saved: bool) -> Preempted:
        """The exception that ends the run; under torchrun a rank may stop for another's
        signal."""
        name = "a signal to another rank" if self.signum is None else \
            signal.Signals(self.signum).name
        stop = Preempted(name, step, saved)
        stop.signalled_at = self.signalled_at
        return stop
