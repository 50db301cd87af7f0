"""Step-time breakdown: attribution of marks, the epoch split in epochs.jsonl, the table."""

from __future__ import annotations

import json

import pytest
import torch

import ironloop
from ironloop.engine import timing
from ironloop.engine.timing import PARTS, StepTimer, advice

from .conftest import blobs, cfg, tiny_mlp


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", c)
    return c


def test_marks_charge_the_interval_before_them(clock):
    t = StepTimer(torch.device("cpu"))
    t.start_epoch()
    for part, dt in [("data", 1), ("copy", 2), ("forward", 3), ("backward", 4),
                     ("optimizer", 5), ("other", 0.5), ("data", 1)]:
        clock.now += dt
        t.mark(part)
    clock.now += 7
    t.mark("validation")
    row = t.end_epoch()
    assert row == {"data": 2, "copy": 2, "forward": 3, "backward": 4, "optimizer": 5,
                   "checkpoint": 0, "validation": 7, "other": 0.5}
    assert t.steps == 1


def test_time_between_epochs_goes_to_the_run_not_the_next_epoch(clock):
    t = StepTimer(torch.device("cpu"))
    save = t.wrap("checkpoint", lambda: setattr(clock, "now", clock.now + 10))
    t.start_epoch()
    clock.now += 1
    t.mark("data")
    first = t.end_epoch()
    clock.now += 2      # writing the epoch line
    save()              # the end-of-epoch checkpoint: 10 s
    t.start_epoch()
    clock.now += 3
    t.mark("forward")
    second = t.end_epoch()
    assert sum(first.values()) == 1 and sum(second.values()) == 3
    total = t.finish()
    assert total["checkpoint"] == 10 and total["other"] == 2
    assert sum(total.values()) == 16


def test_disabled_timer_records_nothing(clock):
    t = StepTimer(torch.device("cpu"), enabled=False)
    t.start_epoch()
    clock.now += 5
    t.mark("data")
    assert t.end_epoch() == {} and t.finish() == {}


def test_advice_names_the_bottleneck():
    balanced = {"data": 0.01, "copy": 0.01, "forward": 1, "backward": 1, "optimizer": 0.3,
                "checkpoint": 0.05, "validation": 0.2, "other": 0.01}
    assert advice(balanced) == []
    slow_data = {**balanced, "data": 1.0}
    assert any("data.num_workers" in a for a in advice(slow_data))
    slow_opt = {**balanced, "optimizer": 5.0}
    assert any("fused" in a for a in advice(slow_opt))
    stall = {**balanced, "checkpoint": 3.0}
    assert any("checkpoint.async=true" in a for a in advice(stall))


def test_epoch_split_adds_up_to_epoch_seconds(tmp_path, capsys):
    """Every epoch line carries the split; its parts add up to the epoch's seconds (5%)."""
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=3)
    ironloop.fit(tiny_mlp(), blobs(200), blobs(60, seed=1), conf)
    epochs = [json.loads(x) for x in (tmp_path / "run/epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 2
    for row in epochs:
        assert set(row["time_split"]) == set(PARTS)
        assert sum(row["time_split"].values()) == pytest.approx(row["seconds"], rel=0.05)
        assert row["time_split"]["validation"] == pytest.approx(row["val_seconds"], rel=0.05, abs=1e-3)
        assert row["time_split"]["checkpoint"] > 0  # every_steps=3 writes inside the epoch
    results = json.loads((tmp_path / "run/results.json").read_text())
    assert set(results["time_split"]) == set(PARTS)
    out = capsys.readouterr().out
    assert "time split (wall time" in out and "14 optimizer steps" in out
    for part in PARTS:
        assert f"  {part} " in out


def test_breakdown_off_leaves_no_split(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1),
                 cfg(tmp_path, train__epochs=1, profile__breakdown=False))
    row = json.loads((tmp_path / "run/epochs.jsonl").read_text().splitlines()[0])
    assert "time" not in row
    assert "time split" not in capsys.readouterr().out


def test_trace_writes_a_profiler_trace(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(320), None,
                 cfg(tmp_path, train__epochs=1, profile__trace=True, profile__trace_steps=2))
    traces = list((tmp_path / "run" / "trace").glob("*.json*"))
    assert traces, "no trace file written"


class FakeEvent:
    """torch.cuda.Event on a fake GPU clock: record() stamps it, elapsed_time() in ms."""

    gpu_now = 0.0
    created = 0

    def __init__(self, enable_timing: bool = False):
        FakeEvent.created += 1
        self.t = None

    def record(self):
        self.t = FakeEvent.gpu_now

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0


def test_cuda_events_are_read_at_flush_and_reused(monkeypatch):
    """The CUDA path without a GPU: marks record events, flush reads them in order."""
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    FakeEvent.created = 0
    t = StepTimer(torch.device("cuda"))
    assert t.events and not t.sync
    t.start_epoch()
    for step in range(3):
        for part, dt in [("data", 0.5), ("copy", 0.25), ("forward", 1), ("backward", 2),
                         ("optimizer", 1), ("other", 0.25)]:
            FakeEvent.gpu_now += dt
            t.mark(part)
        assert t.epoch["forward"] == step  # this step is read only at the log step: no sync
        t.flush()
    row = t.end_epoch()
    assert row["data"] == 1.5 and row["backward"] == 6 and row["other"] == 0.75
    assert sum(row.values()) == FakeEvent.gpu_now
    assert FakeEvent.created <= 8  # events are pooled, not one per mark forever
