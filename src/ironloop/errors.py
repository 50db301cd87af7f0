"""User-facing errors.

Anything derived from ``UserError`` is a mistake the user can fix (a bad config key, a missing
file, a damaged checkpoint). The CLI prints its message on one line and exits 2 with no traceback.
Everything else is a bug in ironloop and keeps its traceback.

A message that names one of the run's options speaks the caller's language: ``--overwrite``
to the CLI, ``overwrite=True`` to Python. The front door a Python user calls (``ironloop.fit``)
says so once (``speaking_python``); every message asks ``option(...)``, so nothing between the
front door and the message carries it.
"""

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

#: "cli" (the default: ironloop train, the tools) or "python" (ironloop.fit)
_SPOKEN: ContextVar[str] = ContextVar("ironloop_spoken", default="cli")

def option(name: str, value: object = None) -> str:
    """How the user spells one of fit()'s options (``overwrite``, ``resume``,
    ``allow_config_change``): ``option("overwrite")`` is ``--overwrite`` from the CLI,
    ``overwrite=True`` from Python; ``option("resume", "best.pt")`` is ``--resume best.pt`` or
    ``resume='best.pt'``."""
    if speaks_python():
        return f"{name}={True if value is None else str(value)!r}"
    return flag(name) if value is None else f"{flag(name)} {value}"


def flag(name: str) -> str:
    """An option's name alone, as the user spells it: ``budget`` to Python, ``--budget`` to the
    CLI (for a message that writes its own value, ``--budget=5 s``)."""
    return name if speaks_python() else "--" + name.replace("_", "-")


def speaks_python() -> bool:
    """Inside ``speaking_python``: a message names fit()'s arguments (for what ``option``
    cannot spell, such as tune's ``budget=``)."""
    return _SPOKEN.get() == "python"


@contextlib.contextmanager
def speaking_python() -> Iterator[None]:
    """Messages raised or printed inside name fit()'s arguments, not the CLI's flags."""
    token = _SPOKEN.set("python")
    try:
        yield
    finally:
        _SPOKEN.reset(token)


class UserError(Exception):
    """A mistake the user can fix. The message names the bad thing and the fix."""


class ConfigError(UserError):
    """A config value is unknown, mistyped or out of range."""


class DataError(UserError):
    """A dataset is missing, damaged or inconsistent."""


class CheckpointError(UserError):
    """A checkpoint is missing, damaged, unsafe or does not fit the model."""


class RankZeroError(UserError):
    """Rank 0's refusal, raised on the other ranks too (``parallel.world.rank_zero_first``):
    every rank stops with it, none left waiting in a collective for a rank that is gone. Rank 0
    speaks for the run: the CLI prints it there only."""


class Preempted(Exception):
    """A signal (SIGTERM, SIGINT, SIGUSR1) stopped the run at the end of an optimizer step, after
    a checkpoint of that step was written. Not a mistake: the CLI prints the message on one line
    and exits with ``EXIT_CODE``, so that a job script can tell "saved, requeue me" apart from a
    failure."""

    EXIT_CODE = 75  # EX_TEMPFAIL in sysexits.h: a temporary failure, try again later
    exit_code = EXIT_CODE

    def __init__(self, signal_name: str, step: int, saved: bool):
        what = f"with a checkpoint of it; resume with {option('resume')}" if saved else \
            "without a checkpoint (checkpoint.enabled=false)"
        super().__init__(f"preempted by {signal_name}: stopped after step {step}, {what}")
        self.signal_name, self.step, self.saved = signal_name, step, saved
        self.signalled_at: float | None = None  # when this process got the signal (time.time)


class StoppedInSetup(BaseException):
    """A signal (SIGTERM, SIGUSR1) while ``ironloop train`` loaded torch and built the run,
    before the loop's own handler took over (engine/preempt.py): nothing was trained or saved
    yet, so the run stops at once. A BaseException, as KeyboardInterrupt is: no ``except
    Exception`` on the way (a doctor check, a user's factory) takes it for an error of its own.
    The CLI prints the message on one line and exits 128 + the signal's number, what the
    signal's default action gives (SIGTERM: 143), so a job script reads it as it did before."""

    def __init__(self, signal_name: str, signum: int):
        super().__init__(f"stopped by {signal_name} during setup, before the first step: "
                         f"nothing was trained or saved (a previous run's checkpoints are as "
                         f"they were); run the same command again to start (--resume continues "
                         f"a run)")
        self.exit_code = 128 + signum
