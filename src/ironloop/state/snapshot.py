"""CPU copies of a run's state: what an async checkpoint writes from, and the guard's
in-memory rollback point."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def snapshot(obj: Any, reuse: Any = None, pinned: bool = False) -> Any:
    """A CPU deep copy of the tensors and containers in ``obj``.

    ``copy=True`` matters: for a tensor already on CPU, ``.to("cpu")`` returns the same tensor,
    and the optimizer step that follows would change it while the background thread writes it.
    ``reuse`` is the previous snapshot, whose write has finished: a tensor of the same shape and
    dtype there is copied into rather than allocated, since fresh pages cost 5-10x the copy.

    ``pinned``: a CUDA tensor goes to page-locked memory with ``non_blocking``, so the host does
    not wait for each copy (a pageable device-to-host copy is a host sync; on an H200 a
    ResNet-50's state took 1,458 of them, 81 ms, at every save point). The copies are queued on
    the current stream, ahead of any later update of the tensors, so they read the values of
    now; but the host must not read the result before ``copies_done()``'s wait has returned.
    """
    if type(obj) in _ATOMS:  # most leaves (the config's values): one check, not three
        return obj
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        fits = isinstance(reuse, torch.Tensor) and reuse.shape == obj.shape \
            and reuse.dtype == obj.dtype and not obj.is_sparse
        if pinned and src.is_cuda and not src.is_sparse and not fits:
            try:
                into = torch.empty_like(src, device="cpu", pin_memory=True)
            except RuntimeError:  # page-locked memory refused (a locked-memory limit): pageable
                return src.to("cpu", copy=True)
            return into.copy_(src, non_blocking=True)
        if fits:  # pinned (the last copy's): queued on the stream; pageable: a host sync
            return reuse.copy_(src, non_blocking=pinned and reuse.is_pinned())
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        prev = reuse if isinstance(reuse, dict) else {}
        # an atom (most of the config's values) stays as it is, without a call of its own
        return {k: v if type(v) in _ATOMS else snapshot(v, prev.get(k), pinned)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) \
            else [None] * len(obj)
        items = [v if type(v) in _ATOMS else snapshot(v, r, pinned) for v, r in zip(obj, old)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def copies_done(obj: Any) -> Callable[[], None]:
    """A wait for the copies a pinned ``snapshot(obj)`` queued: one event recorded now on the
    current stream of each CUDA device in ``obj`` (the stream the copies went to), whose
    ``synchronize`` is the host sync, paid only when the wait is called. Without CUDA tensors
    nothing was queued, and the wait returns at once."""
    events = []
    if not torch.cuda.is_initialized():  # no CUDA tensor can exist: skip the walk (CPU runs)
        return lambda: None
    for device in {t.device for t in _tensors(obj) if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()
    return wait


#: Leaves that are returned as they are, told apart by their exact type.
_ATOMS = frozenset({int, float, str, bool, type(None)})


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
