"""Per-sample randomness: a sample's augmentation is a pure function of (seed, epoch, index).

Seeding each worker once (what torch does) makes a sample's random draws depend on which worker
got it and on what that worker drew before: a mid-epoch resume, or another ``num_workers``,
hands the samples to workers differently and the augmentations change. Here python's, numpy's
and torch's CPU generators are seeded from (seed, epoch, index) just before ``__getitem__``, so a
sample draws the same numbers wherever and whenever it is loaded. The generators' states are
put back after each batch, so loading in the main process (``num_workers=0``) leaves the
training's own random stream (dropout, say) as it was.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (unlike hash(), the same in every process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed python, numpy and torch's CPU generator for one sample (CUDA's are left alone:
    seeding them would initialise CUDA in a worker)."""
    s = derive_seed(seed, epoch, index, "sample")
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.default_generator.manual_seed(s)


class SeededDataset:
    """A map-style dataset whose keys are (epoch, index) pairs: each sample is loaded right
    after ``seed_sample(seed, epoch, index)``. The batch sampler that feeds it carries the
    epoch in each key, so workers that persist across epochs need no message to learn it."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        with _kept_generators():
            seed_sample(self.seed, epoch, index)
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        with _kept_generators():
            out = []
            for epoch, index in keys:
                seed_sample(self.seed, epoch, index)
                out.append(self.dataset[index])
            return out


class _kept_generators:
    """Put python's, numpy's and torch's CPU generator states back on exit."""

    def __enter__(self):
        self.states = (random.getstate(), np.random.get_state(),
                       torch.default_generator.get_state())

    def __exit__(self, *exc):
        random.setstate(self.states[0])
        np.random.set_state(self.states[1])
        torch.default_generator.set_state(self.states[2])
