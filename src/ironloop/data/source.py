"""Where a run's data comes in: the splits it trains and evaluates on, and its training batches.

The map-style-or-stream choice is made once, here (``open_data``): the loop asks the run's
``BatchSource`` for an epoch's batches and never asks what kind of data it reads.

- ``MapSource``: a map-style dataset in a keyed order that is a pure function of (seed, epoch)
  (``EpochSampler``), read by one DataLoader for the whole run (``EpochLoader``), so a resume
  starts slicing at the checkpoint's offset, with no replay.
- ``StreamOrder`` (``data/stream.py``): an IterableDataset or a StatefulDataLoader, resumed
  from its loader's own state.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, SequentialSampler, Subset

from ironloop.config import Config
from ironloop.data.inputs import map_style
from ironloop.data.lm import ContiguousStreams, check_eval_order, check_order
from ironloop.data.loader import (
    EpochLoader,
    EpochSampler,
    EvalSampler,
    TensorData,
    derive_seed,
    make_loader,
)
from ironloop.data.samplers import order_of
from ironloop.data.stream import (
    Stream,
    StreamOrder,
    as_stream,
    build_order,
    first_sample,
    refuse_eval_stream,
)
from ironloop.errors import ConfigError, DataError, UserError


class BatchSource(Protocol):
    """The training batches of a run, epoch by epoch, resumable at any sample offset.

    Samples are counted over all ranks: one global batch is ``batch_size * world_size``."""

    steps_per_epoch: int   # optimizer steps in a full epoch
    prefetch_ahead: bool   # whether a batch may be read before the step that trains on it
    epoch_known: bool      # steps_per_epoch is the epoch's length (a stream may not have one)

    @property
    def dataset(self) -> Any:
        """The training split as read."""
        ...

    @property
    def global_batch(self) -> int: ...

    @property
    def usable(self) -> int:
        """Samples served this epoch (a stream: as many as can be, until it ends)."""
        ...

    def set_epoch(self, epoch: int, offset: int = 0) -> None: ...

    def batches(self) -> Iterable:
        """This process's batches of the current epoch, from its offset."""
        ...

    def indices(self, start: int, end: int) -> list[int]:
        """The global sample indices at positions [start, end) of the epoch's order."""
        ...

    def set_skip(self, indices) -> None: ...

    def nonfinite_inputs(self, indices: list[int]) -> list[int]:
        """Which of these samples' inputs hold a NaN or inf (the guard's bad path)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class MapSource:
    """A map-style training split: a keyed order and one DataLoader for the run."""

    prefetch_ahead = True
    epoch_known = True

    def __init__(self, dataset, sampler: EpochSampler, steps_per_epoch: int, **loader_options):
        self.dataset, self.sampler, self.steps_per_epoch = dataset, sampler, steps_per_epoch
        self.loader = EpochLoader(dataset, sampler, **loader_options)

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    @property
    def usable(self) -> int:
        return self.sampler.usable

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        self.sampler.set_epoch(epoch, offset)

    def batches(self) -> Iterable:
        return self.loader

    def indices(self, start: int, end: int) -> list[int]:
        return self.sampler.indices(start, end)

    def set_skip(self, indices) -> None:
        self.sampler.set_skip(indices)

    def nonfinite_inputs(self, indices: list[int]) -> list[int]:
        return nonfinite_inputs(self.dataset, indices)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()  # the workers that persisted across epochs exit


@dataclass(frozen=True)
class EvalBatching:
    """How an evaluation split is batched: what its DataLoader said (batch size, sampler,
    collate_fn, drop_last), else the run's batch size, in order, with the training collate_fn.
    Per process, like ``train.batch_size``."""

    batch_size: int
    sampler: Any = None      # the DataLoader's sampler; None: the split in order
    collate_fn: Any = None
    drop_last: bool = False


@dataclass
class RunData:
    """A run's data: the training batches and the evaluation splits."""

    source: BatchSource
    train: Any             # the training split (a map-style dataset, or a Stream)
    val_sets: dict[str, Any]  # the validation sets by name ({"": it} for one unnamed set)
    test: Any              # map-style, or None
    collate_fn: Any        # a DataLoader's own collate_fn, kept for evaluation too
    # "val", "test": how each is batched in evaluation (a passed DataLoader's own batching)
    batching: dict[str, EvalBatching] = field(default_factory=dict)

    @property
    def val(self) -> Any:
        """The first validation set (the only one, usually), or None."""
        return next(iter(self.val_sets.values()), None)

    def described(self) -> dict:
        """config.yaml's ``used.data``: each split's type and size."""
        vals = {f"val_{k}" if k else "val": v for k, v in self.val_sets.items()}
        splits = {"train": self.train, **vals, "test": self.test}
        return {k: describe(v) for k, v in splits.items() if v is not None}

    def first_sample(self):
        """One training sample, read without moving any RNG (to infer the model's classes)."""
        return first_sample(self.train) if isinstance(self.train, Stream) else self.train[0]

    def once_over_train(self, batch_size: int, rank: int, size: int) -> Iterable | None:
        """This rank's share of the training split, once, in order (SWA's BatchNorm
        statistics: engine/average.py); None for a stream, which has no second pass."""
        if isinstance(self.train, Stream):
            return None
        return make_loader(self.train, EvalSampler(len(self.train), batch_size, 0, False,
                                                   rank=rank, world_size=size),
                           num_workers=0, pin_memory=False, collate_fn=self.collate_fn)

    def close(self) -> None:
        """Stop the training loader's workers (and a stream's prefetching)."""
        self.source.close()

    def in_memory(self) -> bool:
        """Every split an in-memory TensorData (its labels can be checked once, in full)."""
        sets = [ds for ds in (self.train, self.val, self.test) if ds is not None]
        return all(isinstance(ds, TensorData) for ds in sets)


def resolve_batch_size(cfg: Config, train_data) -> Config:
    """The config with a passed DataLoader's (or stream's) batch size, which it keeps."""
    stream = as_stream(train_data, "train_data")
    size = stream.batch_size if stream else map_style(train_data, "train_data").batch_size
    if size and size != cfg.train.batch_size:
        return cfg.with_overrides({"train.batch_size": size})
    return cfg


def open_data(cfg: Config, train_data, val_data, test_data, rank: int, world_size: int,
              device: torch.device, poison=None) -> RunData:
    """The run's splits and its BatchSource: the one place that tells a stream from a
    map-style dataset. ``poison`` (the fault injector's) may replace the training split."""
    refuse_eval_stream(test_data, "test_data")
    stream = as_stream(train_data, "train_data")  # an IterableDataset: data/stream.py
    train = None if stream else map_style(train_data, "train_data")
    collate_fn = train.collate_fn if train else None
    val_sets, val_batching = validation_sets(val_data, cfg, collate_fn, world_size)
    test_set, test_batching = eval_split(test_data, "test_data", cfg, collate_fn, world_size,
                                         subset=False)
    val_set = next(iter(val_sets.values()), None)
    check_needs_val(cfg, val_set)
    if val_set is not None and len(val_set) == 0 and rank == 0:
        print("warning: the validation split is empty (0 samples): this run reports no val_* "
              "metric and best.pt tracks nothing; check data.val_fraction or val_data")
    batching = {**val_batching, "test": test_batching}
    if stream:
        if poison is not None:
            poison(stream)  # refuses: a stream's samples have no index to poison
        order = build_order(cfg, stream, rank, world_size, device)
        return RunData(order, stream, val_sets, test_set, None, batching)
    assert train is not None
    train_set = train.dataset
    if len(train_set) == 0:
        raise DataError("the training split is empty (0 samples): check the dataset's path, "
                        "filter or split (data.val_fraction); there is nothing to train on")
    if poison is not None:
        train_set = poison(train_set)
    return RunData(_map_source(cfg, train_set, train.sampler, collate_fn, rank, world_size,
                               device), train_set, val_sets, test_set, collate_fn, batching)


def eval_split(data, what: str, cfg: Config, train_collate, world_size: int,
               subset: bool = True):
    """(dataset, EvalBatching) of a validation or test split: a passed DataLoader keeps its
    batch size, sampler, collate_fn and drop_last in evaluation, as training keeps a training
    DataLoader's; a plain dataset is batched by train.batch_size with the training collate_fn.
    Stream-shaped data (ContiguousStreams) is checked against its batching here, before any
    training (data/lm.py). ``subset``: eval.max_batches applies (validation, not test)."""
    given = map_style(data, what)
    if isinstance(data, DataLoader):
        batching = EvalBatching(given.batch_size or cfg.train.batch_size, given.sampler,
                                given.collate_fn, given.drop_last)
    else:
        batching = EvalBatching(cfg.train.batch_size, None, train_collate)
    if given.dataset is None:
        return None, batching
    check_eval_order(given.dataset, what, batching.batch_size, world_size,
                     in_order=batching.sampler is None or type(batching.sampler) is
                     SequentialSampler, from_loader=isinstance(data, DataLoader))
    dataset = eval_subset(given.dataset, cfg, world_size, batching.batch_size) if subset \
        else given.dataset
    if dataset is not given.dataset:  # a subset's indices are its own: read it in order
        batching = replace(batching, sampler=None)
    return dataset, batching


def eval_sampler(dataset, batching: EvalBatching, cfg: Config, rank: int,
                 world_size: int) -> EvalSampler:
    """An evaluation split's order on this rank, as ``batching`` says: every sample of it (all
    but a drop_last tail) exactly once over all ranks."""
    order, _ = order_of(batching.sampler, len(dataset), cfg.run.seed, shuffle=False)
    return EvalSampler(len(dataset), batching.batch_size, cfg.run.seed, shuffle=False,
                       rank=rank, world_size=world_size, order=order,
                       drop_last=batching.drop_last)


def eval_loader(dataset, batching: EvalBatching, cfg: Config, rank: int, world_size: int,
                device: torch.device, sampler: EvalSampler | None = None):
    """The batches of an evaluation split on this rank (``sampler``: its ``eval_sampler``,
    when the caller also reads its batch sizes)."""
    if sampler is None:
        sampler = eval_sampler(dataset, batching, cfg, rank, world_size)
    return make_loader(dataset, sampler, num_workers=cfg.data.num_workers,
                       pin_memory=cfg.data.pin_memory and device.type == "cuda",
                       collate_fn=batching.collate_fn, seed_samples=cfg.data.seed_samples)


def _map_source(cfg: Config, train_set, user_sampler, collate_fn, rank: int, world_size: int,
                device: torch.device) -> MapSource:
    order, warning = order_of(user_sampler, len(train_set), cfg.run.seed, cfg.data.shuffle)
    if warning and rank == 0:
        print(warning)
    sampler = EpochSampler(len(train_set), cfg.train.batch_size, cfg.run.seed,
                           shuffle=cfg.data.shuffle, rank=rank, world_size=world_size,
                           order=order)
    check_order(train_set, cfg.data.shuffle, sampler.global_batch)
    steps = math.ceil(sampler.usable / (sampler.global_batch * cfg.train.accumulation_steps))
    _warn_batch_size(cfg, len(train_set), world_size, rank)
    return MapSource(train_set, sampler, steps, num_workers=cfg.data.num_workers,
                     pin_memory=cfg.data.pin_memory and device.type == "cuda",
                     collate_fn=collate_fn, seed_samples=cfg.data.seed_samples)


def _warn_batch_size(cfg: Config, n: int, world_size: int, rank: int) -> None:
    per_step = cfg.train.batch_size * world_size
    if per_step > n and rank == 0:
        print(f"warning: train.batch_size={cfg.train.batch_size}"
              + (f" x {world_size} processes" if world_size > 1 else "")
              + f" is larger than the training split ({n} samples): each epoch is a single "
              f"optimizer step; lower train.batch_size")


def validation_sets(val_data, cfg: Config, train_collate, world_size: int
                    ) -> tuple[dict[str, Any], dict[str, EvalBatching]]:
    """The validation sets by name: ``{"": it}`` for one set (metrics ``val_<metric>``), the
    dict's names for a dict (``val_<name>_<metric>``), {} for none; and how each is batched,
    under "val" (one set) or "val_<name>"."""
    named = val_data if isinstance(val_data, dict) else {"": val_data}
    if named is val_data and not named:
        raise DataError("val_data={} names no validation set; pass None for a run without "
                        "validation, or {name: dataset, ...}")
    sets, batching = {}, {}
    for name, data in named.items():
        if named is val_data:
            check_set_name(name)
            if data is None:  # None means "no validation" for val_data itself, not for a name
                raise DataError(f"val_data[{name!r}] is None; give each named set a dataset, "
                                f"or leave {name!r} out")
        what = f"val_data[{name!r}]" if name else "val_data"
        refuse_eval_stream(data, what)
        dataset, batching[f"val_{name}" if name else "val"] = eval_split(
            data, what, cfg, train_collate, world_size)
        if dataset is not None:
            sets[name] = dataset
    return sets, batching


def check_set_name(name) -> None:
    """A validation set's name goes into metric names (``val_<name>_loss``)."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_]*", name) or \
            name == "avg":
        raise UserError(f"val_data: the set name {name!r} cannot name metrics; use letters, "
                        f"digits and _ (e.g. 'noisy'), and not 'avg' (the averaged weights' "
                        f"prefix)")


def eval_subset(val_set, cfg: Config, world_size: int | None = None,
                batch_size: int | None = None):
    """With eval.max_batches, the same fixed random subset of the val split at every
    evaluation (independent of run.seed), so evaluations compare like with like; of
    stream-shaped data, its first ``eval.max_batches`` chunks of every stream."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cap = cfg.eval.max_batches * (batch_size or cfg.train.batch_size) * world_size
    if val_set is None or not cap or cap >= len(val_set):
        return val_set
    if isinstance(val_set, ContiguousStreams):  # a random subset would cut the streams
        return Subset(val_set, range(cap))
    gen = torch.Generator().manual_seed(derive_seed("eval-subset"))
    idx = torch.randperm(len(val_set), generator=gen)[:cap].sort().values
    if isinstance(val_set, TensorData):  # keep the one-slice batch path
        return TensorData(val_set.x[idx], val_set.y[idx])
    return Subset(val_set, idx.tolist())


def check_needs_val(cfg: Config, val_set) -> None:
    if val_set is not None and len(val_set) > 0:
        return
    if cfg.schedule.name == "plateau":
        raise ConfigError("schedule.name='plateau' needs validation data to monitor "
                          f"{cfg.early_stop.metric}; set data.val_fraction > 0 (or pass "
                          "val_data), or pick another schedule")
    if cfg.early_stop.patience > 0:
        raise ConfigError("early_stop.patience > 0 needs validation data; set "
                          "data.val_fraction > 0 (or pass val_data), or early_stop.patience=0")


def describe(ds) -> dict | None:
    """A split's type and size for the records: the user's dataset, not ironloop's wrapper."""
    if ds is None:
        return None
    size: int | None
    try:
        size = len(ds)
    except TypeError:  # a stream (data/stream.py): its length when the dataset has one
        size = getattr(ds, "samples", None)
    if isinstance(ds, Stream):
        ds = ds.dataset
    return {"type": type(ds).__name__, "size": size}


def nonfinite_inputs(dataset, indices: list[int]) -> list[int]:
    """The indices among ``indices`` whose inputs hold a NaN or inf (bad path only: reads the
    samples again from the dataset)."""
    if isinstance(dataset, TensorData):
        x = dataset.x[torch.as_tensor(indices, dtype=torch.long)]
        if not x.is_floating_point():
            return []
        bad = ~torch.isfinite(x.reshape(len(x), -1)).all(1)
        return [indices[i] for i in bad.nonzero().flatten().tolist()]
    return [i for i in indices if _has_nonfinite(_inputs_of(dataset[i]))]


def _inputs_of(sample):
    if isinstance(sample, (tuple, list)) and len(sample) > 1:
        return sample[0]  # (inputs, targets)
    return sample


def _has_nonfinite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return any(_has_nonfinite(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_has_nonfinite(v) for v in obj)
    return False


__all__ = ["BatchSource", "EvalBatching", "MapSource", "RunData", "StreamOrder", "eval_loader",
           "eval_sampler", "eval_split", "open_data", "resolve_batch_size"]
