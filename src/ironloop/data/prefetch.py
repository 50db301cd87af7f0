"""The next batch goes to the device while the current step computes.

``prefetch(batches, device)`` yields the batches already on ``device``, one ahead: before it
hands out batch i, it has started the copy of batch i+1. On CUDA the copy runs on a side stream
from pinned memory (``non_blocking``), so it overlaps the forward and backward of batch i on the
compute stream; the compute stream waits for the side stream only when it takes the batch. On
the CPU the copy is a no-op and only the order of work changes (the next batch is sliced
before the current one trains); the batches are the same objects in the same order.

The host-side label check runs on each batch before its copy, as before (a bad label raises
one batch earlier than without the look-ahead, before anything reaches the device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ironloop.data.loader import to_device


def prefetch(batches: Iterable, device: torch.device,
             check: Callable[[Any], None] | None = None, ahead: bool = True) -> Iterator:
    """``batches`` moved to ``device``, the next one's copy started before the current one is
    handed out. ``check`` (the label check) sees each batch on the host first.

    ``ahead=False`` reads a batch only when it is trained: a stream's loader (data/stream.py)
    keeps its position in its own state, which a checkpoint saves, so a batch read ahead and
    not trained would be skipped by a resume."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" and ahead else None
    source = iter(batches)

    def load():
        batch = next(source, _END)
        if batch is _END:
            return _END
        if check is not None:
            check(batch)
        if device.type == "cpu":
            return batch  # loaders yield host tensors: nothing to move
        if stream is None:
            return to_device(batch, device, False)
        with torch.cuda.stream(stream):  # pinned memory + non_blocking: an async copy
            return to_device(batch, device, True)

    if not ahead:
        while (batch := load()) is not _END:
            yield batch
        return
    following = load()
    while following is not _END:
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
            _keep_alive(following, torch.cuda.current_stream(device))
        batch, following = following, load()  # start the next copy before this batch trains
        yield batch


_END = object()


def _keep_alive(batch, compute: torch.cuda.Stream) -> None:
    """Tell the caching allocator the compute stream uses the side stream's tensors, so their
    memory is not reused before the step that reads them is done."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(compute)
    elif isinstance(batch, dict):
        for v in batch.values():
            _keep_alive(v, compute)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _keep_alive(v, compute)
    elif callable(getattr(batch, "record_stream", None)):  # PyTorch Geometric's Batch has one
        batch.record_stream(compute)
