"""Checks on the data: labels, leakage between splits, and whether the loader keeps up."""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch

from ironloop.data.loader import TensorData
from ironloop.outputs.time_split import tune_command, tune_hint
from ironloop.tools.doctor.env_checks import cores
from ironloop.tools.doctor.findings import Finding, info
from ironloop.tools.doctor.subject import DoctorSubject, labels_of


def check_labels(s: DoctorSubject, cap: int | None = None) -> list[Finding]:
    """5. Labels out of [0, C), classes that never appear, and the class balance."""
    c = s.num_classes
    if not c or not s.classification:
        return []
    out = []
    for split, data in (("train", s.train), ("val", s.val)):
        y = labels_of(data, cap)
        if y is None or not len(y):
            continue
        bad = (y < 0) | (y >= c)
        n_bad = int(bad.sum())  # host tensors: no device sync
        if n_bad:
            idx = bad.nonzero().flatten()[:5].tolist()
            out.append(Finding("labels", "error",
                               f"{split}: {n_bad} label(s) outside [0, {c}) (range "
                               f"{int(y.min())}..{int(y.max())}; e.g. samples {idx})",
                               f"the targets are not class indices 0..{c - 1}: 1-based labels, "
                               f"or more classes than the model's {c} outputs",
                               f"map the labels to 0..{c - 1} or give the model as many outputs "
                               f"as there are classes"))
            y = y[~bad]
            if not len(y):
                continue  # every label is out of range: no classes or balance to count
        counts = torch.bincount(y, minlength=c)[:c]
        missing = (counts == 0).nonzero().flatten().tolist()
        if missing and split == "train":
            out.append(Finding("labels", "warning",
                               f"train: {len(missing)} of {c} classes never appear: "
                               f"{missing[:10]}{' ...' if len(missing) > 10 else ''}",
                               "the model has outputs for classes it never sees (wrong "
                               "num_classes, or a filtered/mis-split dataset)",
                               "check the split and the number of classes"))
        share = counts.float() / max(len(y), 1)
        seen = share[counts > 0]
        balance = (f"{split} class balance: {len(y)} samples, smallest class "
                   f"{100 * float(seen.min()):.1f}%, largest {100 * float(seen.max()):.1f}%")
        if len(seen) > 1 and float(seen.max()) > 10 * float(seen.min()) and split == "train":
            out.append(Finding("labels", "warning", balance,
                               "classes differ more than 10x in frequency: accuracy will "
                               "reward predicting the common classes",
                               "set loss.class_weights, or resample the training set"))
        else:
            out.append(info("labels", balance))
    return out


#: A dict sample's keys that hold targets, not inputs (Hugging Face style).
LABEL_KEYS = ("labels", "label")


def _input_parts(sample) -> list:
    """A sample's inputs: the first of (inputs, targets), or every value of a dict sample but
    its labels (Hugging Face style: input_ids, attention_mask, ...)."""
    if isinstance(sample, dict):
        return [v for k, v in sample.items() if k not in LABEL_KEYS]
    return [sample[0]]


def _float_row(sample) -> torch.Tensor | None:
    """A sample's float inputs as one flat row, or None when it has none."""
    parts = [torch.as_tensor(v) for v in _input_parts(sample)]
    floats = [p.flatten() for p in parts if p.is_floating_point()]
    return torch.cat(floats) if floats else None


def _inputs(dataset, cap: int | None) -> torch.Tensor | None:
    """The float inputs of a dataset, one row per sample (the first ``cap`` when not in
    memory), or None when they are not float tensors of one shape."""
    if isinstance(dataset, TensorData):
        x = dataset.x
    else:
        n = len(dataset) if cap is None else min(cap, len(dataset))
        rows = [_float_row(dataset[i]) for i in range(n)]
        xs = [t for t in rows if t is not None]
        if not xs or len(xs) < len(rows) or any(t.shape != xs[0].shape for t in xs):
            return None
        x = torch.stack(xs)
    return x.reshape(len(x), -1) if x.is_floating_point() and len(x) else None


def check_finite_inputs(s: DoctorSubject, cap: int | None = None) -> list[Finding]:
    """Samples whose inputs hold NaN or inf: named by index, before they poison a step."""
    out = []
    for split, data in (("train", s.train), ("val", s.val), ("test", s.test)):
        x = _inputs(data, cap) if data is not None else None
        if x is None:
            continue
        bad = (~torch.isfinite(x.cpu())).any(1).nonzero().flatten()  # host copy: no sync
        if len(bad):
            out.append(Finding("finite_inputs", "error",
                               f"{split}: {len(bad)} sample(s) with NaN or inf inputs, e.g. "
                               f"samples {bad[:5].tolist()}",
                               "a non-finite input makes the loss and the gradients NaN at the "
                               "step that draws it (the guard would skip those steps)",
                               "clean or drop those samples (or impute the missing values)"))
    return out


def _hashes(dataset, cap: int | None) -> list[bytes]:
    """One 16-byte digest per sample's input (the first ``cap`` samples when not in memory)."""
    if isinstance(dataset, TensorData):
        x = dataset.x.detach().cpu().contiguous()
        rows: Iterable[Any] = x.reshape(len(x), -1).numpy()
    else:
        n = len(dataset) if cap is None else min(cap, len(dataset))
        rows = [b"".join(torch.as_tensor(v).detach().cpu().contiguous().numpy().tobytes()
                         for v in _input_parts(dataset[i])) for i in range(n)]
    return [hashlib.blake2b(r if isinstance(r, bytes) else r.tobytes(),
                            digest_size=16).digest() for r in rows]


