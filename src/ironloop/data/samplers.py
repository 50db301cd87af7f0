"""A passed DataLoader's sampler, kept: how ironloop draws its order so that a resume is exact.

ironloop resumes mid-epoch by slicing the epoch's order at the saved sample offset, so it needs
the order of any epoch again, on demand. Per kind of sampler:

- ``SequentialSampler`` (``shuffle=False``) and a plain ``RandomSampler`` (``shuffle=True``):
  ironloop's own keyed order (``data/order.py``), unshuffled or shuffled; O(1) memory.
- ``DistributedSampler``: the same, by its ``shuffle``; ironloop shards the order between ranks
  itself.
- a sampler with a ``generator`` attribute (``WeightedRandomSampler``, ``SubsetRandomSampler``,
  ``RandomSampler`` with replacement or ``num_samples``, torchdata's ``RandomSampler``): a copy
  of it draws each epoch from a generator seeded by (seed, epoch), so the draw is exact.
- a sampler with ``state_dict``/``load_state_dict``: its state at the start of the epoch is
  saved, and a resume draws the epoch again from it.
- a sampler with ``set_epoch``: a pure function of the epoch, drawn again after ``set_epoch``.
- any other sampler: used as it is; a resume draws it afresh and skips as many samples as were
  consumed, which is exact only if the sampler gives the same order every time. One warning says
  so.

The last four hold one epoch's order as a tensor, of at most ``longest(N)`` samples (64 epochs'
worth, at least 2**20): a longer or endless sampler (``RandomSampler(replacement=True,
num_samples=10**10)``, makemore's "infinite" one) is refused in one line after reading that many,
before training, instead of filling memory; an epoch's length is ``train.max_steps``'s to bound.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from ironloop.data.order import KeyedOrder
from ironloop.data.seeding import derive_seed
from ironloop.errors import DataError


def order_of(sampler, n: int, seed: int, shuffle: bool = True):
    """(order, warning or None) for a DataLoader's sampler (None: ironloop's own order)."""
    if sampler is None:
        return KeyedOrder(n, seed, shuffle), None
    if type(sampler) is SequentialSampler:
        return KeyedOrder(n, seed, False), None
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == n:
        return KeyedOrder(n, seed, True), None
    if isinstance(sampler, DistributedSampler):
        return KeyedOrder(n, seed, sampler.shuffle), None
    if hasattr(sampler, "generator"):
        return DrawnOrder(sampler, seed, "generator", n), None
    if callable(getattr(sampler, "state_dict", None)) \
            and callable(getattr(sampler, "load_state_dict", None)):
        return DrawnOrder(sampler, seed, "state", n), None
    if callable(getattr(sampler, "set_epoch", None)):
        return DrawnOrder(sampler, seed, "set_epoch", n), None
    name = type(sampler).__name__
    return DrawnOrder(sampler, seed, "replay", n), (
        f"warning: the DataLoader's {name} has no set_epoch, state_dict or generator, so "
        f"ironloop cannot redraw an interrupted epoch: a mid-epoch resume draws the {name} "
        f"afresh and skips the samples already consumed, which is exact only if it yields the "
        f"same order every time (give it set_epoch(epoch) or state_dict()/load_state_dict() "
        f"to make resume exact)")


class DrawnOrder:
    """An epoch's order as the user's sampler draws it, redrawn on demand (see the module)."""

    def __init__(self, sampler, seed: int, how: str, n: int):
        self.sampler, self.seed, self.how, self.n = sampler, seed, how, n
        self._epoch: int | None = None
        self._drawn = torch.zeros(0, dtype=torch.long)
        self._kept: tuple | None = None      # (skip, the drawn order without it)
        self._start = None                    # "state": the sampler's state before this epoch
        self._restored: dict | None = None    # "state": a checkpoint's, used at the next draw

    def _draw(self, epoch: int) -> torch.Tensor:
        if self._epoch == epoch:
            return self._drawn
        sampler = self.sampler
        if self.how == "generator":
            sampler = copy.copy(sampler)  # the user's own generator is left alone
            sampler.generator = torch.Generator().manual_seed(
                derive_seed(self.seed, epoch, "sampler"))
        elif self.how == "set_epoch":
            sampler.set_epoch(epoch)
        elif self.how == "state":
            if self._restored is not None:
                r, self._restored = self._restored, None
                sampler.load_state_dict(r["start"] if r["epoch"] == epoch else r["after"])
            self._start = sampler.state_dict()
        self._drawn = _drawn(sampler, self.n)
        self._epoch, self._kept = epoch, None
        return self._drawn

    def _without(self, epoch: int, skip: torch.Tensor) -> torch.Tensor:
        drawn = self._draw(epoch)
        if not len(skip):
            return drawn
        if self._kept is None or not torch.equal(self._kept[0], skip):
            self._kept = (skip, drawn[~torch.isin(drawn, skip)])
        return self._kept[1]

    def size(self, epoch: int, skip: torch.Tensor) -> int:
        return len(self._without(epoch, skip))

    def indices(self, epoch: int, skip: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return self._without(epoch, skip)[start:end]

    def state_dict(self) -> dict:
        if self.how != "state":
            return {}
        if self._restored is not None:  # restored, not drawn yet: still the checkpoint's
            return self._restored
        return {"epoch": self._epoch, "start": self._start, "after": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.how == "state" and state:
            self._restored, self._epoch = state, None


def longest(n: int) -> int:
    """The most samples one drawn epoch may hold: 64 passes over the dataset, at least 2**20
    (8 MB of int64)."""
    return max(64 * n, 1 << 20)


def _drawn(sampler, n: int) -> torch.Tensor:
    """One epoch of ``sampler`` as a tensor, read lazily and refused past ``longest(n)``."""
    bound = longest(n)
    drawn = torch.as_tensor(list(itertools.islice(iter(sampler), bound + 1)), dtype=torch.long)
    if len(drawn) > bound:
        name = type(sampler).__name__
        try:
            size = f"{len(sampler):,} samples"
        except TypeError:  # no __len__: an endless sampler
            size = "more samples"
        raise DataError(f"the DataLoader's {name} draws {size} an epoch, more than {bound:,} "
                        f"(64x the {n:,} in the dataset), and ironloop holds an epoch's order to "
                        f"resume it exactly; give it num_samples=len(dataset) (or a few times "
                        f"that) and bound the run with train.max_steps instead")
    return drawn
