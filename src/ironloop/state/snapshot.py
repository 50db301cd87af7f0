"""CPU copies of a run's state: what an async checkpoint writes from, and the guard's
in-memory rollback point."""

from __future__ import annotations

from typing import Any

import torch


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A CPU deep copy of the tensors and containers in ``obj``.

    ``copy=True`` matters: for a tensor already on CPU, ``.to("cpu")`` returns the same tensor,
    and the optimizer step that follows would change it while the background thread writes it.
    ``reuse`` is the previous snapshot, whose write has finished: a tensor of the same shape and
    dtype there is copied into rather than allocated, since fresh pages cost 5-10x the copy.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(reuse, torch.Tensor) and reuse.shape == obj.shape \
                and reuse.dtype == obj.dtype and not obj.is_sparse:
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        prev = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot(v, prev.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) \
            else [None] * len(obj)
        items = [snapshot(v, r) for v, r in zip(obj, old)]
        return items if isinstance(obj, list) else tuple(items)
    return obj
