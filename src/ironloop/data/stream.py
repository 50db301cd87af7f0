"""Streams: an ``IterableDataset`` (or a torchdata ``StatefulDataLoader``) as the training split,
resumable mid-epoch.

A stream has no indices, so the resumable order of ``loader.EpochSampler`` does not apply: the
position in a stream is the state of its reader. That state is torchdata's
``StatefulDataLoader.state_dict()`` (the ``stream`` extra), which holds the dataset's own
``state_dict()`` (torchdata's Stateful protocol; Hugging Face ``datasets.IterableDataset`` has
one) in every worker, or, when the dataset has none, the number of batches to skip again.

``StreamOrder`` stands where the loop expects a sampler (``run.sampler``): the same ``usable``,
``global_batch``, ``set_epoch``, ``set_skip`` and ``state_dict`` the loop, the checkpoint and the
guard use, and ``batches()`` for the epoch's batches. What it decides:

- One ``StatefulDataLoader`` per epoch (a fresh worker pool, like the map-style loader), after
  ``dataset.set_epoch(epoch)`` and with a generator seeded from (seed, epoch): an epoch's start
  is a pure function of (seed, epoch), so a checkpoint at an epoch boundary holds no loader
  state at all, and the end-of-epoch reload that torchdata #1437 got wrong never happens.
  A ``StatefulDataLoader`` the user passed is used as it is, every epoch, its state saved
  mid-epoch; its generator (if any) is reseeded from (seed, epoch) at each epoch's start.
- Batches are full: the last partial batch of each worker is dropped (``drop_last``), so every
  micro-batch is ``batch_size`` samples and the loop's window arithmetic holds.
- The epoch ends when the stream does. The loop learns it one accumulation window ahead: the
  window's micro-batches are read before the first one runs, so a short last window is
  weighted exactly (``usable`` becomes the epoch's true size then). Under DDP the ranks agree
  on each window's length (one all-reduce per window): a rank whose share ends first ends the
  epoch for all, and the others' surplus batches are dropped, counted in a warning.
"""

from __future__ import annotations

import copy
import logging
import random
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ironloop.data.loader import derive_seed
from ironloop.data.workers import shielded, stop_workers
from ironloop.errors import CheckpointError, ConfigError, DataError, UserError
from ironloop.extras import require

RESUME_MODES = ("auto", "state", "replay")


def is_stateful_loader(data) -> bool:
    """A torchdata StatefulDataLoader (a DataLoader with a state): without importing torchdata."""
    return isinstance(data, DataLoader) and callable(getattr(data, "state_dict", None))


def is_stream(data) -> bool:
    """Whether ``data`` is read as a stream: an IterableDataset, a DataLoader over one, or any
    StatefulDataLoader (whose state is its position, whatever its dataset)."""
    if isinstance(data, (Stream, IterableDataset)):
        return True
    return isinstance(data, DataLoader) and (isinstance(data.dataset, IterableDataset)
                                             or is_stateful_loader(data))


@dataclass
class Stream:
    """The training split as a stream: what to read, and how to batch it.

    ``loader`` is a StatefulDataLoader the user passed (used as it is); otherwise ironloop
    builds one over ``dataset`` each epoch with ``batch_size`` (None: train.batch_size).
    """

    dataset: Any
    batch_size: int | None = None
    collate_fn: Any = None
    loader: Any = None

    @property
    def samples(self) -> int | None:
        """Samples per epoch per process, when the dataset (or the loader) says so."""
        if self.loader is not None and not isinstance(self.dataset, IterableDataset):
            return len(self.loader.dataset)
        try:
            return len(self.dataset)
        except TypeError:  # no __len__: a true stream
            return None

    def __repr__(self) -> str:
        return f"Stream({type(self.dataset).__name__})"


