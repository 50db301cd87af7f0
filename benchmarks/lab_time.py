"""What ``ironloop lab`` costs: wall and CPU seconds on digits and at Fashion-MNIST size, with
the machine's load, against issue 23's budgets on 2 CPU cores (digits < 3 min, Fashion-MNIST
size < 10 min, at a load up to about 4).

The real Fashion-MNIST files cannot be downloaded here, so the benchmark writes IDX files of the
same size and format (60,000 + 10,000 28x28 uint8 images, 10 classes) with
``ironloop.data.builtin.idx.write_idx``: each class is a fixed random pattern plus noise,
learnable like the real thing but not the same images, so the accuracies mean nothing; the time
does. Each lab runs as a real ``python -m ironloop lab`` process: CPU seconds are that process
and its children (resource.getrusage), load is the 1-minute load average before and after. Wall
time grows with the load of a shared machine, CPU time much less: the report gives both.

    python benchmarks/lab_time.py [--digits]     # --digits: the digits lab only

``run.py --quick`` runs no lab: the digits lab alone is 30-50 s of CPU, most of the quick look's
3-minute budget, and is timed by the full run (or ``--digits``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, summary

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = {"digits": 180.0, "fashion-mnist": 600.0}


def write_fashion_size(root: Path, n_train: int = 60_000, n_test: int = 10_000) -> Path:
    """Four raw IDX files of Fashion-MNIST's size and format under ``root``."""
    from ironloop.data.builtin.idx import FILES, write_idx

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    protos = rng.uniform(0, 255, (10, 28, 28))
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = 0.6 * protos[labels] + rng.uniform(0, 0.4 * 255, (n, 28, 28))
        write_idx(root / FILES[f"{split}_images"], images.astype(np.uint8))
        write_idx(root / FILES[f"{split}_labels"], labels)
    return root


def time_lab(data: str, out: Path, root: Path) -> dict:
    """One ``ironloop lab`` process: wall, CPU (it and its children), load before and after."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    before, load0 = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "ironloop", "lab", "--data", data, "--out",
                          str(out), "--root", str(root)], cwd=REPO, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - start
    after, load1 = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    if res.returncode != 0:
        raise RuntimeError(f"the {data} lab failed: {res.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    parts = [line for line in res.stdout.splitlines() if " s wall, " in line]
    return {"wall_s": wall, "cpu_s": cpu, "load": [load0, load1], "parts": parts}


def run(quick: bool, datasets: tuple[str, ...] = ("digits", "fashion-mnist")) -> dict:
    if quick and not TINY:
        return {"name": "lab_time", "description": "ironloop lab, wall and CPU seconds",
                "results": [{"label": "digits lab", "median": None, "min": None, "max": None,
                             "n": 0, "status": "not run with --quick (30-50 s of CPU)"}],
                "ratio": None, "target": "digits < 180 s, Fashion-MNIST size < 600 s wall",
                "met": None, "notes": "run.py without --quick, or "
                                      "`python benchmarks/lab_time.py --digits`, times it"}
    rows, measured = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if TINY:  # the smoke test: the IDX writer at a tiny size, no lab
            write_fashion_size(tmp, 64, 16)
            return {"name": "lab_time", "description": "ironloop lab wall and CPU time",
                    "results": [summary("tiny: IDX files written", [1.0], unit="")],
                    "ratio": None, "target": "not measured at tiny sizes", "met": None,
                    "notes": "IRONLOOP_BENCH_TINY: no lab run"}
        if "fashion-mnist" in datasets:
            write_fashion_size(tmp / "fashion")
        for data in datasets:
            m = time_lab(data, tmp / f"lab-{data}", tmp / "fashion")
            measured[data] = m
            rows.append(summary(f"{data}: wall", [m["wall_s"]], cpu_s=m["cpu_s"],
                                load=f"{m['load'][0]:.1f}-{m['load'][1]:.1f}"))
            print(json.dumps({data: m}), file=sys.stderr, flush=True)
    met = all(m["wall_s"] < BUDGET_S[d] for d, m in measured.items())
    loads = [x for m in measured.values() for x in m["load"]]
    return {"name": "lab_time", "description": "ironloop lab, wall and CPU seconds",
            "results": rows, "ratio": {d: m["cpu_s"] / m["wall_s"] for d, m in measured.items()},
            "target": "digits < 180 s, Fashion-MNIST size < 600 s wall on 2 cores at load <= 4",
            "met": met if max(loads) <= 4 else None,  # not judged on a loaded machine
            "notes": f"load average {min(loads):.1f}-{max(loads):.1f}; per part: "
                     + "; ".join(p for m in measured.values() for p in m["parts"])}


if __name__ == "__main__":
    print(json.dumps(run(False, ("digits",) if "--digits" in sys.argv
                         else ("digits", "fashion-mnist")), indent=2))
