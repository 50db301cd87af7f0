"""Checks on the machine the run is on: CPU threads against cores."""

from __future__ import annotations

import os

import torch

from ironloop.tools.doctor.findings import Finding, info


def cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def check_threads() -> list[Finding]:
    """9. torch's intra-op threads times the processes on this node against the cores: more
    threads than cores make them wait on each other (on a busy 2-core machine, digits trained
    8x slower with torch's default threads)."""
    threads = torch.get_num_threads()
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = cores()
    measured = f"{threads} torch thread(s) x {procs} process(es) on {n} core(s)"
    if threads * procs <= n:
        return [info("threads", measured)]
    fit = max(1, n // procs)
    return [Finding("threads", "warning", f"{measured}: oversubscribed",
                    "more compute threads than cores: they preempt each other, and every "
                    "parallel op waits for its slowest thread",
                    f"set OMP_NUM_THREADS={fit} (or torch.set_num_threads({fit})) so that "
                    f"threads x processes <= cores")]
