"""Start, checkpoint and resume on a map-style dataset of N samples, for N up to a billion.

The dataset is an object with ``__len__`` N and a cheap ``__getitem__`` (a sample computed from
its index), so what is measured is ironloop's own cost at that N: the epoch order (a keyed
permutation computed a batch at a time, never a ``randperm(N)``), the sampler's state and the
checkpoint. Two launched processes per N:

- start: launch -> fit() trains 4 steps, writes a checkpoint mid-epoch, exits;
- resume: launch -> fit(resume=True) restores it, trains 4 more steps from the saved offset,
  exits.

Each reports its wall time (interpreter and imports included) and its peak RSS (``wait4``'s
``ru_maxrss`` for that process alone). Target (issue 18): at N = 5e8, start and resume each
under 20 s and 1.5 GB on the 2-core development machine.

    python benchmarks/data_scale.py [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, summary

TARGET_N, TARGET_S, TARGET_GB = 500_000_000, 20.0, 1.5


class Huge(Dataset):
    """N samples that are never stored: sample i is computed from i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((8,), float(i % 1000) / 1000.0), i % 10


def child(n: int, run_dir: str, resume: bool) -> None:
    import ironloop

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
    ironloop.fit(model, Huge(n), None, {
        "run.dir": run_dir, "run.device": "cpu", "train.batch_size": 64,
        "train.max_steps": 8 if resume else 4, "checkpoint.every_steps": 4,
        "log.progress": "off", "doctor.preflight": False}, num_classes=10,
        resume=resume, allow_config_change=resume)


def launch(n: int, run_dir: Path, resume: bool) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in GB) of one launched process. CPU time is
    what a loaded machine does not inflate."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                      os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(n), str(run_dir),
                             "resume" if resume else "start"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"N={n} {'resume' if resume else 'start'} failed: "
                           f"{proc.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20  # KB -> GB


def run(quick: bool) -> dict:
    sizes = [1000] if TINY else [10**6, 10**8, TARGET_N, 10**9]
    if quick and not TINY:
        sizes = [TARGET_N]  # the target's size only: each size is two launches
    reps = 1 if TINY or quick else 3
    rows, met = [], True
    for n in sizes:
        times, cpu, rss = ({"start": [], "resume": []} for _ in range(3))
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as tmp:
                for what in ("start", "resume"):
                    s, c, gb = launch(n, Path(tmp) / "run", what == "resume")
                    times[what].append(s)
                    cpu[what].append(c)
                    rss[what].append(gb)
        for what in ("start", "resume"):
            rows.append(summary(f"N={n:.0e}: {what}, launch -> exit", times[what]))
            rows.append(summary(f"N={n:.0e}: {what}, CPU time", cpu[what]))
            rows.append(summary(f"N={n:.0e}: {what}, peak RSS", rss[what], unit="GB"))
            if n == TARGET_N:
                met &= max(times[what]) < TARGET_S and max(rss[what]) < TARGET_GB
    return {"name": "data_scale",
            "description": "start (4 steps + a checkpoint) and resume (4 more steps) of a "
                           "map-style dataset of N samples: wall time and peak RSS per process",
            "results": rows, "ratio": None,
            "target": f"N=5e8: start and resume each < {TARGET_S:g} s and < {TARGET_GB} GB",
            "met": None if TINY else met, "notes": ""}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "resume")
    else:
        from _common import main

        main(run)
