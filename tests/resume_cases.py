"""Pipelines for the resume check's tests (``data.name=tests.resume_cases:NAME`` and so on):
one clean, and one for each way a user's pipeline can keep state that a crash loses."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ironloop.callbacks import Callback
from tests.conftest import blobs

N = 96  # samples: 6 steps an epoch at batch 16


def splits(train) -> dict:
    return {"train": train, "val": blobs(32, seed=2), "num_classes": 3}


def clean_data():
    return splits(blobs(N, seed=1))


class CountingData(Dataset):
    """Blobs whose inputs drift with a count of reads kept in the dataset: a new process starts
    the count at 0 again, so the batches after a resume are not the ones the run would see."""

    def __init__(self):
        data = blobs(N, seed=1)
        self.x, self.y, self.reads = data.x, data.y, 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        self.reads += 1
        return self.x[i] + 1e-3 * self.reads, self.y[i]


def counting_data():
    return splits(CountingData())


class UnseededData(CountingData):
    """Blobs with noise from a generator seeded by nothing the run controls: no two processes
    see the same batches, crash or no crash."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(torch.seed())

    def __getitem__(self, i: int):
        return self.x[i] + torch.randn(self.x.shape[1], generator=self.gen), self.y[i]


def unseeded_data():
    return splits(UnseededData())


class BlobStream(IterableDataset):
    """A stream (no indices) of blobs, shuffled per epoch from (seed, epoch)."""

    def __init__(self):
        data = blobs(N, seed=1)
        self.x, self.y, self.epoch = data.x, data.y, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + self.epoch))
        for i in order.tolist():
            yield self.x[i], self.y[i]


def stream_data():
    return splits(BlobStream())


class CountingScale(nn.Module):
    """Scales its input by a factor that depends on a Python counter of calls: not in the
    state_dict, so a resumed process scales differently."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (1.0 + 0.01 * (self.calls % 7))


def counting_model(input_shape, num_classes, hidden=(16,)):
    return nn.Sequential(nn.Linear(input_shape[0], hidden[0]), CountingScale(), nn.ReLU(),
                         nn.Linear(hidden[0], num_classes))


class StepCounter(Callback):
    """Counts the steps it saw, with no state_dict: a crash resets the count."""

    def __init__(self):
        self.seen = 0

    def on_step_end(self, run, metrics: dict) -> None:
        self.seen += 1


class SavedStepCounter(StepCounter):
    """The same count, saved in every checkpoint."""

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def rank1_counting_data(rank: int = 0):
    """Under torchrun: a clean dataset on rank 0, the counting one on rank 1."""
    return splits(CountingData() if rank == 1 else blobs(N, seed=1))


CALLS = 0  # a global the step below changes: a new process starts it at 0 again


def counting_step(model, batch):
    """The default classification loss, scaled by a global count of calls."""
    global CALLS
    CALLS += 1
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y) * (1.0 + 0.01 * (CALLS % 5))
    return loss, {}


class CallCounter(nn.Module):
    """Counts its calls in a Python attribute that forward never reads: a resumed process
    counts from 0 again, and every output is what it would have been."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


def call_counting_model(input_shape, num_classes, hidden=(16,)):
    return nn.Sequential(nn.Linear(input_shape[0], hidden[0]), CallCounter(), nn.ReLU(),
                         nn.Linear(hidden[0], num_classes))
