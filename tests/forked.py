"""``ironloop`` (the CLI's main) in a forked child of the test process: a real process, with
its own pid (and its own loader workers), that a test SIGKILLs, without the ~5 s of CPU a fresh
`python -m ironloop` spends importing torch, torch.distributed and the data libraries before its
first step (issue 45). For kill tests whose proof is what the killed process leaves on disk and
what a resume makes of it; the process's start-up is not what they test. The parent waits for
the child (``os.waitpid``), so its exit status is the kernel's: -SIGKILL for a killed one."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from tests.conftest import REPO


def fork_main(argv: list[str], env: dict[str, str], out: Path, cwd: Path = REPO) -> int:
    """Fork; the child runs ``main(argv)`` with ``env`` as its environment, in ``cwd``, one
    intra-op thread (OMP_NUM_THREADS=1 gives a subprocess that), stdin from /dev/null, stdout
    and stderr into ``out``, and leaves with main's exit code without the interpreter's
    teardown (as cli.entry). Returns the child's pid."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    code = 70  # reached only when the child could not run main
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the child's streams, to its exit)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.set_num_threads(1)
        from ironloop.cli import main

        code = main(argv)
    except BaseException:  # noqa: BLE001 (reported in ``out``; the child must not return)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    raise AssertionError("unreachable")  # for mypy: the child never returns


def poll(pid: int) -> int | None:
    """None while the child ``pid`` runs, else its exit status (``wait``'s; it is reaped)."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def kill(pid: int) -> int:
    """SIGKILL the child ``pid``; returns its exit status as Popen's returncode would be."""
    os.kill(pid, signal.SIGKILL)
    return wait(pid)


def wait(pid: int) -> int:
    """The child's exit status as Popen's returncode (-N for a signal N)."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
