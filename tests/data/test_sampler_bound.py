"""A passed DataLoader's sampler longer than any epoch ironloop should hold (issue 59, item 4):
makemore's ``RandomSampler(replacement=True, num_samples=int(1e10))`` filled memory in
``list(sampler)`` before training. It is refused in one line, with bounded memory, before any
step; an endless sampler too; a long but bounded one trains."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, TensorDataset

import ironloop
from ironloop.data.samplers import longest
from ironloop.errors import DataError
from tests.conftest import blobs, cfg, tiny_mlp


def _data():
    b = blobs(n=64)
    return TensorDataset(b.x, b.y)


def test_a_ten_billion_sample_random_sampler_is_refused_with_bounded_memory(tmp_path):
    ds = _data()
    loader = DataLoader(ds, batch_size=16,
                        sampler=RandomSampler(ds, replacement=True, num_samples=10**10))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"the DataLoader's RandomSampler draws "
                                            r"10,000,000,000 samples an epoch, more than "
                                            r"1,048,576 \(64x the 64 in the dataset\).*"
                                            r"num_samples=len\(dataset\).*train.max_steps"):
            ironloop.fit(tiny_mlp(), loader, None, cfg(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**20  # about one bound's worth of indices, not 10**10 of them
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


class Endless(Sampler):
    """No __len__, never ends: a stream of random indices."""

    def __init__(self, n: int):
        self.n = n
        self.generator = None

    def __iter__(self):
        g = self.generator or torch.Generator().manual_seed(0)
        while True:
            yield from torch.randint(self.n, (4096,), generator=g).tolist()


def test_an_endless_sampler_is_refused_not_read_forever(tmp_path):
    ds = _data()
    with pytest.raises(DataError, match=r"Endless draws more samples an epoch"):
        ironloop.fit(tiny_mlp(), DataLoader(ds, batch_size=16, sampler=Endless(len(ds))), None,
                     cfg(tmp_path))


def test_a_long_bounded_sampler_trains(tmp_path):
    ds = _data()
    n = 3 * len(ds)  # three passes an epoch, drawn with replacement: well under the bound
    assert n < longest(len(ds))
    loader = DataLoader(ds, batch_size=16, sampler=RandomSampler(ds, replacement=True,
                                                                 num_samples=n))
    result = ironloop.fit(tiny_mlp(), loader, None, cfg(tmp_path, train__epochs=1))
    assert result.results["steps"] == n // 16
