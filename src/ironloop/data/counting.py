"""How many samples a micro-batch holds: the loop's count, never a guess from the batch's shape.

The count weights the micro-batch's loss inside an accumulation window (``loss * n / window``),
the logged loss and samples/s, and an evaluation's mean. It is, in order:

1. the count the batch declares: an ``int`` attribute ``num_graphs`` (PyTorch Geometric's
   ``Batch``) or ``num_samples`` (any collate's own batch object), which a collate that drops or
   packs samples can set;
2. else the number of samples the sampler drew for this rank's batch (``rank_share``): what the
   order handed to the dataset, whatever the collate made of it.

A step that returns a weight (``(loss, metrics, weight)``, tokens) is weighted by it instead,
with accumulation or several ranks (engine/loop.py).

Why not the first tensor's length (as before): a graph batch ``(x_nodes, edge_index, batch, y)``
has one row of ``x`` per node, a time-first batch one per step, and counting those scaled every
update by nodes per graph, silently. The default step reads ``batch[0]`` as the inputs, one row
per sample: under it, a first tensor of another length is refused (``check_rows``).
"""

from __future__ import annotations

from typing import Any

import torch

from ironloop.errors import DataError


def rank_share(total: int, rank: int, world_size: int) -> int:
    """This rank's samples of a global batch of ``total``: ``torch.tensor_split``'s sizes (the
    first ``total % world_size`` ranks get one more), as ``EpochSampler`` splits it."""
    if world_size == 1:
        return total
    return total // world_size + (1 if rank < total % world_size else 0)


def declared_count(batch: Any) -> int | None:
    """The count a batch object declares (``num_graphs``, ``num_samples``), or None."""
    for name in ("num_graphs", "num_samples"):
        value = getattr(batch, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def counted(batch: Any, drawn: int) -> int:
    """The micro-batch's sample count: its declared count, else the ``drawn`` samples."""
    declared = declared_count(batch)
    return drawn if declared is None else declared


def first_leaf(batch: Any) -> Any:
    """What the default step would hand the model: the first item, all the way down."""
    if isinstance(batch, dict) and batch:
        return first_leaf(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return first_leaf(batch[0])
    return batch


def no_tensor(leaf: Any) -> DataError:
    """The one line for a batch with no tensor where its samples should be (text, say)."""
    return DataError(f"a batch is a {type(leaf).__name__}, which holds no tensor to count its "
                     f"samples by; make the dataset return tensors (tokenize text in it or in a "
                     f"collate_fn), or pass a step_fn with a collate_fn that does")


def structure(batch: Any, depth: int = 0) -> str:
    """A batch's structure for a message: ``tuple(Tensor[642, 16], Tensor[2, 1284], ...)``."""
    if isinstance(batch, torch.Tensor):
        return f"Tensor{list(batch.shape)}"
    if depth < 2 and isinstance(batch, dict):
        return "dict(" + ", ".join(f"{k}: {structure(v, depth + 1)}" for k, v in
                                   batch.items()) + ")"
    if depth < 2 and isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__}(" + ", ".join(structure(v, depth + 1)
                                                      for v in batch) + ")"
    return type(batch).__name__


def check_rows(batch: Any, drawn: int) -> None:
    """Under the default step, which reads ``batch[0]`` as the inputs (one row per sample):
    refuse a batch whose first tensor's length is not the number of samples drawn for it."""
    if declared_count(batch) is not None or isinstance(batch, dict):
        return  # a dict goes to model(**batch): counted by the samples drawn
    leaf = first_leaf(batch)
    if not isinstance(leaf, torch.Tensor):
        raise no_tensor(leaf)  # a str batch would reach the model as its inputs
    rows = leaf.shape[0] if leaf.ndim else None  # a shape read: no device sync
    if rows is None or rows == drawn:
        return
    raise DataError(f"a batch {structure(batch)} has {rows} rows in its first tensor, but the "
                    f"sampler drew {drawn} samples for it; the default step reads batch[0] as "
                    f"the inputs, one row per sample: put a per-sample tensor first, or pass a "
                    f"step_fn(model, batch) that unpacks this batch (it is then counted by the "
                    f"{drawn} samples drawn; see docs/how-to/bring-your-own.md, 'The batch "
                    f"contract')")
