"""Shared pieces of the benchmarks: timing, summaries, the machine they ran on.

Every benchmark module exposes ``run(quick: bool) -> dict`` (JSON-serialisable) with the keys
``name, description, results, ratio, target, met, notes``; ``results`` is a list of rows, each
with ``label, median, min, max, n`` and the raw values under ``raw``. ``run.py`` collects them.

``IRONLOOP_BENCH_TINY=1`` shrinks every size to seconds (the smoke test uses it): the numbers
it gives mean nothing, it only keeps the code from rotting.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from contextlib import contextmanager

import torch

TINY = os.environ.get("IRONLOOP_BENCH_TINY") == "1"


def size(full: int, quick: int, tiny: int, is_quick: bool) -> int:
    """A size for the full run, the quick run, or the smoke test."""
    return tiny if TINY else quick if is_quick else full


def summary(label: str, values: list[float], unit: str = "s", **extra) -> dict:
    """One result row: median, min, max, n and the raw values."""
    return {"label": label, "median": statistics.median(values), "min": min(values),
            "max": max(values), "n": len(values), "unit": unit, "raw": list(values), **extra}


@contextmanager
def stopwatch(out: list):
    """Append the seconds the block took to ``out``."""
    start = time.perf_counter()
    yield
    out.append(time.perf_counter() - start)


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "gpu": gpu, "torch": str(torch.__version__), "python": platform.python_version(),
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def main(run) -> None:
    """``python benchmarks/<name>.py [--quick]``: run one benchmark and print its JSON.

    The training loops print progress lines on stdout; they go to stderr here so that stdout
    holds only the JSON.
    """
    import contextlib
    import json
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        result = run("--quick" in sys.argv)
    print(json.dumps(result, indent=1))
