"""Checks on the machine the run is on: CPU threads against cores."""

from __future__ import annotations

import os

import torch

from ironloop.config import Config
from ironloop.engine.precision import resolve_device
from ironloop.outputs.time_split import tune_hint
from ironloop.tools.doctor.findings import Finding, info


def cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def check_threads(cfg: Config | None = None) -> list[Finding]:
    """9. The run's intra-op threads (``run.threads``, else torch's default) times the
    processes on this node against the cores: more threads than cores make them wait on each
    other (on a busy 2-core machine, digits trained 8x slower with torch's default threads).
    On CPU the DataLoader's workers need cores too: threads that take them all spin-wait on the
    cores the workers need (a loader-bound run trained 1.5x faster with run.threads=1)."""
    threads = (cfg.run.threads if cfg is not None else 0) or torch.get_num_threads()
    workers = cfg.data.num_workers if cfg is not None else 0
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = cores()
    where = "run.threads" if cfg is not None and cfg.run.threads else "torch's default"
    measured = f"{threads} torch thread(s) ({where}) x {procs} process(es) on {n} core(s)"
    fit = max(1, n // procs)
    if threads * procs > n:
        return [Finding("threads", "warning", f"{measured}: oversubscribed",
                        "more compute threads than cores: they preempt each other, and every "
                        "parallel op waits for its slowest thread",
                        f"set run.threads={fit} (or OMP_NUM_THREADS={fit}) so that threads x "
                        f"processes <= cores")]
    leave = max(1, (n - workers) // procs)
    if workers and threads > leave and _cpu(cfg):
        assert cfg is not None  # _cpu(None) is False
        how = tune_hint(cfg.run.dir, "ironloop tune measures it")
        return [Finding("threads", "info", f"{measured} and {workers} DataLoader worker(s) "
                        f"per process", "torch's threads spin-wait between ops on the cores "
                        "the workers need", f"if the loader is the bottleneck, set "
                        f"run.threads={leave} ({how})")]
    return [info("threads", measured)]


def _cpu(cfg: Config | None) -> bool:
    return cfg is not None and resolve_device(cfg.run.device).type == "cpu"
