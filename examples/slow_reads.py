"""A loader-bound run: every sample waits on a slow read, as from a network disk, or (``work:
cpu``) costs CPU, as a decode or an augmentation does.

``ironloop tune`` finds what this run needs (DataLoader workers, which overlap the reads, and
the main process's threads that leave them the cores) and writes it into ``tuned.yaml``. A
sleep costs latency, not CPU, so workers help even on a machine whose cores are busy; CPU work
needs free cores, which torch's own threads take unless ``run.threads`` leaves them::

    ironloop tune examples/slow_reads.yaml               # from the repository root
    ironloop tune examples/cpu_reads.yaml                # about 1 ms of CPU per sample
    ironloop train runs/slow-reads/tuned.yaml
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset

#: Python loop iterations per millisecond of one core (measured on the 2-core dev machine,
#: quiet): a fixed amount of work, so a busy machine makes a read slower, as it would a decode.
SPINS_PER_MS = 28_000


class SlowReads(Dataset):
    """Gaussian blobs in 16 dimensions, 4 classes; each read waits ``delay`` seconds
    (``work="sleep"``) or does about that much CPU work on a quiet core (``work="cpu"``)."""

    def __init__(self, n: int = 2048, delay: float = 0.002, seed: int = 0, work: str = "sleep"):
        if work not in ("sleep", "cpu"):
            raise ValueError(f"data.kwargs.work={work!r}: must be sleep or cpu")
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 16, generator=g) * 2
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 16, generator=g) + centres[self.y]
        self.delay, self.work = delay, work

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.work == "cpu":  # a decode: CPU, not latency
            sum(k * k for k in range(int(self.delay * 1000 * SPINS_PER_MS)))
        else:
            time.sleep(self.delay)  # the read: latency, not CPU
        return self.x[i], self.y[i]


def data(root: str, n: int = 2048, delay: float = 0.002, work: str = "sleep"):
    """``data.name: examples.slow_reads:data``: (train, val) datasets."""
    return SlowReads(n, delay, work=work), SlowReads(n // 8, delay, seed=1, work=work)


def model() -> nn.Module:
    """``model.name: examples.slow_reads:model``: a small MLP for the 16-dimensional blobs."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
