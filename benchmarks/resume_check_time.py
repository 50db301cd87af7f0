"""What ``ironloop doctor --resume-check`` costs on the digits config: wall and CPU seconds of
the whole command (the doctor and its three scratch runs), with the machine's load, against
issue 33's budget (under about 20 s on 2 CPU cores).

Each repetition is a real ``python -m ironloop doctor configs/digits.yaml --resume-check``
process: CPU seconds are that process and its children (resource.getrusage), load is the
1-minute load average before and after. Wall time grows with the load of a shared machine, CPU
time much less: the report gives both.

    python benchmarks/resume_check_time.py [--quick]      # --quick: 1 repetition, else 5
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, summary

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 20.0


def time_check(run_dir: Path, steps: int = 24) -> dict:
    """One ``ironloop doctor --resume-check`` process: wall, CPU (with children), load."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    before, load0 = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "ironloop", "doctor", "configs/digits.yaml",
                          f"run.dir={run_dir}", "--resume-check", "--steps", str(steps)],
                         cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after, load1 = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    if res.returncode != 0:
        raise RuntimeError(f"the resume check failed ({res.returncode}): "
                           f"{(res.stdout + res.stderr)[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "load": [load0, load1]}


def run(quick: bool) -> dict:
    if TINY:  # the smoke test (the suite runs it): the command's start-up, no scratch runs
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ironloop", "doctor", "--help"], cwd=REPO,
                       capture_output=True, check=True)
        return {"name": "resume_check_time", "description": "ironloop doctor --resume-check",
                "results": [summary("tiny: `ironloop doctor --help`: wall",
                                    [time.perf_counter() - start])],
                "ratio": None, "target": "not measured at tiny sizes", "met": None,
                "notes": "IRONLOOP_BENCH_TINY: no check run"}
    reps = 1 if quick else 5
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(reps):
            measured.append(time_check(Path(tmp) / f"run{i}"))
            print(json.dumps(measured[-1]), file=sys.stderr, flush=True)
    walls, cpus = [m["wall_s"] for m in measured], [m["cpu_s"] for m in measured]
    loads = [x for m in measured for x in m["load"]]
    return {"name": "resume_check_time",
            "description": "ironloop doctor configs/digits.yaml --resume-check (24 steps)",
            "results": [summary("digits: wall", walls), summary("digits: CPU", cpus)],
            "ratio": statistics.median(cpus) / statistics.median(walls),
            "target": f"under {BUDGET_S:.0f} s wall on 2 cores at load <= 4",
            "met": statistics.median(walls) < BUDGET_S if max(loads) <= 4 else None,
            "notes": f"load average {min(loads):.1f}-{max(loads):.1f}"}


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
