"""Batches whose order depends only on (seed, epoch), resumable at any sample offset.

Why not ``DataLoader(shuffle=True)``: its order comes from the global RNG and its position cannot
be restored without replaying every batch. Here the epoch's permutation is a pure function of
(seed, epoch), batches are consecutive slices of it, and resuming means starting the slicing at a
sample offset: O(1), whatever the position in the epoch. Because the permutation does not depend on
the batch size, ``batch_size=64`` and ``batch_size=16, accumulation_steps=4`` see the same samples
in the same optimizer steps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ironloop.data.counting import declared_count, no_tensor, rank_share
from ironloop.data.order import KeyedOrder
from ironloop.data.seeding import SeededDataset, derive_seed  # derive_seed: re-exported
from ironloop.data.workers import shielded, stop_workers
from ironloop.errors import DataError


class TensorData(Dataset):
    """An in-memory dataset whose batches are one index-slice, not N ``__getitem__`` + collate.

    On a tiny MLP, per-sample collation was a third of the step time; ``__getitems__`` lets the
    DataLoader fetch a whole batch with one indexing op.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        if len(x) != len(y):
            raise DataError(f"the inputs hold {len(x)} samples and the targets {len(y)}; "
                            f"pass one target per input (the same first dimension)")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """``indices``: a list of ints, or a 1-D index tensor (the loop's sliced path)."""
        idx = indices if isinstance(indices, torch.Tensor) \
            else torch.as_tensor(indices, dtype=torch.long)
        # index_select copies the same rows as x[idx], in half the time on a small batch.
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


