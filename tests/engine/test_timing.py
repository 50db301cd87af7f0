"""Step-time breakdown: attribution of marks, the epoch split in epochs.jsonl, the table."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys

import pytest
import torch
from torch import nn

import ironloop
from ironloop.config import Config
from ironloop.data.loader import TensorData
from ironloop.engine import timing
from ironloop.engine.timing import StepTimer
from ironloop.outputs import time_split
from ironloop.outputs.time_split import EPOCH_PARTS, PARTS, RunSettings, advice
from tests.conftest import blobs, cfg, tiny_mlp


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
                   "average": 0, "checkpoint": 0, "validation": 7, "other": 0.5}
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


#: A plain CPU run: no workers, one thread each on 2 cores, torch's per-tensor optimizer loop.
PLAIN = RunSettings(device="cpu", num_workers=0, cores=2, threads=1, optimizer="loop",
                    fused_open=True)


def test_advice_names_the_bottleneck():
    balanced = {"data": 0.01, "copy": 0.01, "forward": 1, "backward": 1, "optimizer": 0.3,
                "checkpoint": 0.05, "validation": 0.2, "other": 0.01}
    assert advice(balanced, PLAIN) == []
    slow_data = {**balanced, "data": 1.0}
    assert any("raise data.num_workers (now 0; 2 cores)" in a for a in advice(slow_data, PLAIN))
    # torch's default 2 threads on 2 cores: the workers it advises need one of them
    (line,) = advice(slow_data, RunSettings(cores=2, threads=2))
    assert "raise data.num_workers" in line and "set run.threads=1 (now 2)" in line
    slow_opt = {**balanced, "optimizer": 5.0}
    assert any("set optim.fused=true" in a for a in advice(slow_opt, PLAIN))
    stall = {**balanced, "checkpoint": 3.0}
    assert any("set checkpoint.async=true" in a for a in advice(stall, PLAIN))
    # host-to-device copies over a tenth of step time: on CUDA, the copy's own advice
    copies = {**balanced, "copy": 0.4}
    (line,) = advice(copies, RunSettings(device="cuda", cores=2, optimizer="fused"))
    assert line.startswith("host-to-device copies are 15% of step time: set data.pin_memory")
    (line,) = advice(copies, RunSettings(device="cuda", cores=2, optimizer="fused",
                                         pin_memory=True))
    assert "keep the dataset on the device" in line
    assert advice(copies, RunSettings(device="cpu", cores=2, optimizer="fused")) == []


def test_copy_advice_starts_above_a_tenth_of_step_time_and_gives_its_share_in_percent():
    cuda = RunSettings(device="cuda", cores=2, optimizer="fused")
    assert advice({"copy": 1.0, "forward": 9.0}, cuda) == []  # exactly a tenth: no advice
    assert advice({"copy": 6.0, "forward": 4.0}, cuda) == \
        ["host-to-device copies are 60% of step time: set data.pin_memory=true"]


def test_data_advice_gives_the_waits_share_and_every_open_step_in_full(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python"])  # not an ironloop train command line
    cuda = RunSettings(device="cuda", num_workers=4, cores=4, optimizer="fused")
    assert advice({"data": 1.0, "forward": 1.0}, cuda) == [
        "data wait is 50% of step time: set data.pin_memory=true; "
        "`ironloop.tune(model, train_data, config)` measures the options on this run and "
        "writes a faster config"]


def test_bf16_is_advised_once_forward_and_backward_pass_six_tenths_of_step_time(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python"])  # not an ironloop train command line
    run = RunSettings(device="cuda", optimizer="fused", bf16_open=True)
    assert advice({"forward": 3.0, "backward": 3.0, "other": 4.0}, run) == []  # exactly 60%
    assert advice({"forward": 3.0, "backward": 4.0, "other": 3.0}, run) == [
        "forward + backward are 70% of step time in fp32: train.precision=bf16 runs them "
        "faster on this device (it changes the trajectory; `ironloop.tune(model, train_data, "
        "config) --apply-trajectory-changes` measures it)"]


def test_the_loop_kernel_is_told_to_switch_to_foreach_in_full():
    slow_opt = {"forward": 1.0, "backward": 1.0, "optimizer": 8.0}
    assert advice(slow_opt, RunSettings(optimizer="loop")) == [
        "the optimizer step is 80% of step time, more than forward + backward: "
        "set optim.foreach=true (one kernel per step for all tensors)"]


def test_async_checkpoints_that_still_stall_are_told_to_save_less_often():
    stall = {"forward": 1.0, "checkpoint": 1.0}
    run = RunSettings(optimizer="fused", checkpoint_async=True, checkpoint_every_steps=50)
    assert advice(stall, run) == [
        "checkpoint writes stall the run 50% of the time: checkpoint.async is already on: "
        "raise checkpoint.every_steps (now 50) or set it to 0 (epoch ends only)"]


@pytest.mark.parametrize("every, fewer", [
    (0, ""), (50, ", or raise checkpoint.every_steps (now 50) or set it to 0 (epoch ends only)")])
def test_blocking_checkpoints_that_stall_are_told_to_go_async(every, fewer):
    run = RunSettings(optimizer="fused", checkpoint_async=False, checkpoint_every_steps=every)
    assert advice({"forward": 1.0, "checkpoint": 1.0}, run) == [
        "checkpoint writes stall the run 50% of the time: set checkpoint.async=true" + fewer]


def test_optimizer_advice_knows_which_optimizer_and_which_knobs_apply():
    """Issue 44: an LBFGS run was told to set optim.foreach=true (LBFGS has no such argument,
    its optimizer was the user's, and its time is the closure's evaluations)."""
    slow_opt = {"data": 0.01, "forward": 1, "backward": 1, "optimizer": 5.0}
    lbfgs = RunSettings(optimizer="loop", foreach_open=False, closure=True,
                        optimizer_class="LBFGS")
    (line,) = advice(slow_opt, lbfgs)
    assert "closure's extra forward + backward" in line and "optim." not in line
    assert advice(slow_opt, RunSettings(optimizer="loop", foreach_open=False)) == []
    (line,) = advice(slow_opt, RunSettings(optimizer="loop", optimizer_class="SGD"))
    assert "pass foreach=True to SGD" in line and "optim." not in line
    (line,) = advice(slow_opt, RunSettings(optimizer="loop"))
    assert "set optim.foreach=true" in line


def test_a_synchronized_cuda_table_gives_the_gpu_compute_share_of_step_time():
    split = {"data": 1.0, "copy": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 2.0,
             "checkpoint": 0.0, "validation": 0.0, "other": 0.0}
    text = time_split.table(split, 10, torch.device("cuda"), True, PLAIN)
    assert "synchronized around forward/backward" in text
    assert "  GPU compute (forward + backward): 66.7% of step time" in text.splitlines()
    assert "GPU compute" not in time_split.table(split, 10, torch.device("cuda"), False, PLAIN)


def test_the_tables_first_line_says_how_the_time_was_measured_and_over_what():
    split = {"data": 1.0, "forward": 3.0, "backward": 4.0}
    heads = {(dev, sync): time_split.table(split, 10, torch.device(dev), sync, PLAIN).split("\n")[0]
             for dev, sync in (("cpu", True), ("cuda", True), ("cuda", False))}
    assert heads == {
        ("cpu", True): "time split (wall time; 8.00 s, 10 optimizer steps):",
        ("cuda", True): "time split (wall time, synchronized around forward/backward; 8.00 s, "
                        "10 optimizer steps):",
        ("cuda", False): "time split (CUDA events; 8.00 s, 10 optimizer steps):"}


def test_the_gpu_compute_share_counts_a_part_missing_from_the_split_as_no_time():
    for split in ({"data": 1.0, "forward": 3.0, "other": 4.0},  # no backward timed
                  {"data": 1.0, "backward": 3.0, "other": 4.0}):  # no forward timed
        text = time_split.table(split, 10, torch.device("cuda"), True, PLAIN)
        assert "  GPU compute (forward + backward): 37.5% of step time" in text.splitlines()


def test_a_part_missing_from_the_split_counts_as_no_time():
    partial = {"forward": 1.0, "backward": 1.0, "optimizer": 0.5}  # no data, copy, other...
    zeros = {p: 0.0 for p in PARTS}
    assert advice(partial, PLAIN) == advice({**zeros, **partial}, PLAIN) == []


def test_the_table_gives_seconds_share_and_milliseconds_per_optimizer_step():
    split = {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0, "checkpoint": 2.0}
    lines = time_split.table(split, 10, torch.device("cpu"), False, PLAIN).splitlines()
    assert lines[1].split() == ["part", "seconds", "share", "ms/step"]
    assert lines[4].split() == ["forward", "3.000", "25.0%", "300.00"]  # 3 s over 10 steps
    (checkpoint,) = [line for line in lines if line.split()[0] == "checkpoint"]
    assert checkpoint.split() == ["checkpoint", "2.000", "16.7%"]  # not part of a step


def test_profile_sync_is_handed_to_the_step_timer(tmp_path, monkeypatch):
    # The timer synchronizes only on CUDA; on any device it must be told what was asked for.
    from ironloop.engine import build

    asked = []

    class Spy(StepTimer):
        def __init__(self, device, enabled=True, sync=False, *args, **kwargs):
            asked.append(sync)
            super().__init__(device, enabled, sync, *args, **kwargs)

    monkeypatch.setattr(build, "StepTimer", Spy)
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__epochs=1, profile__sync=True, checkpoint__enabled=False))
    assert asked == [True]


#: Every part a bottleneck: each advice line is called for.
EVERYTHING_SLOW = {"data": 3.0, "copy": 3.0, "forward": 2.0, "backward": 8.0, "optimizer": 12.0,
                   "checkpoint": 30.0, "validation": 0.0, "other": 0.0}
#: "key=value" as a line recommends it; the value of the run's own setting for that key.
RECOMMENDED = re.compile(r"(data\.num_workers|data\.pin_memory|optim\.fused|optim\.foreach|"
                         r"checkpoint\.async|train\.precision|run\.threads)=(\w+)")


def _has(run: RunSettings, key: str) -> str:
    return {"data.num_workers": str(run.num_workers),
            "data.pin_memory": str(run.pin_memory).lower(),
            "optim.fused": str(run.optimizer == "fused").lower(),
            "optim.foreach": str(run.optimizer == "foreach").lower(),
            "checkpoint.async": str(run.checkpoint_async).lower(),
            "train.precision": run.precision, "run.threads": str(run.threads)}[key]


#: Every combination of what a run may already use (864 of them).
RUNS = [RunSettings(device=d, num_workers=w, cores=c, threads=t, pin_memory=pin, optimizer=k,
                    fused_open=fo, checkpoint_async=ca, checkpoint_every_steps=ce, precision=p,
                    bf16_open=b)
        for d, (w, c), t, pin, (k, fo), (ca, ce), (p, b) in itertools.product(
            ("cpu", "cuda"), ((0, 2), (2, 2), (3, 16)), (1, 2), (False, True),
            (("fused", True), ("foreach", True), ("foreach", False), ("loop", False)),
            ((False, 0), (True, 0), (True, 50)), (("fp32", True), ("bf16", True),
                                                  ("fp32", False)))]


def test_advice_never_recommends_a_setting_the_run_already_has():
    for run in RUNS:
        lines = advice(EVERYTHING_SLOW, run)
        for line in lines:
            for key, value in RECOMMENDED.findall(line):
                assert value != _has(run, key), (key, run, line)
        text = " ".join(lines)
        if run.num_workers >= run.cores:
            assert "raise data.num_workers" not in text, (run, text)
        if run.optimizer == "fused" or (run.optimizer == "foreach" and not run.fused_open):
            assert "optimizer step is" not in text, (run, text)  # nothing left: no line
        if run.checkpoint_async and not run.checkpoint_every_steps:
            assert "checkpoint writes" not in text, (run, text)
        if run.device != "cuda":
            assert "pin_memory" not in text and "bf16" not in text, (run, text)
    # and each bottleneck does get a line where a step is open
    assert len(advice(EVERYTHING_SLOW, RUNS[-1])) >= 3


def test_the_default_adamw_is_seen_as_fused_and_gets_no_fused_advice():
    """The issue's case: a tiny MLP whose optimizer step is 40% of step time, with ironloop's
    default AdamW, which it builds fused=True where torch has the kernel (CPU included)."""
    from ironloop.engine import optim

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = optim.build_optimizer(model, Config().optim)
    run = RunSettings(device="cpu", cores=2, threads=1, optimizer=optim.kernel(opt),
                      fused_open=optim.fused_open(opt))
    split = {"data": 0.01, "copy": 0.0, "forward": 0.15, "backward": 0.2, "optimizer": 0.4,
             "checkpoint": 0.0, "validation": 0.0, "other": 0.24}
    assert run.optimizer == "fused"
    assert not any("optim" in a for a in advice(split, run)), advice(split, run)
    loop = optim.build_optimizer(model, Config().optim.__class__(foreach=False, fused=False))
    assert optim.kernel(loop) == "loop" and optim.fused_open(loop)
    (line,) = advice(split, RunSettings(cores=2, optimizer="loop", fused_open=True))
    assert "set optim.fused=true (now the loop kernel)" in line


class TimedData(TensorData):
    """Each training batch costs the fake clock 1 s to fetch."""

    def __getitems__(self, indices):
        TimedData.clock.now += 1.0
        return super().__getitems__(indices)


def test_epoch_split_adds_up_to_epoch_seconds(tmp_path, capsys, clock, monkeypatch):
    """Every epoch line carries the split, and its parts add up to the epoch's seconds.

    On a fake clock that moves only where the test says, the loop's own measurements (the
    epoch's train_seconds and val_seconds) and the timer's parts are exact: 1 s per batch
    fetched (data), 1 s per forward (forward in training, validation in evaluation), 0.5 s per
    fsync (checkpoint). No wall-clock time is compared."""
    real_fsync = os.fsync

    def slow_fsync(fd):  # a slow disk, below the code under test
        clock.now += 0.5
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    TimedData.clock = clock

    def step(m, batch):
        clock.now += 1.0
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}

    data = blobs(200)
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=3)
    ironloop.fit(tiny_mlp(), TimedData(data.x, data.y), blobs(60, seed=1), conf, step_fn=step)
    epochs = [json.loads(x) for x in (tmp_path / "run/epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 2
    # 7 batches of 32; checkpoints at steps 3 and 6 (then 9 and 12), each a file fsync and a
    # directory fsync; 2 validation batches. The epoch-end checkpoint comes after the line.
    expected = dict.fromkeys(EPOCH_PARTS, 0.0) | {"data": 7, "forward": 7, "checkpoint": 2,
                                                  "validation": 2}
    for row in epochs:
        assert row["time_split"] == expected
        assert row["seconds"] == sum(row["time_split"].values()) == 18
        assert row["val_seconds"] == row["time_split"]["validation"]
    results = json.loads((tmp_path / "run/results.json").read_text())
    # The run's totals add what lies between epochs: two epoch-end checkpoints, each 1 s plus
    # 0.5 s for the directory fsync after linking best.pt (the val loss improved both times).
    assert epochs[1]["val_loss"] < epochs[0]["val_loss"]
    assert results["time_split"] == {k: 2 * v for k, v in expected.items()} | {
        "checkpoint": 7, "startup": 0.0, "closing": 0.0}
    out = capsys.readouterr().out
    assert "time split (wall time" in out and "14 optimizer steps" in out
    for part in PARTS:  # averaging is off, and no one-off cost here: no row for them
        assert (f"  {part} " in out) == (part not in ("average", "startup", "closing"))


def test_one_off_start_up_and_closing_costs_stay_out_of_the_per_step_split(tmp_path, capsys,
                                                                             clock):
    """On the fake clock, 100 s pass before the first step (a logger such as MLflow starting,
    a remote's first upload) and 50 s after the last: neither is a step's "other"."""
    from ironloop.callbacks import Callback

    class OneOff(Callback):
        def on_train_start(self, run, metrics):
            clock.now += 100.0

        def on_train_end(self, run, metrics):
            clock.now += 50.0

    ironloop.fit(tiny_mlp(), blobs(200), blobs(60, seed=1), cfg(tmp_path, train__epochs=1),
                 callbacks=[OneOff()])
    results = json.loads((tmp_path / "run/results.json").read_text())
    split = results["time_split"]
    assert (split["startup"], split["closing"], split["other"]) == (100.0, 50.0, 0.0)
    (epoch,) = [json.loads(x) for x in (tmp_path / "run/epochs.jsonl").read_text().splitlines()]
    assert "startup" not in epoch["time_split"] and "closing" not in epoch["time_split"]
    out = capsys.readouterr().out
    table = out[out.index("time split"):].splitlines()
    assert [r.split() for r in table if r.split()[0] in ("startup", "closing", "other")] == [
        ["startup", "100.000", "66.7%"], ["other", "0.000", "0.0%", "0.00"],
        ["closing", "50.000", "33.3%"]]  # no ms/step for a one-off cost


def test_the_time_tables_step_count_agrees_with_results_and_names_skipped_steps(tmp_path,
                                                                              capsys):
    result = ironloop.fit(tiny_mlp(), blobs(256), blobs(64, seed=1),
                          cfg(tmp_path, fault__nan_at_step=3, train__epochs=3))
    assert result.results["steps"] == 23  # 3 epochs of 8 steps, one skipped
    out = capsys.readouterr().out
    assert "23 optimizer steps + 1 skipped by the guard = 24 timed):" in out, out


def test_the_time_tables_count_names_steps_redone_after_a_rollback():
    assert time_split.steps_timed(24, 24, 0) == ""  # every timed step counts: the plain words
    assert time_split.steps_timed(30, 20, 3) == \
        "20 optimizer steps + 3 skipped by the guard + 7 redone after a rollback = 30 timed"


@pytest.mark.parametrize("breakdown", [True, False])
def test_breakdown_off_leaves_no_time_split_and_on_writes_it(tmp_path, capsys, breakdown):
    ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1),
                 cfg(tmp_path, train__epochs=1, profile__breakdown=breakdown))
    row = json.loads((tmp_path / "run/epochs.jsonl").read_text().splitlines()[0])
    results = json.loads((tmp_path / "run/results.json").read_text())
    assert ("time_split" in row) is breakdown
    assert bool(results["time_split"]) is breakdown
    assert ("time split" in capsys.readouterr().out) is breakdown


def test_trace_writes_a_profiler_trace(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(320), None,
                 cfg(tmp_path, train__epochs=1, profile__trace=True, profile__trace_steps=2))
    traces = list((tmp_path / "run" / "trace").glob("*.json*"))
    assert traces, "no trace file written"


def test_a_run_shorter_than_its_trace_stops_the_profiler_when_it_ends(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(64), None,  # 2 steps: the trace wants 1 + 1 + 3
                 cfg(tmp_path, train__epochs=1, profile__trace=True, profile__trace_steps=3))
    # Left running, the profiler would record the caller's process after fit() returned.
    assert not torch._C._autograd._profiler_enabled()


def test_a_trace_records_3_steps_by_default_after_a_wait_and_a_warm_up_then_stops(tmp_path):
    timer = StepTimer(torch.device("cpu"), trace_dir=tmp_path)
    trace = timer.trace
    assert trace is not None and trace.remaining == 2 + 3
    from torch.profiler import ProfilerAction as Act

    assert [trace.prof.schedule(i) for i in range(8)] == [  # one cycle: no repeat
        Act.NONE, Act.WARMUP, Act.RECORD, Act.RECORD, Act.RECORD_AND_SAVE, *[Act.NONE] * 3]
    for _ in range(4):
        trace.step()
    assert trace.prof is not None and trace.remaining == 1
    trace.step()  # the fifth: done, the profiler stopped
    assert trace.prof is None and not torch._C._autograd._profiler_enabled()
    assert StepTimer(torch.device("cpu"), enabled=False, trace_dir=tmp_path).trace is None


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


def test_profile_sync_on_a_cpu_is_plain_wall_time(clock):
    t = StepTimer(torch.device("cpu"), sync=True)  # nothing to synchronize with
    assert (t.sync, t.events) == (False, False)
    t.start_epoch()
    clock.now += 2
    t.mark("forward")
    assert t.end_epoch()["forward"] == 2


def test_the_tune_command_repeats_a_train_commands_config_and_overrides():
    argv = ["ironloop", "train", "--resume", "run.yaml", "train.lr=0.1", "-x=1", "--cfg.yaml"]
    assert time_split.tune_command(argv) == "ironloop tune run.yaml train.lr=0.1"
    assert time_split.tune_command(["ironloop", "doctor", "a b.yml"]) == "ironloop tune 'a b.yml'"
    # no config file on the command line, or another command: the Python call
    python = "ironloop.tune(model, train_data, config)"
    assert time_split.tune_command(["ironloop", "train", "--x.yaml", "lr=1"]) == python
    assert time_split.tune_command(["ironloop", "export", "run.yaml"]) == python
    assert time_split.tune_command(["ironloop", "train"]) == python


def test_a_trace_records_the_gpus_kernels_where_there_is_one(monkeypatch, tmp_path):
    """profile.trace_steps: the CPU's ops always, the GPU's kernels too where CUDA is there
    (here torch.profiler's profile is a recorder: this machine has no GPU to trace)."""
    import torch.profiler as tp

    made, shapes = [], []

    class Recorder:
        def __init__(self, **kwargs):
            made.append(kwargs["activities"])
            shapes.append(kwargs["record_shapes"])

        def __enter__(self):
            return self

    monkeypatch.setattr(tp, "profile", Recorder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    timing.Trace(tmp_path, steps=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    timing.Trace(tmp_path, steps=2)
    cpu, cuda = tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA
    assert made == [[cpu, cuda], [cpu]]
    assert shapes == [True, True]  # each op's input shapes, for the trace's reader


def test_optimizer_advice_needs_over_three_tenths_of_step_time_and_more_than_forward_and_backward():
    loop = RunSettings(optimizer="loop")
    # exactly 30%, more than forward + backward (20%): not yet a bottleneck
    assert advice({"forward": 1.0, "backward": 1.0, "optimizer": 3.0, "other": 5.0}, loop) == []
    # 44%, but forward + backward together take 56%: the step is not the optimizer's
    assert advice({"forward": 4.0, "backward": 1.0, "optimizer": 4.0}, loop) == []
    assert advice({"forward": 1.0, "backward": 1.0, "optimizer": 3.1, "other": 4.9}, loop) == [
        "the optimizer step is 31% of step time, more than forward + backward: "
        "set optim.foreach=true (one kernel per step for all tensors)"]


def test_data_advice_joins_every_open_step_and_names_the_last_resort_when_none_is_left(
        monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python"])  # not an ironloop train command line
    tune = ("`ironloop.tune(model, train_data, config)` measures the options on this run and "
            "writes a faster config")
    waits = {"data": 1.0, "forward": 1.0}
    assert advice({"data": 1.0, "forward": 9.0}, RunSettings(optimizer="fused")) == []  # 10%
    assert advice(waits, RunSettings(cores=2, threads=2, optimizer="fused")) == [
        "data wait is 50% of step time: raise data.num_workers (now 0; 2 cores); set "
        f"run.threads=1 (now 2) so torch leaves the workers their cores; {tune}"]
    assert advice(waits, RunSettings(num_workers=2, cores=2, optimizer="fused")) == [
        "data wait is 50% of step time: the 2 workers already have every core: make "
        f"__getitem__ cheaper (decode once and cache, lighter augmentation); {tune}"]
