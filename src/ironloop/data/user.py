"""The user's own datasets from the config: ``data.name=module:factory``."""

from __future__ import annotations

import os

import torch

from ironloop.data.bundle import DataBundle
from ironloop.data.stream import as_stream, first_sample, is_stream
from ironloop.errors import ConfigError, DataError
from ironloop.specs import accepted, call_factory, import_spec

SPLITS = ("train", "val", "test")


def user_data(cfg) -> DataBundle:
    """Call ``factory(root=data.root, **data.kwargs)`` (plus ``rank`` and ``world_size`` when it
    takes them); it returns ``(train, val[, test])``, each a Dataset, a DataLoader, an (inputs,
    targets) pair, or None (val, test); train may be a stream (an IterableDataset, a DataLoader
    over one, a StatefulDataLoader). Or a dict of them whose other keys are metadata
    (``vocab_size``, ``num_classes``, ``seq_len``, ...) that the model factory receives as
    keyword arguments (those its signature accepts).

    The input shape offered to the model factory is read off the first training sample; the
    class count is left to ``fit`` (inferred from the model's output when it is (N, C)).
    """
    factory = import_spec(cfg.name, "data.name")
    # A factory that takes rank and world_size gets them (torchrun's), to hand each process a
    # disjoint share of a stream (HF: split_dataset_by_node(ds, rank, world_size)).
    where = {"rank": int(os.environ.get("RANK", "0")),
             "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    out = call_factory(factory, f"data factory {cfg.name!r}", "data.kwargs",
                       **{**accepted(factory, root=cfg.root, **where), **cfg.kwargs})
    meta = {}
    if isinstance(out, dict):  # {"train": ..., "val": ..., "test": ..., anything else: metadata}
        if "train" not in out:
            raise ConfigError(f"data factory {cfg.name!r} returned a dict without 'train'; "
                              f"return {{'train': ..., 'val': ..., 'vocab_size': ...}}")
        meta = {k: v for k, v in out.items() if k not in SPLITS}
        out = [out.get(k) for k in SPLITS]
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise ConfigError(f"data factory {cfg.name!r} returned {type(out).__name__}; return "
                          f"(train, val) or (train, val, test) datasets, or a dict of them "
                          f"with metadata for the model factory")
    train, val, test = (*out, None)[:3]
    if isinstance(train, (tuple, list)):  # an (inputs, targets) pair of tensors
        if not len(train[0]):
            raise DataError(f"data factory {cfg.name!r} returned an empty training split "
                            f"(inputs of length 0); return at least one training sample")
        x = train[0][0]
    elif is_stream(train):  # read off a copy: the stream itself stays at its start
        stream = as_stream(train, "train")
        sample = first_sample(stream) if stream is not None else None
        x = sample[0] if sample else None
    else:
        dataset = getattr(train, "dataset", train)  # a DataLoader's dataset, or the Dataset
        if train is None or _empty(dataset):
            raise DataError(f"data factory {cfg.name!r} returned an empty training split "
                            f"({_what(train)}); return at least one training sample")
        sample = dataset[0]
        x = sample[0] if isinstance(sample, (tuple, list)) else sample
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ()
    return DataBundle(train=train, val=val, test=test, input_shape=shape,
                      num_classes=meta.get("num_classes"), meta=meta)


def _empty(dataset) -> bool:
    try:
        return len(dataset) == 0
    except TypeError:  # no __len__: read as it comes
        return False


def _what(train) -> str:
    return "None" if train is None else f"a {type(train).__name__} of length 0"