def as_stream(data, what: str) -> Stream | None:
    """A Stream when ``data`` is one (see ``is_stream``), else None (map-style data)."""
    if data is None or not is_stream(data):
        return None
    if isinstance(data, Stream):
        return data
    if is_stateful_loader(data):
        return Stream(data.dataset, data.batch_size, data.collate_fn, loader=data)
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise UserError(f"{what}: a DataLoader with batch_size=None (a dataset that yields "
                            f"whole batches) is not supported; yield samples and set the "
                            f"DataLoader's batch_size (or train.batch_size)")
        keep = data.collate_fn is not torch.utils.data.default_collate
        return Stream(data.dataset, data.batch_size, data.collate_fn if keep else None)
    return Stream(data)


def refuse_eval_stream(data, what: str) -> None:
    """Evaluation covers every sample once, split by index over the ranks: it needs a dataset
    with a length and indices."""
    if data is not None and is_stream(data):
        raise UserError(f"{what} is a stream ({type(data).__name__}); evaluation reads a "
                        f"map-style dataset (with __len__ and __getitem__): pass the validation "
                        f"split as one (for Hugging Face, load it with streaming=False), or None")


def stream_steps(stream: Stream, batch_size: int, accumulation: int, max_steps: int,
                 what: str = "train_data") -> int:
    """Optimizer steps per epoch: from the stream's length, or max_steps when it has none."""
    if stream.loader is not None and not isinstance(stream.dataset, IterableDataset):
        batches = len(stream.loader)  # a map-style StatefulDataLoader: its own sampler's length
    elif stream.samples is not None:
        batches = stream.samples // batch_size
    elif max_steps:
        return max_steps  # unknown: as far as the run is concerned, one epoch may be all of it
    else:
        raise ConfigError(f"{what} is a stream without __len__, so an epoch's length is unknown "
                          f"until it ends; set train.max_steps (the run's length in optimizer "
                          f"steps), or give the dataset a __len__")
    return max(1, -(-batches // accumulation))


def length_known(stream: Stream) -> bool:
    """Whether the stream's epoch has a length before it is read (its ``__len__``, or a
    map-style StatefulDataLoader's sampler)."""
    map_style = stream.loader is not None and not isinstance(stream.dataset, IterableDataset)
    return map_style or stream.samples is not None


def set_epoch(obj, epoch: int) -> None:
    """``obj.set_epoch(epoch)`` when it has one (HF IterableDataset, a sampler, a user's)."""
    if callable(getattr(obj, "set_epoch", None)):
        obj.set_epoch(epoch)


class Replayed(IterableDataset):
    """A stream without its ``state_dict``: torchdata then resumes it by reading again the
    batches served so far in the epoch (exact for any stream whose order is a pure function of
    the epoch; costs one re-read of those batches at each resume)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def set_epoch(self, epoch: int) -> None:
        set_epoch(self.dataset, epoch)

    def __iter__(self):
        yield from self.dataset


def hf_shuffle_buffer(dataset) -> bool:
    """Whether a Hugging Face IterableDataset shuffles through a buffer. Its state_dict does not
    hold the buffer ("examples from shuffle buffers are lost when resuming", HF's docs), so
    resuming from it is not exact. Reads HF's private example-iterable chain; False if absent."""
    ex = getattr(dataset, "_ex_iterable", None)
    while ex is not None:
        if type(ex).__name__ == "BufferShuffledExamplesIterable":
            return True
        ex = getattr(ex, "ex_iterable", None)
    return False


def resumes_by_replay(stream: Stream, mode: str) -> bool:
    """Whether a mid-epoch resume reads the epoch's served batches again (see ``Replayed``)."""
    if stream.loader is not None:
        return False  # the user's loader, its state as it is
    if mode == "replay":
        return True
    has_state = callable(getattr(stream.dataset, "state_dict", None))
    if mode == "state":
        if not has_state:
            raise ConfigError(f"data.stream_resume=state: {type(stream.dataset).__name__} has no "
                              f"state_dict()/load_state_dict(); implement them, or use auto")
        return False
    return not has_state or hf_shuffle_buffer(stream.dataset)


def replay_warning(stream: Stream) -> str:
    name = type(stream.dataset).__name__
    why = ("its shuffle buffer is not part of its state_dict (Hugging Face drops it on resume)"
           if hf_shuffle_buffer(stream.dataset) else "it has no state_dict()/load_state_dict()")
    return (f"warning: {name} is a stream and {why}: a mid-epoch resume reads again, and "
            f"discards, every batch served so far in that epoch (exact, but it costs up to an "
            f"epoch of reading). For an instant exact resume, give the dataset state_dict() and "
            f"load_state_dict() (torchdata's Stateful protocol) that restore its position")


class StreamOrder:
    """The loop's BatchSource for a stream (see the module docstring and ``data/source.py``).
    Counts global samples like ``EpochSampler``: one global batch is ``batch_size *
    world_size`` samples. Not read ahead: its loader's state is what a checkpoint saves, so a
    batch prefetched and not trained would be skipped by a resume."""

    prefetch_ahead = False
    steps_per_epoch = 0  # set by build_order
    epoch_known = True   # False without a length: steps_per_epoch is then train.max_steps

    def __init__(self, stream: Stream, batch_size: int, seed: int, *, accumulation: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, resume: str = "auto",
                 rank: int = 0, world_size: int = 1, device: torch.device | None = None):
        self.stream, self.batch_size, self.seed = stream, batch_size, seed
        self.accumulation, self.num_workers, self.pin_memory = accumulation, num_workers, \
            pin_memory
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")
        self.replay = resumes_by_replay(stream, resume)
        self.expected = stream.samples if stream.loader is None else None
        self.epoch = self.offset = 0
        self.end: int | None = None      # the epoch's size in samples, once the stream ended
        self.pending: dict | None = None  # a loader state to resume from (a checkpoint's)
        self.loader = None               # the epoch's loader while it is being read
        self._it: Iterator | None = None  # and its iterator: its workers, if any
        self.skip: list[int] = []

    @property
    def dataset(self) -> Stream:
        return self.stream

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def usable(self) -> int:
        """Samples in this epoch: unknown (as large as can be) until the stream ends."""
        return self.end if self.end is not None else sys.maxsize

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        if offset == 0:
            # An epoch's start is a function of (seed, epoch) alone. A loader state held here is
            # the previous epoch's: a run that ended at an epoch's last step saved its finished
            # loader with the next epoch's position, and loading it would replay that end.
            self.pending = None
        self.epoch, self.offset, self.end = epoch, offset, None

    def set_skip(self, indices) -> None:
        """The guard's skip list names samples by index; a stream has none (``indices`` gives
        the guard nothing to list), so the list stays empty and nothing is skipped: a rollback
        reads the same samples again (docs/how-to/streams.md)."""
        self.skip = sorted(set(indices))

    def indices(self, start: int, end: int) -> list[int]:
        return []  # a stream's samples have no index for guard.jsonl or the skip list

    def nonfinite_inputs(self, indices: list[int]) -> list[int]:
        return []  # nothing to read again: a stream's samples have no index

    def close(self) -> None:
        """Stop the epoch's workers now (data/workers.py: an error's traceback may still hold
        their iterator, which would keep them past the run)."""
        stop_workers(self._it)
        self._it = None

    # ---------------------------------------------------------------- state ----------------
    def state_dict(self) -> dict:
        loader = self.loader.state_dict() if self.loader is not None else self.pending
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset,
                "num_workers": self.num_workers, "world_size": self.world_size,
                "loader": loader, "stream": True}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("stream"):
            raise CheckpointError("the checkpoint was taken on a map-style dataset, this run "
                                  "reads a stream; resume with the data it was written with")
        if state["offset"] and state["num_workers"] != self.num_workers \
                and self.stream.loader is None:
            raise CheckpointError(
                f"the checkpoint stopped mid-epoch in a stream read by data.num_workers="
                f"{state['num_workers']}; a stream's order and state depend on its workers, so "
                f"resume with data.num_workers={state['num_workers']} (it may change at an "
                f"epoch boundary)")
        ranks = state.get("world_size", self.world_size)  # older checkpoints: not recorded
        if state["offset"] and ranks != self.world_size:
            # each rank reads its own share of the stream: another number of ranks splits the
            # rest of the epoch differently, and no rank's loader state says where it stands
            raise CheckpointError(
                f"the checkpoint stopped mid-epoch {state['epoch'] + 1} in a stream read by "
                f"{ranks} rank(s), and this run has {self.world_size}; a stream's position is "
                f"per rank, so resume with {ranks} rank(s) (the number of ranks may change at "
                f"an epoch boundary: a checkpoint of an epoch's last step, e.g. "
                f"checkpoint.every_steps=0)")
        self.seed, self.epoch, self.offset = state["seed"], state["epoch"], state["offset"]
        self.pending, self.loader, self.end = state["loader"], None, None

    # ---------------------------------------------------------------- the epoch's batches --
    def open(self):
        """The epoch's loader, at the epoch's start or at the checkpoint's position."""
        s = self.stream
        if s.loader is not None:
            loader = s.loader
            # The user's loader, reseeded: an epoch's order becomes a pure function of (seed,
            # epoch), as with ironloop's own loaders. torchdata 0.11 restores a shuffling
            # loader's generator exactly mid-epoch but not across the next epoch boundary
            # (measured: the epoch after a resume was shuffled differently).
            if loader.generator is not None:
                loader.generator.manual_seed(derive_seed(self.seed, self.epoch, "loader"))
            set_epoch(getattr(loader, "sampler", None), self.epoch)
            if loader.num_workers:  # its workers leave stop signals to this process
                loader.worker_init_fn = shielded(loader.worker_init_fn)
        else:
            dataset = Replayed(s.dataset) if self.replay else s.dataset
            cls = require("torchdata.stateful_dataloader", "stream",
                          "training on an IterableDataset").StatefulDataLoader
            gen = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, "loader"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torchdata's "set_vital is deprecated"
                loader = cls(dataset, batch_size=self.batch_size, drop_last=True,
                             num_workers=self.num_workers, pin_memory=self.pin_memory,
                             collate_fn=s.collate_fn, generator=gen,
                             worker_init_fn=shielded() if self.num_workers else None)
        set_epoch(s.dataset, self.epoch)
        if self.pending is not None:
            loader.load_state_dict(self.pending)
        elif self.offset:
            raise CheckpointError("the checkpoint stopped mid-epoch in a stream but holds no "
                                  "loader state; resume from an epoch-boundary checkpoint")
        self.pending = None
        return loader

    def batches(self) -> Iterator:
        """This process's batches for the epoch, from ``offset``. Sets ``end`` one window before
        the stream's end (see the module docstring)."""
        self.loader = loader = self.open()
        state = torch.get_rng_state()  # a loader without a generator draws its seed from it
        with _quiet_fast_forward():
            self._it = it = iter(loader)
        torch.set_rng_state(state)
        pos, served = self.offset, self.offset // self.global_batch
        while True:
            window = self._read(it, served)
            k = self._agree(len(window))
            if k < len(window) and self.world_size > 1:
                print(f"warning: rank {self.rank}'s share of the stream held {len(window) - k} "
                      f"batch(es) more than another rank's in epoch {self.epoch + 1}; dropped "
                      f"(give every rank an equal share)", file=sys.stderr)
            if k < self.accumulation:
                self.end = pos + k * self.global_batch
            for batch in window[:k]:
                pos += self.global_batch
                served += 1
                yield batch
            if k < self.accumulation:
                break
        self._check_length(served)
        self.loader = None  # the epoch is over: the next starts from (seed, epoch + 1)

    def _read(self, it, served: int) -> list:
        """Up to one accumulation window of batches; a failure names where in the stream."""
        window: list = []
        while len(window) < self.accumulation:
            try:
                window.append(next(it))
            except StopIteration:
                break
            except Exception as e:  # a corrupt shard or sample, mid-epoch
                n = served + len(window)
                raise DataError(
                    f"the training stream {self.stream} failed in epoch {self.epoch + 1} "
                    f"reading batch {n + 1} (after {n * self.batch_size} samples on this "
                    f"process): {_describe(e)}. Fix or remove that "
                    f"shard or sample and resume with --resume; the checkpoints written so "
                    f"far are intact") from e
            if self.expected is not None and \
                    (served + len(window)) * self.batch_size > self.expected:
                raise DataError(
                    f"the training stream {self.stream} yielded more than its __len__ of "
                    f"{self.expected} samples in epoch {self.epoch + 1}: its __len__ is "
                    f"wrong; make it return the samples it yields per epoch (per process), "
                    f"or remove it and set train.max_steps")
        return window

    def _check_length(self, served: int) -> None:
        """A stream that ends well before its __len__ said (each worker may drop one partial
        batch, so up to num_workers batches short is fine)."""
        if served == 0:
            raise DataError(f"the training stream {self.stream} yielded no full batch of "
                            f"{self.batch_size} samples in epoch {self.epoch + 1}; an epoch "
                            f"needs at least one (is the stream empty, or train.batch_size "
                            f"larger than it?)")
        if self.expected is None:
            return
        least = self.expected // self.batch_size - max(self.num_workers, 1) + 1
        if served < least:
            raise DataError(
                f"the training stream {self.stream} ended early in epoch {self.epoch + 1}: "
                f"{served} full batches of {self.batch_size} (at most {served * self.batch_size} "
                f"+ {max(self.num_workers, 1) * (self.batch_size - 1)} samples), but its "
                f"__len__ says {self.expected}; a shard may be missing or truncated, or "
                f"__len__ is wrong")

    def _agree(self, k: int) -> int:
        """Under DDP, the fewest batches any rank has for this window (every rank must run as
        many backward passes)."""
        if self.world_size == 1:
            return k
        t = torch.tensor([k], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())  # host sync: once per window, streams under DDP only


class _quiet_fast_forward:
    """torchdata logs its own fast-forward warning at each resume; ironloop says it once, with
    what it costs, when the run starts."""

    def __enter__(self):
        self.log = logging.getLogger("torchdata.stateful_dataloader.stateful_dataloader")
        self.level = self.log.level
        self.log.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.log.setLevel(self.level)


def _describe(e: BaseException) -> str:
    """"Type: message"; for an error raised in a worker, the worker's own last line (torch wraps
    it as "Caught X in DataLoader worker process N" + the worker's traceback)."""
    text = [line for line in str(e).strip().splitlines() if line.strip()]
    if text and text[0].startswith("Caught "):
        return text[-1].strip()
    return f"{type(e).__name__}: {text[0] if text else '(no message)'}"


def build_order(cfg, stream: Stream, rank: int, world_size: int,
                device: torch.device) -> StreamOrder:
    """The stream's BatchSource for the loop, with its optimizer steps per epoch. Rank 0 prints
    the replay warning here, once per process."""
    require("torchdata.stateful_dataloader", "stream", "training on an IterableDataset")
    t = cfg.train
    order = StreamOrder(stream, t.batch_size, cfg.run.seed, accumulation=t.accumulation_steps,
                        num_workers=cfg.data.num_workers,
                        pin_memory=cfg.data.pin_memory and device.type == "cuda",
                        resume=cfg.data.stream_resume, rank=rank, world_size=world_size,
                        device=device)
    if order.replay and rank == 0:
        print(replay_warning(stream))
    order.steps_per_epoch = stream_steps(stream, t.batch_size, t.accumulation_steps,
                                         t.max_steps)
    order.epoch_known = length_known(stream)
    return order


def first_sample(stream: Stream):
    """The stream's first (inputs, targets) sample, read from a copy (the stream's own position
    and the global RNGs are left as they were); None when it cannot be read that way."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        loader = DataLoader(copy.deepcopy(stream.dataset), batch_size=1,
                            collate_fn=stream.collate_fn)
        batch = next(iter(loader))
    except Exception:  # noqa: BLE001 - a reader that cannot be copied or read here: nothing is inferred
        return None
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(t[0] if isinstance(t, torch.Tensor) else t for t in batch)
    return None
