"""``ironloop`` (the CLI's main) in a forked child of the test process: a real process, with
its own pid (and its own loader workers), that a test SIGKILLs, without the ~5 s of CPU a fresh
`python -m ironloop` spends importing torch, torch.distributed and the data libraries before its
first step (issue 45). For kill tests whose proof is what the killed process leaves on disk and
what a resume makes of it; the process's start-up is not what they test. The parent waits for
the child (``os.waitpid``), so its exit status is the kernel's: -SIGKILL for a killed one."""

from __future__ import annotations

import faulthandler
import logging
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from tests.conftest import REPO


def fork_main(argv: list[str], env: dict[str, str], out: Path, cwd: Path = REPO,
              new_session: bool = False) -> Child:
    """Fork; the child runs ``main(argv)`` with ``env`` as its environment, in ``cwd``, one
    intra-op thread (OMP_NUM_THREADS=1 gives a subprocess that), stdin from /dev/null, stdout
    and stderr into ``out`` (logging's records too, as in a fresh interpreter: not into this
    test's capture), in a session (and process group) of its own with ``new_session``, and
    leaves with main's exit code without the interpreter's teardown (as cli.entry)."""
    # what `ironloop train` imports (torch.distributed's FSDP and DTensor among them: ~1.5 s of
    # CPU), once, here: the children inherit it
    import ironloop.tools.recipe  # noqa: F401

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(fd)
        return Child(pid)
    code = 70  # reached only when the child could not run main
    try:
        if new_session:
            os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the child's streams, to its exit)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        # a hung child tells where: SIGABRT (conftest.wait_running) writes every thread's
        # stack into ``out``, and leaves no core file
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        faulthandler.enable(file=sys.stderr, all_threads=True)
        for handler in logging.root.handlers[:]:  # pytest's capture: a fresh process has none
            logging.root.removeHandler(handler)
        logging.root.setLevel(logging.WARNING)
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


class Child:
    """The forked child, as much of subprocess.Popen as the tests use. Its exit status is the
    kernel's (os.waitpid): -N when a signal N ended it."""

    dumps_on_abort = True  # its faulthandler is on (fork_main)

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked ironloop (pid {self.pid})", timeout or 0)
            time.sleep(0.01)  # waiting on the child's exit, not on a clock
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
