"""What each tracker adds to a training step at the default log cadence (issue 22): the same
run with no tracker, then with TensorBoard, W&B (offline) and MLflow (SQLite) each on alone.

Each repetition trains one epoch of a small MLP per variant, in a rotated order so the machine's
drift hits all alike; the figure is each epoch's training samples/s (``samples_per_s`` in
epochs.jsonl: validation, set-up and the trackers' start are not counted, the epoch-end
checkpoint and the hand-over to the trackers after it are). Target: every tracker on/off ratio
>= 0.99 (at most 1% slower). Defaults: log.every_steps=10, a checkpoint at the epoch end.

    .venv/bin/python benchmarks/tracker_overhead.py [--quick]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, size, summary

import ironloop
from ironloop.data.loader import TensorData

TARGET = 0.99
VARIANTS = {"none": {}, "tensorboard": {"log.tensorboard": True},
            "wandb": {"log.wandb": True, "log.wandb_mode": "offline"},
            "mlflow": {"log.mlflow": True}}


def _epoch(data: TensorData, extra: dict, run_dir: Path) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(data.x.shape[1], 256), nn.ReLU(), nn.Linear(256, 10))
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ironloop.fit(model, data, None, {"run.dir": str(run_dir), "train.epochs": 1,
                                         "train.batch_size": 64, "log.progress": "off",
                                         **extra}, overwrite=True)
    return json.loads((run_dir / "epochs.jsonl").read_text().splitlines()[-1])["samples_per_s"]


def run(quick: bool) -> dict:
    os.environ.setdefault("WANDB_SILENT", "true")
    n, reps = size(65536, 4096, 1024, quick), size(5, 2, 1, quick)
    g = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    speeds: dict[str, list[float]] = {k: [] for k in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        # repetition 0 warms up and is dropped; the smoke test (TINY) times one round, cold
        for rep in range(1 if TINY else 0, reps + 1):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                s = _epoch(data, VARIANTS[name], Path(tmp) / f"{name}-{rep}")
                if rep:
                    speeds[name].append(s)
    ratios = {k: statistics.median(a / b for a, b in zip(speeds[k], speeds["none"]))
              for k in names[1:]}
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"name": "tracker_overhead",
            "description": "samples/s of one epoch with each tracker on, against none",
            "results": [summary(f"{k}: samples/s", v, unit="") for k, v in speeds.items()],
            "ratio": ratios, "target": f"every tracker/none ratio >= {TARGET}",
            "met": all(r >= TARGET for r in ratios.values()) if not TINY else None,
            "notes": f"load average {load} at the end; {n} samples x {reps} repetitions"}


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
