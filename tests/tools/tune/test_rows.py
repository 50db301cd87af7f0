"""tools.tune.rows: what tune tries (workers, threads, pinning, precision, micro-batches, compile)
and a row's figures."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from examples.slow_reads import SlowReads
from ironloop.config import Config
from ironloop.data import TensorData
from ironloop.tools import tune as tune_mod
from ironloop.tools.tune import rows, rows as tune_rows
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Measure
from tests.tools.tune.helpers import Reads, data, subject


def test_what_tune_tries():
    assert tune_rows.thread_counts(0, 2, current=2) == [1, 2]
    assert tune_rows.thread_counts(2, 2, current=2) == [1, 2]  # leave the workers the cores
    assert tune_rows.thread_counts(1, 2, current=1) == [1]
    assert tune_rows.thread_counts(4, 16, current=16) == [12, 16]
    assert tune_rows.worker_counts(0, 2) == [1, 2]
    assert tune_rows.worker_counts(2, 16) == [0, 1, 4, 8, 16]
    assert tune_rows.micro_batches(32, 4) == [(64, 2), (128, 1)]
    assert tune_rows.micro_batches(32, 1) == [] and tune_rows.micro_batches(32, 3) == []


def test_workers_and_threads_are_tried_together(monkeypatch):
    monkeypatch.setattr(tune_rows, "cpus", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    subject = tune_mod.Subject(Config(), lambda: nn.Linear(16, 4), SlowReads(n=8, delay=0))
    rows = {r.setting: r for r in tune_rows.loader_rows(subject, {})}
    assert set(rows) == {"run.threads=1", "data.num_workers=1", "data.num_workers=1 run.threads=1",
                         "data.num_workers=2", "data.num_workers=2 run.threads=1"}
    assert rows["data.num_workers=2 run.threads=1"].overrides == {"data.num_workers": 2,
                                                                 "run.threads": 1}
    assert rows["data.num_workers=2 run.threads=1"].kind == "free"  # drift's FREE: see there
    assert "round differently" in rows["run.threads=1"].note
    assert not rows["data.num_workers=2"].note
    # in-memory tensors: no worker rows, but the threads are still tried
    tensors = tune_mod.Subject(Config(), lambda: nn.Linear(16, 4),
                               (torch.randn(8, 16), torch.zeros(8, dtype=torch.long)))
    assert [r.setting for r in tune_rows.loader_rows(tensors, {}) if r.status != "skipped"] == \
        ["run.threads=1"]


# -- rows.py --------------------------------------------------------------------------------------


def test_a_rows_dict_has_its_figures_only_once_measured():
    row = Row("run.threads=1", {"run.threads": 1})
    assert (row.kind, row.note, row.status, row.reason, row.base, row.verdict) == \
        ("free", "", "planned", "", {}, "")
    assert (row.measure, row.ratio, row.projected_s, row.pairs, row.won, row.gain) == \
        (None, None, None, None, False, 1.0)
    assert row.to_dict() == {"setting": "run.threads=1", "kind": "free",
                             "overrides": {"run.threads": 1}, "on_top_of": {},
                             "status": "planned", "verdict": "", "won": False}
    m = Measure(100.0, (90.0, 110.0), [90.0, 100.0, 110.0], 2.5, 0.5, 3.0)
    done = Row("x", {"a": 1}, kind="trajectory", note="n", status="ok", reason="r",
               base={"b": 2}, measure=m, ratio=1.234567, projected_s=10.000061, verdict="v",
               pairs={"ratios": [1.5]}, won=True, gain=1.234567)
    assert done.to_dict() == {"setting": "x", "kind": "trajectory", "overrides": {"a": 1},
                              "on_top_of": {"b": 2}, "status": "ok", "verdict": "v",
                              "won": True, "note": "n", "reason": "r", **m.to_dict(),
                              "ratio": 1.2346, "projected_s": 10.0001,
                              "pairs": {"ratios": [1.5]}, "gain": 1.2346}
    assert Row("y", {}, measure=m).to_dict()["ratio"] is None
    assert rows._round(None) is None and rows._round(2.000049) == 2.0
    assert done.measured is m and done.run_s == 10.000061
    with pytest.raises(AssertionError, match="^y: not measured$"):
        Row("y", {}).measured  # noqa: B018
    with pytest.raises(AssertionError, match="^y: not measured$"):
        Row("y", {}).run_s  # noqa: B018


def test_worker_thread_and_micro_batch_options():
    assert rows.worker_counts(0, 16) == [1, 2, 4, 8, 16]
    assert rows.worker_counts(1, 1) == [0]
    assert rows.worker_counts(4, 3) == [0, 1, 2]
    assert rows.worker_counts(3, 4096) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert rows.micro_batches(8, 32) == [(16, 16), (32, 8), (64, 4), (128, 2), (256, 1)]
    assert rows.micro_batches(8, 64) == [(16, 32), (32, 16), (64, 8), (128, 4), (256, 2)]
    assert rows.micro_batches(8, 6) == [(16, 3)]
    assert rows.micro_batches(8, 2) == [(16, 1)]
    assert rows.thread_counts(0, 4, 4) == [1, 4]
    assert rows.thread_counts(1, 8, 8) == [7, 8]
    assert rows.thread_counts(3, 2, 2) == [1, 2]  # more workers than cores: one thread
    assert rows.thread_counts(2, 4, 4) == [2, 4]


def test_cpus_are_this_processs_affinity_else_the_machines_count(monkeypatch):
    monkeypatch.setattr(rows.os, "sched_getaffinity",
                        lambda pid: {0, 1, 2} if pid == 0 else set(), raising=False)
    assert rows.cpus() == 3
    monkeypatch.delattr(rows.os, "sched_getaffinity")
    monkeypatch.setattr(rows.os, "cpu_count", lambda: 6)
    assert rows.cpus() == 6
    monkeypatch.setattr(rows.os, "cpu_count", lambda: None)
    assert rows.cpus() == 1


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(rows, "cpus", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)


def test_loader_rows_pair_every_worker_count_with_its_thread_counts(four_cores):
    got = rows.loader_rows(subject(train=Reads()), {})
    assert [r.setting for r in got] == [
        "run.threads=1", "data.num_workers=1 run.threads=3", "data.num_workers=1",
        "data.num_workers=2 run.threads=2", "data.num_workers=2",
        "data.num_workers=4 run.threads=1", "data.num_workers=4"]
    assert got[1].overrides == {"data.num_workers": 1, "run.threads": 3}
    assert got[2].overrides == {"data.num_workers": 1}
    assert [r.note for r in got] == [rows.THREADS_NOTE, rows.THREADS_NOTE, "",
                                     rows.THREADS_NOTE, "", rows.THREADS_NOTE, ""]
    assert rows.THREADS_NOTE == "run.threads: CPU reductions may round differently in the last bits"
    assert {(r.kind, r.status) for r in got} == {("free", "planned")}
    # on top of 2 workers and 2 threads (the config's run.threads, not torch's count)
    now = rows.loader_rows(subject(train=Reads()), {"data.num_workers": 2, "run.threads": 2})
    assert [r.overrides for r in now] == [
        {"data.num_workers": 0, "run.threads": 1}, {"data.num_workers": 0},
        {"data.num_workers": 0, "run.threads": 4}, {"data.num_workers": 1},
        {"data.num_workers": 1, "run.threads": 3}, {"data.num_workers": 4, "run.threads": 1},
        {"data.num_workers": 4}]


def test_in_memory_tensors_get_no_worker_rows(four_cores):
    x, y = data(10)
    skipped = Row("data.num_workers", {}, status="skipped",
                  reason="in-memory tensors are sliced in the main process: workers only add "
                         "copies")
    threads = Row("run.threads=1", {"run.threads": 1}, note=rows.THREADS_NOTE)
    for train in ((x, y), [x, y], TensorData(x, y), torch.utils.data.TensorDataset(x, y)):
        assert rows.loader_rows(subject(train=train), {}) == [skipped, threads]

    class Tensors(torch.utils.data.TensorDataset):
        pass  # a subclass may read per item: workers are tried

    assert len(rows.loader_rows(subject(train=Tensors(x, y)), {})) == 7


def test_loader_extras_are_rows_only_for_free_keys_the_config_has(monkeypatch):
    assert rows.loader_extra_rows(subject(), {}) == []
    assert rows.loader_extra_rows(subject(), {"data.num_workers": 2}) == []  # no such keys
    seen = []
    loader = types.SimpleNamespace(num_workers=2, persistent_workers=False, prefetch_factor=None)

    def with_overrides(current):
        seen.append(current)
        return types.SimpleNamespace(data=loader)

    extra = types.SimpleNamespace(cfg=types.SimpleNamespace(with_overrides=with_overrides))
    assert rows.loader_extra_rows(extra, {"data.num_workers": 2}) == []  # not FREE keys
    assert seen == [{"data.num_workers": 2}]
    free = {"data.persistent_workers", "data.prefetch_factor"}
    monkeypatch.setattr(rows.drift, "is_free", lambda key: key in free)
    assert rows.loader_extra_rows(extra, {}) == [
        Row("data.persistent_workers=true", {"data.persistent_workers": True}),
        Row("data.prefetch_factor=4", {"data.prefetch_factor": 4})]
    loader.persistent_workers, loader.prefetch_factor = True, 3
    assert rows.loader_extra_rows(extra, {}) == [
        Row("data.prefetch_factor=6", {"data.prefetch_factor": 6})]
    free.discard("data.prefetch_factor")
    loader.persistent_workers = False
    assert rows.loader_extra_rows(extra, {}) == [
        Row("data.persistent_workers=true", {"data.persistent_workers": True})]
    loader.num_workers = 0
    assert rows.loader_extra_rows(extra, {}) == []


def test_pinning_is_tried_on_cuda_only():
    cuda = torch.device("cuda")
    assert rows.pin_rows(subject(), torch.device("cpu")) == []
    assert rows.pin_rows(subject(), cuda) == [Row("data.pin_memory=false",
                                                  {"data.pin_memory": False})]
    assert rows.pin_rows(subject({"data": {"pin_memory": False}}), cuda) == [
        Row("data.pin_memory=true", {"data.pin_memory": True})]


def test_precision_rows_by_device(monkeypatch):
    def row(p, note):
        return Row(f"train.precision={p}", {"train.precision": p}, kind="trajectory", note=note)

    bf16, fp16 = row("bf16", "autocast, no scaler"), row("fp16", "fp16 with a GradScaler")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert rows.precision_rows(subject(), cuda) == [bf16, fp16]
    assert rows.precision_rows(subject({"train": {"precision": "bf16"}}), cuda) == [fp16]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert rows.precision_rows(subject(), cuda) == [fp16]
    monkeypatch.setattr(rows, "_cpu_has_bf16", lambda: True)
    assert rows.precision_rows(subject(), cpu) == [bf16]
    assert rows.precision_rows(subject({"train": {"precision": "bf16"}}), cpu) == []
    monkeypatch.setattr(rows, "_cpu_has_bf16", lambda: False)
    assert rows.precision_rows(subject(), cpu) == [Row(
        "train.precision=bf16", {}, kind="trajectory", status="skipped",
        reason="this CPU has no native bf16 (AVX512-BF16 or AMX): emulated bf16 is slower "
               "than fp32")]
    assert rows.precision_rows(subject(), torch.device("mps")) == [bf16]  # not asked of a CPU


def test_a_cpu_has_bf16_when_mkldnn_says_so(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: 1)
    assert rows._cpu_has_bf16() is True
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: 0)
    assert rows._cpu_has_bf16() is False

    def fails(error):
        def check():
            raise error("no mkldnn")
        return check

    for error in (RuntimeError, AttributeError):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", fails(error))
        assert rows._cpu_has_bf16() is False


def test_micro_batch_rows_keep_the_global_batch_and_warn_of_batchnorm():
    assert rows.micro_batch_rows(subject(), model_has_bn=False) == [Row(
        "train.batch_size x k, accumulation / k", {}, kind="trajectory", status="skipped",
        reason="train.accumulation_steps=1: no accumulation to trade for a larger micro-batch")]
    accum = subject({"train": {"batch_size": 8, "accumulation_steps": 4}})
    same = "the same global batch: same trajectory up to float rounding"
    assert rows.micro_batch_rows(accum, model_has_bn=False) == [
        Row("train.batch_size=16 train.accumulation_steps=2",
            {"train.batch_size": 16, "train.accumulation_steps": 2}, kind="trajectory",
            note=same),
        Row("train.batch_size=32 train.accumulation_steps=1",
            {"train.batch_size": 32, "train.accumulation_steps": 1}, kind="trajectory",
            note=same)]
    assert {r.note for r in rows.micro_batch_rows(accum, model_has_bn=True)} == {
        "BatchNorm: NOT the same trajectory (it normalises each micro-batch)"}


def test_a_compile_is_tried_only_on_a_run_long_enough_to_repay_it():
    assert rows.COMPILE_MIN_RUN == 120.0
    assert rows.compile_rows(subject({"train": {"compile": True}}), 1000.0) == []
    assert rows.compile_rows(subject(), 120.0) == [Row("train.compile=true",
                                                       {"train.compile": True})]
    assert rows.compile_rows(subject(), 119.6) == [Row(
        "train.compile=true", {"train.compile": True}, status="skipped",
        reason="the whole run takes ~120 s: too short to repay a compile (tens of seconds)")]
