"""Loader workers leave stop signals to the main process.

Schedulers signal the whole process group (SLURM's ``scancel --signal``, ``kill -- -PGID``,
Ctrl-C in a terminal) and torchrun forwards SIGTERM, so a DataLoader worker gets the same
SIGTERM/SIGINT/SIGUSR1 as the training process. torch's workers die on it ("DataLoader worker
(pid ...) is killed by signal: Terminated"), which kills the run in the middle of the step it
was about to finish and checkpoint (engine/preempt.py). The main process decides what a signal
means; its workers ignore these three and end when their loader ends (or their parent dies: torch's
workers watch it). Installed in ``worker_init_fn``, which runs after torch sets its own worker
handlers, for every loader ironloop builds and for a stream's loader the user passed.
"""

from __future__ import annotations

import functools
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _init(user_init, worker_id: int) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if user_init is not None:
        user_init(worker_id)


def shielded(user_init=None):
    """A ``worker_init_fn`` that ignores the stop signals, then runs ``user_init`` (picklable,
    for a spawn context: a partial of a module-level function)."""
    if isinstance(user_init, functools.partial) and user_init.func is _init:
        return user_init  # already shielded (a loader reused every epoch)
    return functools.partial(_init, user_init)
