"""The keyed order: a bijection of [0, N) from (seed, epoch) alone, a batch at a time at any N,
with the guard's skip list taken out without moving the other samples."""

from __future__ import annotations

import pytest
import torch

from ironloop.data.loader import EpochSampler
from ironloop.data.order import KeyedOrder

NONE = torch.zeros(0, dtype=torch.long)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_every_epoch_is_a_permutation_and_inverse_undoes_it(n):
    order = KeyedOrder(n, seed=5, shuffle=True)
    for epoch in (0, 1):
        perm = order.indices(epoch, NONE, 0, n)
        assert sorted(perm.tolist()) == list(range(n))
        assert order.permutation(epoch).inverse(perm.clone()).tolist() == list(range(n))
    if n > 8:  # a shuffle: another epoch or seed gives another order
        assert not torch.equal(order.indices(0, NONE, 0, n), order.indices(1, NONE, 0, n))
        assert not torch.equal(order.indices(0, NONE, 0, n),
                               KeyedOrder(n, seed=6, shuffle=True).indices(0, NONE, 0, n))


@pytest.mark.parametrize("shuffle", [True, False])
def test_skipped_samples_leave_and_nothing_else_moves(shuffle):
    n = 500
    order = KeyedOrder(n, seed=0, shuffle=shuffle)
    full = order.indices(3, NONE, 0, n).tolist()
    skip = torch.tensor([0, 17, 18, 250, 499])
    kept = order.indices(3, skip, 0, order.size(3, skip)).tolist()
    assert kept == [i for i in full if i not in set(skip.tolist())]
    assert order.indices(3, skip, 100, 140).tolist() == kept[100:140]  # any slice, same order


def test_a_billion_samples_cost_a_batch_not_an_epoch():
    n = 10**9
    order = KeyedOrder(n, seed=0, shuffle=True)
    idx = order.indices(0, NONE, n // 2, n // 2 + 4096)
    assert len(set(idx.tolist())) == 4096 and int(idx.min()) >= 0 and int(idx.max()) < n
    # The same positions give the same samples from a fresh object (a resumed process).
    assert torch.equal(KeyedOrder(n, 0, True).indices(0, NONE, n // 2 + 96, n // 2 + 128),
                       idx[96:128])
    s = EpochSampler(n, 256, seed=0, shuffle=True, rank=1, world_size=2)
    s.set_epoch(0, offset=n // 2)
    first = next(s.index_batches())  # rank 1's half of the global batch at the offset
    assert torch.equal(first, idx[256:512])


def test_a_permutation_called_on_positions_gives_the_indices_its_inverse_undoes():
    perm = KeyedOrder(100, seed=3, shuffle=True).permutation(0)
    idx = perm(torch.arange(100))
    assert idx.dtype == torch.long and sorted(idx.tolist()) == list(range(100))
    assert perm.inverse(idx).tolist() == list(range(100))
    assert idx.tolist() != list(range(100))  # shuffled


def test_a_drawn_order_is_long_indices_whatever_integer_type_the_sampler_yields():
    import numpy as np
    from torch.utils.data import SubsetRandomSampler

    from ironloop.data.samplers import order_of

    order, warning = order_of(SubsetRandomSampler(np.array([5, 3, 9], dtype=np.int32)), 10, 0)
    assert warning is None
    got = order.indices(0, NONE, 0, 3)
    assert got.dtype == torch.long and sorted(got.tolist()) == [3, 5, 9]


# ------------------------------------------------------------------ order ------------------
def test_a_permutation_computes_in_int64_whatever_the_positions_integer_type():
    from ironloop.data.order import KeyedOrder

    perm = KeyedOrder(5000, seed=3, shuffle=True).permutation(1)
    wide = perm(torch.arange(5000))
    assert wide.dtype == torch.long and sorted(wide.tolist()) == list(range(5000))
    assert torch.equal(perm(torch.arange(5000, dtype=torch.int32)), wide)


# ------------------------------------------------------------------ the keyed order --------
def _reference_order(n: int, seed: int, epoch: int) -> list[int]:
    """data/order.py's docstring, written out in plain Python ints: a 6-round balanced Feistel
    network on the smallest even number of bits (at least 2) that covers n, keyed by
    derive_seed(seed, epoch, "order", round), each round's function a 32-bit multiply-xorshift
    hash, cycle-walked back into [0, n)."""
    import hashlib

    def seed_of(*parts) -> int:
        digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def mix(x: int) -> int:
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
        return (x >> 16) ^ x

    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = 2**half - 1
    keys = [seed_of(seed, epoch, "order", r) % 2**32 for r in range(6)]

    def network(x: int) -> int:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (mix(right ^ k) & mask)
        return (left << half) | right

    out = []
    for p in range(n):
        y = network(p)
        while y >= n:
            y = network(y)
        out.append(y)
    return out


@pytest.mark.parametrize("n, seed, epoch", [(10, 0, 0), (64, 3, 1), (100, 7, 2), (1000, 1, 5)])
def test_the_keyed_order_is_the_documented_feistel_network(n, seed, epoch):
    """The order is part of a checkpoint's meaning (a resume slices it at the saved offset): it
    must stay the documented function of (seed, epoch), release after release."""
    from ironloop.data.order import KeyedOrder

    got = KeyedOrder(n, seed, shuffle=True).indices(epoch, NONE, 0, n).tolist()
    assert got == _reference_order(n, seed, epoch)


def test_an_inverse_permutation_computes_in_int64_whatever_the_indices_integer_type():
    from ironloop.data.order import KeyedOrder

    perm = KeyedOrder(5000, seed=3, shuffle=True).permutation(1)
    back = perm.inverse(perm(torch.arange(5000)))
    assert back.dtype == torch.long and back.tolist() == list(range(5000))
    assert torch.equal(perm.inverse(perm(torch.arange(5000)).to(torch.int32)), back)
