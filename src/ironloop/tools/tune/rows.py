"""What ``ironloop tune`` tries, as rows of its tables: one setting each, built from the config
and the machine; the package (``__init__.py``) measures them and decides."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ironloop.data import TensorData
from ironloop.state import drift
from ironloop.tools.tune.trials import Measure, Subject

#: The shortest run (seconds at the baseline's speed) a compile can pay for itself in.
COMPILE_MIN_RUN = 120.0


@dataclass
class Row:
    """One line of a tune table: a setting, what it changes, and how it did."""

    setting: str
    overrides: dict
    kind: str = "free"                # "free" (tune may apply it) or "trajectory"
    note: str = ""                    # e.g. "same trajectory up to float rounding"
    status: str = "planned"           # ok | failed | skipped
    reason: str = ""                  # why it failed or was skipped
    base: dict = field(default_factory=dict)  # the chosen settings it was measured on top of
    measure: Measure | None = None
    ratio: float | None = None        # samples/s against the baseline
    projected_s: float | None = None  # the whole run's training time at this speed
    verdict: str = ""
    pairs: dict | None = None         # the paired runs against the config it would replace
    won: bool = False                 # chosen (free) or the second table's winner
    gain: float = 1.0                 # a winner's run-time gain over what it replaced: the
                                      # median of its paired ratios
    kept: bool = False                # screened clearly faster: on for the next screens, then
                                      # confirmed with the others kept (spend.py)
    est_s: float | None = None        # its expected seconds, estimated before it started

    @property
    def measured(self) -> Measure:
        """The measure of a row whose trial ran (status "ok" sets it)."""
        assert self.measure is not None, f"{self.setting}: not measured"
        return self.measure

    @property
    def run_s(self) -> float:
        """``projected_s`` of a row whose trial ran (status "ok" sets it)."""
        assert self.projected_s is not None, f"{self.setting}: not measured"
        return self.projected_s

    def to_dict(self) -> dict:
        out = {"setting": self.setting, "kind": self.kind, "overrides": self.overrides,
               "on_top_of": self.base, "status": self.status, "verdict": self.verdict,
               "won": self.won}
        if self.note:
            out["note"] = self.note
        if self.reason:
            out["reason"] = self.reason
        if self.measure is not None:
            out.update(self.measure.to_dict(), ratio=_round(self.ratio),
                       projected_s=_round(self.projected_s))
        if self.pairs is not None:
            out["pairs"] = self.pairs
        if self.won:
            out["gain"] = round(self.gain, 4)
        if self.kept:
            out["kept"] = True
        if self.est_s is not None:
            out["est_s"] = round(self.est_s, 2)
        return out


def worker_counts(current: int, cpus: int) -> list[int]:
    """0, 1, 2, 4, ... up to the CPU count, without the current value."""
    counts = [0, 1, *(2 ** k for k in range(1, 10) if 2 ** k <= cpus)]
    return [c for c in counts if c != current]


def micro_batches(batch: int, accum: int) -> list[tuple[int, int]]:
    """(batch_size, accumulation_steps) pairs with a larger micro-batch and the same window."""
    return [(batch * k, accum // k) for k in (2, 4, 8, 16, 32) if k <= accum and accum % k == 0]


def cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # None when it cannot be determined


#: What a row that changes run.threads says in the table.
THREADS_NOTE = "run.threads: CPU reductions may round differently in the last bits"


def thread_counts(workers: int, cpus: int, current: int) -> list[int]:
    """The main process's intra-op threads to try with ``workers`` workers: the current count,
    the cores the workers leave free, and (without workers) one, which spin-waits on no busy
    core."""
    options = {current, max(1, cpus - workers)} | ({1} if workers == 0 else set())
    return sorted(options)


def loader_rows(subject: Subject, current: dict) -> list[Row]:
    """data.num_workers x run.threads, every pair but the current one: the main process's
    threads spin-wait between ops on the cores the workers need, so each is tried with the
    other."""
    cfg = subject.cfg.with_overrides(current)
    data = subject.train
    now_w, now_t = cfg.data.num_workers, cfg.run.threads or torch.get_num_threads()
    rows, workers = [], [now_w, *worker_counts(now_w, cpus())]
    if isinstance(data, (TensorData, tuple, list)) or \
            type(data) is torch.utils.data.TensorDataset:
        rows.append(Row("data.num_workers", {}, status="skipped",
                        reason="in-memory tensors are sliced in the main process: workers "
                        "only add copies"))
        workers = [now_w]
    for w in sorted(workers):
        for t in thread_counts(w, cpus(), now_t):
            overrides = {**({"data.num_workers": w} if w != now_w else {}),
                         **({"run.threads": t} if t != now_t else {})}
            if overrides:
                rows.append(Row(" ".join(f"{k}={v}" for k, v in overrides.items()), overrides,
                                note=THREADS_NOTE if "run.threads" in overrides else ""))
    return rows


def loader_extra_rows(subject: Subject, current: dict) -> list[Row]:
    """Persistent workers and prefetch depth, when the config has those keys (and workers)."""
    cfg = subject.cfg.with_overrides(current)
    if not cfg.data.num_workers:
        return []
    rows = []
    if hasattr(cfg.data, "persistent_workers") and drift.is_free("data.persistent_workers") \
            and not cfg.data.persistent_workers:
        rows.append(Row("data.persistent_workers=true", {"data.persistent_workers": True}))
    if hasattr(cfg.data, "prefetch_factor") and drift.is_free("data.prefetch_factor"):
        depth = (cfg.data.prefetch_factor or 2) * 2
        rows.append(Row(f"data.prefetch_factor={depth}", {"data.prefetch_factor": depth}))
    return rows


def pin_rows(subject: Subject, device: torch.device) -> list[Row]:
    if device.type != "cuda":
        return []  # pinning is for host-to-GPU copies; ironloop ignores it elsewhere
    pin = not subject.cfg.data.pin_memory
    return [Row(f"data.pin_memory={str(pin).lower()}", {"data.pin_memory": pin})]


def precision_rows(subject: Subject, device: torch.device) -> list[Row]:
    current = subject.cfg.train.precision
    if device.type == "cuda":
        options = (["bf16"] if torch.cuda.is_bf16_supported() else []) + ["fp16"]
    elif device.type == "cpu" and not _cpu_has_bf16():
        return [Row("train.precision=bf16", {}, kind="trajectory", status="skipped",
                    reason="this CPU has no native bf16 (AVX512-BF16 or AMX): emulated bf16 "
                    "is slower than fp32")]
    else:
        options = ["bf16"]
    return [Row(f"train.precision={p}", {"train.precision": p}, kind="trajectory",
                note="fp16 with a GradScaler" if p == "fp16" else "autocast, no scaler")
            for p in options if p != current]


def cuda_graph_rows(subject: Subject, device: torch.device) -> list[Row]:
    """CUDA only: the whole step replayed from one graph (engine/cuda_graph.py). A config it
    cannot capture (compile on, a closure optimizer...) fails its trial, and the row says why."""
    if device.type != "cuda" or subject.cfg.train.cuda_graph:
        return []
    return [Row("train.cuda_graph=true", {"train.cuda_graph": True},
                note="the same step, replayed from a CUDA graph")]


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def micro_batch_rows(subject: Subject, model_has_bn: bool) -> list[Row]:
    train = subject.cfg.train
    pairs = micro_batches(train.batch_size, train.accumulation_steps)
    if not pairs:
        return [Row("train.batch_size x k, accumulation / k", {}, kind="trajectory",
                    status="skipped", reason=f"train.accumulation_steps="
                    f"{train.accumulation_steps}: no accumulation to trade for a larger "
                    f"micro-batch")]
    note = ("BatchNorm: NOT the same trajectory (it normalises each micro-batch)" if model_has_bn
            else "the same global batch: same trajectory up to float rounding")
    return [Row(f"train.batch_size={b} train.accumulation_steps={a}",
                {"train.batch_size": b, "train.accumulation_steps": a}, kind="trajectory",
                note=note) for b, a in pairs]


def compile_rows(subject: Subject, base_run: float) -> list[Row]:
    """``base_run``: the whole run's projected seconds at the baseline's speed."""
    if subject.cfg.train.compile:
        return []
    row = Row("train.compile=true", {"train.compile": True})
    if base_run < COMPILE_MIN_RUN:
        row.status, row.reason = "skipped", (f"the whole run takes ~{base_run:.0f} s: too short "
                                             f"to repay a compile (tens of seconds)")
    return [row]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
