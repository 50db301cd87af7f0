"""An epoch's sample order at any dataset size: position -> sample index, computed per batch.

``randperm(N)`` holds N int64s (8 GB at a billion samples) and takes seconds to build. Here the
order is a keyed bijection of [0, N): a balanced Feistel network on the smallest even number of
bits that covers N, cycle-walked back into [0, N) (a value that lands at or past N goes through
the network again until it does not; the domain is under 4N, so that is a few passes at most).
Any position's sample is computed on its own, so a batch costs O(batch) time and the order
O(1) memory, whatever N and wherever in the epoch a resume starts. The key is derived from
(seed, epoch): the order is a pure function of those two, and of nothing else (not the batch
size, not the number of workers).

The guard's skip list removes samples from the order without moving the others: the skipped
samples' positions come from the inverse permutation (a Feistel network runs backwards as
cheaply as forwards), and a position in the filtered order maps to the raw position with one
``searchsorted`` over the skip list.
"""

from __future__ import annotations

import numpy as np
import torch

from ironloop.data.seeding import derive_seed

ROUNDS = 6
_M32 = 0xFFFFFFFF


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (two multiply-xorshift rounds). Inputs are below 2**32 and the
    multiplier below 2**27, so every product fits in int64: no overflow, the same bits on every
    platform."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


class Permutation:
    """A keyed bijection of [0, n), forwards and backwards. The arithmetic runs in numpy int64
    on the host: index math, so the loop's host-read count (tests/test_host_reads.py) sees no
    tensor read in it."""

    def __init__(self, n: int, keys: list[int]):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [k & _M32 for k in keys]

    def _network(self, x: np.ndarray, keys) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def _network_inverse(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in reversed(self.keys):
            left, right = right ^ (_mix(left ^ k) & self.mask), left
        return (left << self.half) | right

    def _walk(self, x: np.ndarray, step) -> np.ndarray:
        y = step(x)
        out = y >= self.n
        while out.any():  # numpy on the host: no tensor, no device
            y[out] = step(y[out])
            out = y >= self.n
        return y

    def apply(self, positions: np.ndarray) -> np.ndarray:
        return self._walk(positions, lambda x: self._network(x, self.keys))

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.apply(np.asarray(positions, dtype=np.int64)))

    def inverse(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._walk(np.asarray(indices, dtype=np.int64),
                                           self._network_inverse))


class KeyedOrder:
    """The order of epoch e over n samples: shuffled by a Permutation keyed by (seed, e), or
    0..n-1; minus a skip list, whose samples are left out and whose removal moves nothing
    else."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cached: tuple | None = None  # ((seed, epoch), skip, its sorted raw positions)

    def permutation(self, epoch: int) -> Permutation:
        return Permutation(self.n, [derive_seed(self.seed, epoch, "order", r)
                                    for r in range(ROUNDS)])

    def size(self, epoch: int, skip: torch.Tensor) -> int:
        return self.n - len(skip)

    def indices(self, epoch: int, skip: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The sample indices at positions [start, end) of epoch ``epoch``'s order."""
        positions = np.arange(start, end, dtype=np.int64)
        if len(skip):
            gaps = self._skipped_positions(epoch, skip).numpy()  # cached: once per skip list
            # The raw position of filtered position p is p plus the skips at or before it:
            # gaps[j] - j counts the kept positions before the j-th skipped one.
            lead = gaps - np.arange(len(gaps))
            positions = positions + np.searchsorted(lead, positions, side="right")
        return torch.from_numpy(self.permutation(epoch).apply(positions) if self.shuffle
                                else positions)

    def _skipped_positions(self, epoch: int, skip: torch.Tensor) -> torch.Tensor:
        cached, key = self._cached, (self.seed, epoch)  # a resume may set another seed
        if cached is None or cached[0] != key or not torch.equal(cached[1], skip):
            raw = self.permutation(epoch).inverse(skip.clone()) if self.shuffle else skip
            self._cached = cached = (key, skip, raw.sort().values)
        return cached[2]
