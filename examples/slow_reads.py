"""A loader-bound run: every sample waits on a slow read, as from a network disk.

``ironloop tune`` finds what this run needs (DataLoader workers, which overlap the reads) and
writes it into ``tuned.yaml``. The wait is a sleep, not busy work: a read from a slow disk or a
bucket costs latency, not CPU, so workers help even on a machine whose cores are busy::

    ironloop tune examples/slow_reads.yaml               # from the repository root
    ironloop train runs/slow-reads/tuned.yaml
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset


class SlowReads(Dataset):
    """Gaussian blobs in 16 dimensions, 4 classes; each read waits ``delay`` seconds."""

    def __init__(self, n: int = 2048, delay: float = 0.002, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 16, generator=g) * 2
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 16, generator=g) + centres[self.y]
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.delay)  # the read: latency, not CPU
        return self.x[i], self.y[i]


def data(root: str, n: int = 2048, delay: float = 0.002):
    """``data.name: examples.slow_reads:data``: (train, val) datasets."""
    return SlowReads(n, delay), SlowReads(n // 8, delay, seed=1)


def model() -> nn.Module:
    """``model.name: examples.slow_reads:model``: a small MLP for the 16-dimensional blobs."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
