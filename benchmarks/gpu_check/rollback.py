"""Part 6, the guard's rollback point at a save point: pageable copies against pinned ones.

The guard keeps an in-memory copy of the run's state (model and optimizer) and takes it again
at every save point. Copied as before, each CUDA tensor is a pageable device-to-host copy, and
each such copy is a host sync: the H200 profile of 2026-11-27 counted 1,458 of them, 81 ms,
per save point of a ResNet-50 run. Now the copy goes into the last snapshot's page-locked
tensors with ``non_blocking``, queued on the stream; only a rollback waits for it.

The rows, on ResNet-50's state after one fused AdamW step (the median of the repetitions):
the old way (a fresh pageable snapshot); the pinned one's first time (its page-locked memory is
allocated); and the pinned one after, both the time the host is held (what a save point costs
the loop) and the time until the copies have landed (what a rollback would wait). The copy of
the last one is compared with the state: equal, or the row fails. The async checkpoint's
staging copy took the same path: the old one's time (into its last, pageable, copy) and the
host time of three ``FileWriter.save`` calls now (the first allocates its pinned
memory).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from functools import partial

import torch

from benchmarks.gpu_check.shared import Part, resnet50, sync
from ironloop.state.file_writer import FileWriter
from ironloop.state.snapshot import copies_done, snapshot


def measure(part: Part) -> dict:
    make, name = resnet50(part.dry)
    model = make().to(part.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=part.cuda)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the optimizer's state exists, as at any save point
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    tensors = [t for t in state["model"].values()] + \
        [t for s in state["optimizer"]["state"].values() for t in s.values()]
    reps = 3 if part.dry else 10

    def timed(fn) -> float:
        sync(part.device)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    pageable = [timed(lambda: snapshot(state)) for _ in range(reps)]
    held: dict = {"old": snapshot(state)}

    def into_pageable() -> None:  # the async checkpoint's staging copy before: reused, pageable
        held["old"] = snapshot(state, held["old"])
    reused = [timed(into_pageable) for _ in range(reps)]
    del held["old"]

    def first() -> None:
        held["snap"] = snapshot(state, None, pinned=True)
        copies_done(state)()
    first_ms = timed(first)
    host, landed = [], []
    for _ in range(reps):
        sync(part.device)
        start = time.perf_counter()
        held["snap"] = snapshot(state, held["snap"], pinned=True)
        wait = copies_done(state)
        host.append((time.perf_counter() - start) * 1e3)
        wait()
        landed.append((time.perf_counter() - start) * 1e3)
    snap = held["snap"]
    with tempfile.TemporaryDirectory() as d:  # an async checkpoint: the host held by save()
        manager = FileWriter(d, keep_last=1, async_write=True)
        saves = []
        for step in range(1, 4):
            manager.wait()
            saves.append(timed(partial(manager.save, state, step=step)))
        manager.close()
    same = all(torch.equal(snap["model"][k], v.cpu()) for k, v in state["model"].items())
    pinned = all(t.is_pinned() for t in snap["model"].values() if t.numel()) if part.cuda \
        else None
    return {"model": name, "tensors": len(tensors),
            "megabytes": round(sum(t.numel() * t.element_size() for t in tensors) / 1e6, 1),
            "pageable_ms": statistics.median(pageable), "pageable_ms_range": [
                round(min(pageable), 2), round(max(pageable), 2)],
            "pageable_reused_ms": statistics.median(reused), "pinned_first_ms": first_ms,
            "pinned_host_held_ms": statistics.median(host),
            "pinned_landed_ms": statistics.median(landed),
            "host_held_pageable_over_pinned": statistics.median(pageable) /
            max(statistics.median(host), 1e-6),
            "pinned": pinned, "equal": same,
            "async_save_held_ms": [round(v, 2) for v in saves],
            **({"problem": "the pinned snapshot differs from the state"} if not same else {})}


def main() -> None:
    part = Part("rollback", __doc__.splitlines()[0])
    part.attempt("ResNet-50 + AdamW state, one save point", lambda: measure(part),
                 cpu_status="skipped: no CUDA (the same copies, none of them pinned)")


if __name__ == "__main__":
    main()
