"""Stopping a tune: Ctrl-C or SIGTERM ends it, and a SIGKILL's leftovers go at the next start.

A tune has nothing to resume, so a signal is not a preemption: the tune stops at once (inside
a trial, at the end of that trial's step: ``record_signals``), says so, writes
neither tune.json nor tuned.yaml, and exits with 128 + the signal's number (130 for Ctrl-C,
143 for SIGTERM), as a shell reports a process the signal ended. It never counts the signal as
a failed trial.

Each trial trains in a temporary directory named ``ironloop-tune-<pid>-*``; a SIGKILL leaves it
behind. The next tune removes those whose process is gone (its own user's only) and says how
many it removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ironloop.state.lock import alive

SIGNALS = (signal.SIGINT, signal.SIGTERM)
PREFIX = "ironloop-tune-"


class Stopped(BaseException):
    """A signal stopped the tune; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signal_name: str):
        super().__init__(f"tune stopped by {signal_name}; nothing written (no tune.json, no "
                         f"tuned.yaml): run it again to tune")
        self.signal_name = signal_name
        self.exit_code = 128 + signal.Signals[signal_name].value


def _raise(signum: int, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Stopped`` while the tune runs (between trials; inside one,
    ``record_signals`` takes them from the trial's first step, and fit()'s preemption handler
    before it, whose ``Preempted`` trials.run_trial turns into ``Stopped``). Only the main
    thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise) for sig in SIGNALS}
    try:
        yield
    except Stopped:
        # A signal between a trial directory's mkdtemp and its ``with`` leaves the directory
        # behind (TemporaryDirectory's finalizer never runs: the CLI leaves with os._exit).
        for path in Path(tempfile.gettempdir()).glob(f"{trial_prefix()}*"):
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def record_signals(received: list[str]) -> None:
    """Called as a trial's fit() starts training (inside fit()'s preemption handlers): SIGINT
    and SIGTERM then append their name to ``received``, which the trial's clock checks after
    every step and once fit() returns. fit()'s own handler would stop at the next step's end,
    and a trial that ends at this step (its measurement done) would never get there: the
    signal would be lost. fit() puts back the handlers it found, the tune's, as it ends."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, lambda signum, frame: received.append(signal.Signals(signum).name))


def trial_prefix() -> str:
    """A trial directory's name prefix: the process id tells a stale one from a live one."""
    return f"{PREFIX}{os.getpid()}-"


def clean_stale(root: Path | None = None) -> int:
    """Remove the trial directories of tunes whose process is gone (a SIGKILL), this user's
    only; return how many."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    for path in root.glob(f"{PREFIX}*-*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.stat().st_uid != os.getuid() \
                or alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed

