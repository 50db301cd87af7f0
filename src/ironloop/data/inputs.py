"""What ``fit()`` accepts as map-style data, as what the loop iterates: a dataset, plus what a
DataLoader passed in says about it (its collate_fn, batch size and sampler).

A DataLoader is taken apart rather than iterated: ironloop needs to draw the order of any epoch
again to resume mid-epoch without replaying batches. Its dataset, collate_fn and batch size are
kept, and so is its sampler's meaning (``data/samplers.py``): ``shuffle=False`` stays in order,
a WeightedRandomSampler keeps its weights. In-memory (inputs, targets) tensors, however passed,
become a TensorData: one index-slice per batch instead of per-sample ``__getitem__`` + collate,
with the same batches. A Hugging Face ``datasets.Dataset`` is used as it is, formatted as torch
tensors when it has no format of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, default_collate

from ironloop.data.loader import TensorData, as_tensor_data
from ironloop.errors import UserError


class MapData(NamedTuple):
    dataset: Any
    collate_fn: Any = None        # a DataLoader's own collate_fn, kept
    batch_size: int | None = None  # a DataLoader's batch size
    sampler: Any = None           # a DataLoader's sampler; None: ironloop's shuffled order
    drop_last: bool = False       # a DataLoader's drop_last (evaluation honours it)


def map_style(data, what: str) -> MapData:
    """The map-style dataset in ``data`` (a Dataset, a DataLoader, an HF Dataset, an (inputs,
    targets) pair, or None), and what its DataLoader says about batching it."""
    if data is None:
        return MapData(None)
    if isinstance(data, DataLoader):
        return _from_loader(data, what)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        if any(isinstance(d, (Dataset, DataLoader)) or is_hf_dataset(d) for d in data):
            # [val_a, val_b] read as (inputs, targets): a traceback deep in the evaluation
            raise UserError(f"{what} is a {type(data).__name__} of datasets, not an (inputs, "
                            f"targets) pair; pass one dataset, or several validation sets as "
                            f"a dict {{name: dataset}}")
        return MapData(TensorData(torch.as_tensor(data[0]), torch.as_tensor(data[1])))
    if is_hf_dataset(data):
        return MapData(data.with_format("torch") if data.format["type"] is None else data)
    if isinstance(data, Dataset):
        tensors = as_tensor_data(data)  # not `or`: an empty TensorData is falsy
        return MapData(data if tensors is None else tensors)
    raise UserError(f"{what} must be a torch Dataset, a DataLoader, a Hugging Face "
                    f"datasets.Dataset or an (inputs, targets) pair, not "
                    f"{type(data).__name__}")


def is_hf_dataset(data) -> bool:
    """A Hugging Face ``datasets.Dataset`` (map-style), told apart without importing it."""
    return type(data).__module__.startswith("datasets.") and type(data).__name__ == "Dataset"


def _from_loader(loader: DataLoader, what: str) -> MapData:
    dataset = loader.dataset
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise UserError(f"{what}: ironloop needs a map-style dataset (with __getitem__ and "
                        f"__len__) to resume mid-epoch; an IterableDataset is not supported")
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise UserError(f"{what}: the DataLoader's batch_sampler "
                        f"({type(loader.batch_sampler).__name__}) cannot be resumed mid-epoch "
                        f"by ironloop; pass sampler=... and batch_size=... instead")
    if loader.batch_sampler is None:  # batch_size=None: each "batch" one unbatched sample
        raise UserError(f"{what}: a DataLoader with batch_size=None yields single samples, "
                        f"not batches (ironloop batches by train.batch_size); pass "
                        f"batch_size=N, or the dataset itself")
    sampler = loader.sampler
    if is_hf_dataset(dataset):
        return MapData(map_style(dataset, what).dataset, _own_collate(loader),
                       loader.batch_size, sampler, loader.drop_last)
    tensors = as_tensor_data(dataset)
    if tensors is not None and loader.collate_fn is default_collate:
        return MapData(tensors, None, loader.batch_size, sampler, loader.drop_last)
    keep = not isinstance(dataset, TensorData)
    return MapData(dataset, _own_collate(loader) if keep else None, loader.batch_size, sampler,
                   loader.drop_last)


def _own_collate(loader: DataLoader):
    """The DataLoader's collate_fn when the user gave one (None: the default)."""
    return None if loader.collate_fn is default_collate else loader.collate_fn
