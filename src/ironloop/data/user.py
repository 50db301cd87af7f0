"""The user's own datasets from the config: ``data.name=module:factory``."""

from __future__ import annotations

import torch

from ironloop.data.bundle import DataBundle
from ironloop.errors import ConfigError
from ironloop.specs import accepted, import_spec


SPLITS = ("train", "val", "test")


def user_data(cfg) -> DataBundle:
    """Call ``factory(root=data.root, **data.kwargs)``; it returns ``(train, val[, test])``,
    each a Dataset, a DataLoader, an (inputs, targets) pair, or None (val, test); or a dict of
    them whose other keys are metadata (``vocab_size``, ``num_classes``, ``seq_len``, ...) that
    the model factory receives as keyword arguments (those its signature accepts).

    The input shape offered to the model factory is read off the first training sample; the
    class count is left to ``fit`` (inferred from the model's output when it is (N, C)).
    """
    factory = import_spec(cfg.name, "data.name")
    try:
        out = factory(**{**accepted(factory, root=cfg.root), **cfg.kwargs})
    except TypeError as e:
        raise ConfigError(f"data factory {cfg.name!r} rejected its arguments: {e}; "
                          f"check data.kwargs") from e
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
        x = train[0][0]
    else:
        sample = getattr(train, "dataset", train)[0]  # a DataLoader's dataset, or the Dataset
        x = sample[0] if isinstance(sample, (tuple, list)) else sample
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ()
    return DataBundle(train=train, val=val, test=test, input_shape=shape,
                      num_classes=meta.get("num_classes"), meta=meta)