def check_leakage(s: DoctorSubject, cap: int | None = None) -> list[Finding]:
    """6. Samples whose inputs appear in both train and val (or train and test). The share is
    over the samples read: with a cap (the preflight) only the first ``cap`` samples of a split
    not in memory are hashed, so a share found among them is a lower bound, and it says so."""
    if s.train is None:
        return []
    hashed = _hashes(s.train, cap)
    train: dict[bytes, int] = {}
    for i, h in enumerate(hashed):
        train.setdefault(h, i)
    out = []
    for split, data in (("val", s.val), ("test", s.test)):
        if data is None or not len(data):
            continue
        hashes = _hashes(data, cap)
        dup = [(i, train[h]) for i, h in enumerate(hashes) if h in train]
        whole = len(hashed) == len(s.train) and len(hashes) == len(data)
        if not dup:
            among = f"{len(train)} x {len(hashes)} samples" if whole else \
                f"{_read(hashed, s.train)} x {_read(hashes, data)} samples read"
            out.append(info("leakage", f"train/{split}: no duplicated inputs among {among}"))
            continue
        pairs = ", ".join(f"{split}[{a}]=train[{b}]" for a, b in dup[:5])
        among = "also appear in train" if whole else (
            f"appear among the {_read(hashed, s.train)} train samples read (a lower bound: "
            f"`ironloop doctor CONFIG` reads every sample)")
        out.append(Finding("leakage", "error",
                           f"{len(dup)} of {_read(hashes, data)} {split} samples "
                           f"({100 * len(dup) / len(hashes):.1f}%) {among}, e.g. {pairs}",
                           f"duplicated samples across the split: {split} scores will be "
                           f"optimistic (the model is graded on data it trained on)",
                           f"deduplicate before splitting, or drop these samples from {split}"))
    return out


def _read(hashes: list[bytes], dataset) -> str:
    """How many of a split's samples were hashed: 'N', or 'M of N' when the cap cut it."""
    return f"{len(hashes)}" if len(hashes) == len(dataset) else f"{len(hashes)} of {len(dataset)}"


def _loader_seconds_per_batch(s: DoctorSubject, max_batches: int, budget: float) -> float:
    """Median seconds per batch for the DataLoader in the main process: fetch + collate.
    The median, because a shared machine preempts now and then: one stall must not turn a fast
    loader into a slow one."""
    it = iter(s.loader())
    next(it)  # the first batch pays one-off costs
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(max_batches):
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return statistics.median(times) if times else 0.0


def _model_seconds_per_step(s: DoctorSubject, batch, steps: int, budget: float) -> float:
    """Seconds per optimizer step on the first batch, already in place (no loading), through
    the run's step: the median step on CPU, the mean over the steps (one sync at the end) on
    CUDA."""
    model, opt = s.copy()
    cuda = s.device.type == "cuda"

    def step():
        opt.zero_grad(set_to_none=True)
        s.loss(model, batch)[0].backward()
        opt.step()

    step()  # warm-up
    if cuda:
        torch.cuda.synchronize(s.device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps and time.perf_counter() - start <= budget:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(s.device)  # host sync: to time the GPU's work
        return (time.perf_counter() - start) / len(times)
    return statistics.median(times)


def check_input_bound(s: DoctorSubject, batch, max_batches: int = 8,
                      budget: float = 0.15) -> list[Finding]:
    """7. The DataLoader's batches/s against the model's steps/s on synthetic batches.

    The loader is timed in the main process (no worker start-up in the preflight); with
    ``data.num_workers = W`` its throughput is taken as W times that, the best W workers do.
    """
    load = _loader_seconds_per_batch(s, max_batches, budget)
    step = _model_seconds_per_step(s, batch, max_batches, budget)
    workers = s.cfg.data.num_workers
    effective = load / max(workers, 1)
    measured = (f"DataLoader {1 / max(load, 1e-9):.0f} batches/s per process"
                f"{f' (x{workers} workers)' if workers else ''}, model "
                f"{1 / max(step, 1e-9):.0f} steps/s on synthetic batches")
    if workers == 0 and load > 0.1 * step:
        share = load / (load + step)
        sev = "warning" if load > 0.25 * step else "info"
        return [Finding("input_bound", sev,
                        f"{measured}: loading would take {100 * share:.0f}% of each step",
                        "with data.num_workers=0 the model waits while each batch is loaded "
                        "and collated in the main process", loader_fix(s, load, step))]
    if effective > step:
        return [Finding("input_bound", "warning", f"{measured}: the loader is slower",
                        "the model waits for data: the DataLoader cannot keep up",
                        loader_fix(s, load, step))]
    return [info("input_bound", measured)]


def loader_fix(s: DoctorSubject, load: float, step: float) -> str:
    """The loader's next open steps: more workers while cores are left, the main process's
    threads off the workers' cores (CPU), pinned memory (CUDA, when off); else a cheaper
    __getitem__."""
    workers, n = s.cfg.data.num_workers, cores()
    need = max(2, min(32, n, int(load / step * 1.5) + 1))
    steps = [f"set data.num_workers={need}"] if need > workers else []
    threads = s.cfg.run.threads or torch.get_num_threads()
    if s.device.type == "cpu" and threads > max(1, n - max(need, workers)):
        steps.append(f"run.threads={max(1, n - max(need, workers))} (now {threads}: torch's "
                     f"threads take the cores the workers need)")
    if s.device.type == "cuda" and not s.cfg.data.pin_memory:
        steps.append("data.pin_memory=true")
    fix = (f"{', '.join(steps)}, or make __getitem__ cheaper" if steps else
           f"the {workers} workers already have the {n} cores: make __getitem__ cheaper "
           f"or move decoding/augmentation off the critical path")
    return f"{fix}; " + tune_hint(s.cfg.run.dir, f"`{tune_command()}` measures which is fastest")

