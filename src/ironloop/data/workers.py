"""Loader workers leave stop signals to the main process.

Schedulers signal the whole process group (SLURM's ``scancel --signal``, ``kill -- -PGID``,
Ctrl-C in a terminal) and torchrun forwards SIGTERM, so a DataLoader worker gets the same
SIGTERM/SIGINT/SIGUSR1 as the training process. torch's workers die on it ("DataLoader worker
(pid ...) is killed by signal: Terminated"), which kills the run in the middle of the step it
was about to finish and checkpoint (engine/preempt.py). The main process decides what a signal
means; its workers ignore these three and end when their loader ends (or their parent dies: torch's
workers watch it). Installed in ``worker_init_fn``, which runs after torch sets its own worker
handlers, for every loader ironloop builds and for a stream's loader the user passed.

So ironloop stops its workers itself (``stop_workers``): Python's exit sends its daemonic
children SIGTERM and waits for them, and a worker that ignores SIGTERM would be waited for
forever if an error's traceback (left uncaught, or kept by a notebook) still held its iterator.
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Iterable, Iterator

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


def stop_workers(iterator) -> None:
    """End a DataLoader iterator's worker processes now; anything else is left as it is.
    torch ends them when the iterator is collected, by this same call (safe to repeat; Lightning
    calls it too), which a traceback holding the iterator would put off past Python's exit."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


@contextlib.contextmanager
def iterating(loader: Iterable) -> Iterator[Iterator]:
    """``iter(loader)``, its workers stopped on the way out, however the loop ends."""
    it = iter(loader)
    try:
        yield it
    finally:
        stop_workers(it)