class TensorRows(Dataset):
    """A plain ``TensorDataset`` of one tensor or of three and more (a diffusion model's or a
    GAN's images alone; inputs, masks and targets), batched as TensorData is: one
    ``index_select`` per tensor, in place of N ``__getitem__`` and a collate. A batch is the
    list default_collate makes of the same samples, so a step sees what the DataLoader gave."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices) -> list[torch.Tensor]:
        """``indices``: a list of ints, or a 1-D index tensor (the loop's sliced path)."""
        idx = indices if isinstance(indices, torch.Tensor) \
            else torch.as_tensor(indices, dtype=torch.long)
        return [t.index_select(0, idx) for t in self.tensors]


def is_sliced(dataset, collate_fn=None) -> bool:
    """Whether ``make_loader`` batches ``dataset`` as index slices of in-memory tensors (a
    TensorData, or a plain TensorDataset of any number of tensors, with no collate_fn of its
    own): no per-sample path, so loader workers could only copy its slices between processes."""
    return collate_fn is None and (isinstance(dataset, (TensorData, TensorRows))
                                   or type(dataset) is TensorDataset)


def as_tensor_data(dataset) -> TensorData | None:
    """The same tensors as a TensorData when ``dataset`` holds (inputs, targets) in memory.

    Only a plain ``TensorDataset`` is converted: a subclass may override ``__getitem__`` (an
    augmentation, say), and slicing would skip it.
    """
    if isinstance(dataset, TensorData):
        return dataset
    if type(dataset) is TensorDataset and len(dataset.tensors) == 2:
        return TensorData(*dataset.tensors)
    return None


def _already_collated(batch):
    """``TensorData.__getitems__`` returns a finished batch (module-level: workers pickle it)."""
    return batch


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's own generator; derive python and numpy from it
    # so augmentations written with either are reproducible too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


#: Positions computed per pass of the order: enough to amortise its per-call cost over many
#: small batches, small enough (512 KB of int64) to keep the order's memory O(1) in N.
CHUNK = 1 << 16


class EpochSampler:
    """A batch sampler: the order of epoch e is a pure function of (seed, e).

    The order comes from ``order`` (``data/order.py``'s keyed permutation by default, or a
    passed DataLoader's sampler, ``data/samplers.py``), computed a chunk at a time, never whole.
    Samples are counted globally across ``world_size`` ranks: one global batch is
    ``batch_size * world_size`` consecutive samples of the order, split evenly between ranks.
    ``offset`` is how many samples of the epoch were already consumed.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool,
                 rank: int = 0, world_size: int = 1, order=None):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.order = order if order is not None else KeyedOrder(n, seed, shuffle)
        self.epoch, self.offset = 0, 0
        self.skip = torch.zeros(0, dtype=torch.long)  # the guard's skip list: never served

    def set_skip(self, indices) -> None:
        """Leave these samples out of every epoch from now on (the guard's skip list).

        The order stays a pure function of (seed, epoch, skip list): the skipped samples are
        taken out, so the samples before any skipped one keep their positions. A rollback adds
        only samples served after the state it restores, so its offset still means the same
        samples.
        """
        self.skip = torch.as_tensor(sorted(set(indices)), dtype=torch.long)

    def indices(self, start: int, end: int) -> list[int]:
        """The global sample indices at positions [start, end) of this epoch's order."""
        return self.order.indices(self.epoch, self.skip, start, end).tolist()

    def permutation(self) -> torch.Tensor:
        """The whole epoch's order, for small datasets and tests: O(N), unlike the batches."""
        return self.order.indices(self.epoch, self.skip, 0, self.order.size(self.epoch,
                                                                             self.skip))

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def usable(self) -> int:
        """Samples served per epoch: a tail smaller than the number of ranks is dropped, since
        it would leave a rank with an empty batch (and DDP waiting for its gradients)."""
        n = self.order.size(self.epoch, self.skip)
        tail = n % self.global_batch
        return n - tail if 0 < tail < self.world_size else n

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        self.epoch, self.offset = epoch, offset

    def index_batches(self) -> Iterator[torch.Tensor]:
        """This rank's batches as index tensors, a chunk of the order at a time."""
        end, size = self.usable, self.global_batch
        chunk = max(1, CHUNK // size) * size  # whole global batches
        for first in range(self.offset, end, chunk):
            idx = self.order.indices(self.epoch, self.skip, first, min(first + chunk, end))
            for start in range(0, len(idx), size):
                batch = idx[start:start + size]
                yield torch.tensor_split(batch, self.world_size)[self.rank] \
                    if self.world_size > 1 else batch

    def batch_sizes(self) -> Iterator[int]:
        """This rank's batch sizes, as ``index_batches`` yields them (an empty share left
        out), without computing the order: the samples each batch was drawn with."""
        end, size = self.usable, self.global_batch
        for first in range(self.offset, end, size):
            share = rank_share(min(size, end - first), self.rank, self.world_size)
            if share:
                yield share

    def __iter__(self) -> Iterator[list[int]]:
        for idx in self.index_batches():
            yield idx.tolist()  # what a DataLoader's batch_sampler hands to the dataset

    def __len__(self) -> int:
        return max(0, -(-(self.usable - self.offset) // self.global_batch))

    def state_dict(self) -> dict:
        order = self.order.state_dict() if hasattr(self.order, "state_dict") else {}
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset, "n": self.n,
                "order": order}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"the checkpoint was taken on a dataset of {state['n']} samples, "
                             f"this one has {self.n}")
        self.seed, self.epoch, self.offset = state["seed"], state["epoch"], state["offset"]
        self.order.seed = self.seed
        if hasattr(self.order, "load_state_dict"):
            self.order.load_state_dict(state.get("order") or {})


class EvalSampler(EpochSampler):
    """Evaluation shards that cover EVERY sample exactly once over all ranks.

    The training sampler drops a tail smaller than the number of ranks, because DDP needs a
    backward on every rank. Evaluation runs the unwrapped model and only all-reduces sums, so
    nothing needs dropping: the last global batch is split as far as it goes and a rank whose
    share is empty simply gets no batch (e.g. 359 samples, batch 179, 2 ranks: the 359th
    sample goes to rank 0 alone, instead of being silently left out of val_acc).

    ``drop_last`` (a passed val DataLoader's): only whole global batches are evaluated, so every
    batch on every rank has ``batch_size`` samples, as the DataLoader would give one process.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool, rank: int = 0,
                 world_size: int = 1, order=None, drop_last: bool = False):
        super().__init__(n, batch_size, seed, shuffle, rank, world_size, order)
        self.drop_last = drop_last

    @property
    def usable(self) -> int:
        n = self.order.size(self.epoch, self.skip)
        return n - n % self.global_batch if self.drop_last else n

    def index_batches(self) -> Iterator[torch.Tensor]:
        for batch in super().index_batches():
            if len(batch):  # an empty share of a tail smaller than world_size
                yield batch

    def __len__(self) -> int:
        left = max(0, self.usable - self.offset)
        if left == 0:
            return 0
        chunks = -(-left // self.global_batch)
        last = left - (chunks - 1) * self.global_batch  # tensor_split gives ranks < last a sample
        return chunks - 1 + (1 if last > self.rank else 0)


def make_loader(dataset: Dataset, sampler: EpochSampler, *, num_workers: int, pin_memory: bool,
                collate_fn=None, seed_samples: bool = True, persistent: bool = False):
    """The batches of the sampler's epoch from its offset: index slices of in-memory tensors
    (a TensorData, a plain TensorDataset) in this process, else a DataLoader, with its own
    generator.

    ``seed_samples``: each sample is loaded right after seeding python, numpy and torch from
    (seed, epoch, index) (``data/seeding.py``), so random augmentation is the same whatever the
    worker, the number of workers or the resume point. A TensorData, or a plain TensorDataset
    of any number of tensors, holds no randomness and is not wrapped. ``persistent``: the
    DataLoader is meant to be iterated once per epoch, and its workers stay up between epochs
    (the sampler lives in this process, so each ``iter()`` reads its current epoch and offset).

    The generator matters: creating a DataLoader iterator draws a base seed for its workers, and
    without a generator of its own that draw comes from the global torch RNG, which would then
    differ between an uninterrupted run and a resumed one.
    """
    batches: EpochSampler | KeyedBatches = sampler
    if collate_fn is None and type(dataset) is TensorDataset:
        # No plain TensorDataset draws a random number: no per-sample seeding to pay for.
        dataset = TensorRows(dataset.tensors)
    if collate_fn is None and isinstance(dataset, (TensorData, TensorRows)):
        if num_workers == 0:
            return _sliced(dataset, sampler, pin_memory)
        collate_fn = _already_collated
    elif seed_samples:
        dataset, batches = SeededDataset(dataset, sampler.seed), KeyedBatches(sampler)  # type: ignore[assignment]
    epoch = "every epoch" if persistent else sampler.epoch
    gen = torch.Generator().manual_seed(derive_seed(sampler.seed, epoch, "loader"))
    workers = num_workers > 0
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                      pin_memory=pin_memory, collate_fn=collate_fn, generator=gen,
                      worker_init_fn=shielded(_seed_worker) if workers else None,
                      persistent_workers=persistent and workers)


class KeyedBatches:
    """The sampler's batches as (epoch, index) keys, for a SeededDataset: the epoch travels
    with each index, so workers that persist across epochs seed every sample right."""

    def __init__(self, sampler: EpochSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.sampler.epoch
        for idx in self.sampler.index_batches():
            yield [(epoch, i) for i in idx.tolist()]

    def __len__(self) -> int:
        return len(self.sampler)


class EpochLoader:
    """The training batches of every epoch from one DataLoader, so that worker processes start
    once per run instead of once per epoch (starting them costs a fork, an import of the
    dataset's modules and a refill of the prefetch queue). ``iter()`` gives the batches of the
    sampler's current epoch from its offset; a DataLoader iterator left unfinished (max_steps,
    a guard rollback) is reset by the next ``iter()``, which drops the batches it prefetched.
    """

    def __init__(self, dataset, sampler: EpochSampler, **options):
        self.dataset, self.sampler, self.options = dataset, sampler, options
        self._loader: DataLoader | None = None
        self._it: Iterator | None = None  # the newest iterator: its workers, if any

    def __iter__(self):
        if self._loader is None:
            # Unseeded samples draw from their worker's stream: workers that persisted would
            # carry it across epochs, and an epoch would no longer be reproducible on its own.
            persist = self.options.get("seed_samples", True)
            made = make_loader(self.dataset, self.sampler, persistent=persist, **self.options)
            if not isinstance(made, DataLoader):
                return made  # a TensorData sliced in this process: a generator, per epoch
            self._loader = made
        self._it = iter(self._loader)
        return self._it

    def close(self) -> None:
        """Stop the workers now (data/workers.py: an error's traceback may still hold their
        iterator, which would keep them past the run)."""
        stop_workers(self._it)
        self._loader = self._it = None


def _sliced(dataset: TensorData | TensorRows, sampler: EpochSampler, pin_memory: bool):
    """In-memory tensors' batches without a DataLoader: the same batches, minus its per-batch
    bookkeeping and the index list round trip, which cost a tiny model a tenth of its step."""
    for idx in sampler.index_batches():
        batch: tuple | list = dataset.__getitems__(idx)
        yield type(batch)(t.pin_memory() for t in batch) if pin_memory else batch


def batch_size_of(batch) -> int:
    """Samples in a batch for a message (the doctor's): its declared count (a graph batch's
    ``num_graphs``), else the length of its first tensor (tuple, list or dict batches). The loop
    counts what the sampler drew instead (data/counting.py)."""
    declared = declared_count(batch)
    if declared is not None:
        return declared
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]  # not len(): Tensor.__len__ is a Python-level call
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    raise no_tensor(batch)


def to_device(batch, device: torch.device, non_blocking: bool):
    """Move a (nested) batch; non_blocking pairs with pinned memory to overlap the copy. An
    object with its own ``.to(device)`` (PyTorch Geometric's ``Batch``, Hugging Face's
    ``BatchEncoding``) moves itself; anything else (a string, a number) stays as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    move = getattr(batch, "to", None)
    if callable(move) and not isinstance(batch, (str, bytes)):
        try:
            return move(device, non_blocking=non_blocking)
        except TypeError:  # a .to(device) without non_blocking
            return move(device)
    return batch
