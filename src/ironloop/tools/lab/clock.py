"""Where the lab's time goes: wall and CPU seconds for each part, printed as it finishes and
kept for the report's table, with the load the machine was under.

CPU seconds count this process and the children it waited for (step 7's crash and resume
processes). On a shared machine wall time grows with the load and CPU time much less, so the
report gives both, and the load average at the start and at the end.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


class Clock:
    """``with clock.part(name): ...`` times one part of the lab."""

    def __init__(self):
        self.rows: list[tuple[str, float, float]] = []  # (part, wall s, CPU s)
        self.loads = [load()]
        self.cores = os.cpu_count() or 1

    @contextmanager
    def part(self, name: str):
        wall, cpu = time.perf_counter(), cpu_seconds()
        yield
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        self.rows.append((name, wall, cpu))
        self.loads.append(load())
        print(f"[lab] {name}: {wall:.1f} s wall, {cpu:.1f} s CPU "
              f"(load {self.loads[-1]:.1f} on {self.cores} cores)", flush=True)

    def under(self) -> str:
        """The conditions of the measurement, for every timing the report compares."""
        return (f"{self.cores} cores, load average {min(self.loads):.1f}-{max(self.loads):.1f} "
                f"while it ran")

    def table(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows) with a total row."""
        rows = [[name, f"{w:.1f}", f"{c:.1f}"] for name, w, c in self.rows]
        total = [sum(r[1] for r in self.rows), sum(r[2] for r in self.rows)]
        return ["part", "wall s", "CPU s"], [*rows, ["total", f"{total[0]:.1f}",
                                                     f"{total[1]:.1f}"]]
