"""Resume cost against position in the epoch: it should be flat (no replay of skipped batches).

Trains one long epoch with a checkpoint every few steps, then resumes from checkpoints at
several positions and times fit() from its call to the first batch it fetches (loading the
checkpoint, restoring every state, positioning the data). Median of --reps with min-max.

    .venv/bin/python benchmarks/resume_cost.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ironloop
from ironloop.data.loader import TensorData


class Timed(TensorData):
    first_fetch: float | None = None

    def __getitems__(self, indices):
        if Timed.first_fetch is None:
            Timed.first_fetch = time.perf_counter()
        return super().__getitems__(indices)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    n, batch, every = 64 * 1000, 64, 100  # one epoch of 1000 steps, checkpoint every 100
    g = torch.Generator().manual_seed(0)
    data = Timed(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    with tempfile.TemporaryDirectory() as tmp:
        base = {"run.dir": str(Path(tmp) / "run"), "train.epochs": 1, "train.batch_size": batch,
                "log.progress": "off", "checkpoint.every_steps": every,
                "checkpoint.keep_last": 20, "log.every_steps": 100}
        ironloop.fit(model(), data, None, base)
        print(f"one epoch of {n // batch} steps; time from fit() to the first batch fetched")
        for step in (100, 300, 500, 700, 900):
            ckpt = Path(tmp) / "run" / "checkpoints" / f"step-{step:08d}.pt"
            times = []
            for rep in range(args.reps):
                Timed.first_fetch = None
                cfg = {**base, "run.dir": str(Path(tmp) / f"resume-{step}-{rep}")}
                t = time.perf_counter()
                ironloop.fit(model(), data, None, cfg, resume=str(ckpt))
                times.append(Timed.first_fetch - t)
            print(f"resume at step {step:4d} ({step / (n // batch):4.0%} of the epoch): "
                  f"{1000 * statistics.median(times):6.1f} ms "
                  f"(min {1000 * min(times):.1f}, max {1000 * max(times):.1f})")


if __name__ == "__main__":
    main()
