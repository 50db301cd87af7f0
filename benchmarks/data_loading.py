"""What per-sample seeding costs, and what workers that persist across epochs save.

- **per-sample seeding** (``data.seed_samples``, on by default): loading a batch of 64 through
  ``SeededDataset`` (python, numpy and torch seeded from (seed, epoch, index) before each
  ``__getitem__``, the generators' states put back after the batch) against calling
  ``__getitem__`` directly, in microseconds per sample; and that cost as a share of a realistic
  sample: a 3x256x256 uint8 image randomly cropped to 224, flipped and normalised to float.
- **persistent workers**: ``fit()`` on a loader-bound dataset (each ``__getitem__`` does about
  a millisecond of work) with ``data.num_workers=2`` and short epochs; the time split's
  ``data`` part with the run's one DataLoader (workers persist) against a new DataLoader per
  epoch (what ironloop did before: workers start, and refill the prefetch queue, every epoch).

    python benchmarks/data_loading.py [--quick]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, size, summary

from ironloop.data import loader as data_loader
from ironloop.data.seeding import SeededDataset


class Trivial(Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int):
        return i


class Images(Dataset):
    """A realistic per-sample load: random crop, flip and normalisation of a uint8 image."""

    def __init__(self):
        self.image = torch.randint(0, 256, (3, 256, 256), dtype=torch.uint8)

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int):
        top, left = random.randrange(33), random.randrange(33)
        x = self.image[:, top:top + 224, left:left + 224]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return (x.float() / 255.0 - 0.5) / 0.25


def per_batch(dataset, keys, seeded: bool, reps: int) -> list[float]:
    """Seconds per sample of one batch's loading, ``reps`` times."""
    wrapped = SeededDataset(dataset, 0)
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        if seeded:
            wrapped.__getitems__(keys)
        else:
            [dataset[i] for _, i in keys]
        out.append((time.perf_counter() - start) / len(keys))
    return out


class LoaderBound(Dataset):
    """About a millisecond of CPU per sample: the model waits on the data."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        a = torch.full((48, 48), float(i % 7))
        for _ in range(4):
            a = a @ a.T / 48.0
        return a[0, :8].clone(), i % 4


def data_seconds(persistent: bool, epochs: int, n: int) -> float:
    """The time split's data seconds of one fit() run."""
    import ironloop

    original = data_loader.EpochLoader.__iter__

    def per_epoch(self):  # the old way: a new DataLoader, and new workers, every epoch
        return iter(data_loader.make_loader(self.dataset, self.sampler, **self.options))

    if not persistent:
        data_loader.EpochLoader.__iter__ = per_epoch
    try:
        with tempfile.TemporaryDirectory() as tmp:
            res = ironloop.fit(nn.Linear(8, 4), LoaderBound(n), None, {
                "run.dir": tmp, "run.device": "cpu", "train.epochs": epochs,
                "train.batch_size": 16, "data.num_workers": 2, "checkpoint.enabled": False,
                "log.progress": "off", "data.val_fraction": 0}, num_classes=4).results
    finally:
        data_loader.EpochLoader.__iter__ = original
    return res["time_split"]["data"]


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    reps = size(200, 40, 3, quick)
    keys = [(0, i) for i in range(64)]
    # The overhead is measured on a trivial __getitem__, where nothing else varies; on the
    # image load it drowns in the load's own spread. The share divides it by the image load.
    trivial, images = Trivial(), Images()
    plain, seeded = per_batch(trivial, keys, False, reps), per_batch(trivial, keys, True, reps)
    extra = [(s - p) * 1e6 for s, p in zip(seeded, plain)]
    image = [p * 1e6 for p in per_batch(images, keys, False, reps)]
    rows = [summary("per-sample seeding overhead (trivial __getitem__)", extra, unit="us"),
            summary("image crop+flip+normalise: load per sample, unseeded", image, unit="us"),
            summary("seeding overhead / image load", [100 * statistics.median(extra) / i
                                                      for i in image], unit="%")]
    epochs, n, runs = size(8, 4, 2, quick), size(320, 160, 32, quick), size(3, 1, 1, quick)
    for persistent in (False, True):
        label = "one DataLoader, workers persist" if persistent else "a DataLoader per epoch"
        rows.append(summary(f"loader-bound fit, {epochs} epochs, num_workers=2: data part, "
                            f"{label}",
                            [data_seconds(persistent, epochs, n) for _ in range(runs)]))
    seeding = next(r for r in rows if r["unit"] == "%")
    return {"name": "data_loading",
            "description": "per-sample seeding cost; the data part of the time split with "
                           "and without persistent workers",
            "results": rows, "ratio": None,
            "target": "per-sample seeding <= 1% of a realistic sample load, else opt-out",
            "met": None if TINY else statistics.median(seeding["raw"]) <= 1.0,
            "notes": "data.seed_samples=false turns seeding off"}


if __name__ == "__main__":
    from _common import main

    main(run)
