"""Meter: the per-step clip flags are summed when read, and survive a state_dict round trip."""

from __future__ import annotations

import time

import pytest
import torch

from ironloop.engine.progress import Meter


def _step(meter: Meter, clipped: bool) -> None:
    meter.add_micro(torch.tensor(1.0), 4)
    meter.add_step(torch.tensor(2.0), torch.tensor(clipped), None)


def test_clip_flags_count_per_window_epoch_and_across_a_checkpoint():
    meter = Meter(torch.device("cpu"))
    for flag in (True, False, True):
        _step(meter, flag)
    assert meter.flush_window()["clipped"] == 2
    _step(meter, True)
    state = meter.state_dict()  # a checkpoint mid-window takes the pending flag along
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(state)
    for m in (meter, resumed):
        _step(m, True)
        assert m.flush_window()["clipped"] == 2
        assert m.flush_epoch()["clipped_frac"] == 4 / 5


def test_loss_sums_are_float64_on_cpu_so_a_long_runs_window_loss_keeps_its_digits():
    # A window's loss is (totals now - totals at its start): after 2**25 samples a float32 sum
    # rounds to multiples of 4 and a small window's loss would read 0.
    meter = Meter(torch.device("cpu"))
    meter.add_micro(torch.tensor(1.0), 2**25)
    meter.add_step(torch.tensor(0.0), torch.tensor(False), None)
    meter.flush_window()
    meter.add_micro(torch.tensor(0.125), 1)
    meter.add_step(torch.tensor(0.0), torch.tensor(False), None)
    assert meter.flush_window()["loss"] == 0.125


def test_state_dict_marks_are_cpu_copies_under_the_keys_load_reads():
    # The checkpoint holds copies (a writer may run while training goes on), and only the keys
    # a mark has: load_state_dict puts each mark back as it was saved.
    meter = Meter(torch.device("cpu"))
    _step(meter, True)
    state = meter.state_dict()
    for name in ("window_mark", "epoch_mark"):
        mark = state[name]
        assert set(mark) == {"totals", "samples", "steps", "train_seconds"}
        assert mark["totals"].device.type == "cpu"
        assert mark["totals"] is not getattr(meter, name)["totals"]


def test_a_checkpoint_from_before_token_sums_loads_with_zero_tokens():
    # Older checkpoints hold three totals (loss_sum, clipped, skipped): tokens start at 0.
    meter = Meter(torch.device("cpu"))
    _step(meter, True)
    state = meter.state_dict()
    state["totals"] = state["totals"][:3]
    for name in ("window_mark", "epoch_mark"):
        state[name]["totals"] = state[name]["totals"][:3]
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(state)
    assert resumed.tokens.item() == 0
    _step(resumed, False)
    row = resumed.flush_window()
    assert row["loss"] == 1.0 and row["clipped"] == 1 and "tokens_per_s" not in row


def test_float32_totals_from_an_mps_checkpoint_resume_as_float64_sums_on_cpu():
    # MPS has no float64, so its checkpoint holds float32 totals; on CPU (or CUDA) the resumed
    # sums are float64 again, or a long run's window loss loses its digits after the resume.
    meter = Meter(torch.device("cpu"))
    _step(meter, True)
    state = meter.state_dict()
    state["totals"] = state["totals"].float()
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(state)
    assert {t.dtype for t in (resumed.loss_sum, resumed.clipped, resumed.skipped,
                              resumed.tokens)} == {torch.float64}


class Clock:
    """time.perf_counter, moved by hand."""

    now = 100.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


@pytest.fixture
def clock(monkeypatch):
    Clock.now = 100.0
    monkeypatch.setattr(time, "perf_counter", Clock.perf_counter)
    return Clock


def test_a_log_window_reports_its_mean_loss_counts_and_throughput(clock):
    meter = Meter(torch.device("cpu"))
    clock.now += 50.0  # set-up before the loop starts: not training time
    meter.start_clock()
    meter.add_micro(torch.tensor(2.0), 4)
    meter.add_micro(torch.tensor(1.0), 4)
    meter.add_step(torch.tensor(3.0), torch.tensor(True), torch.tensor(1.0))
    meter.add_micro(torch.tensor(0.5), 8)
    meter.add_step(torch.tensor(0.25), torch.tensor(False), None)
    clock.now += 4.0
    assert meter.flush_window() == {"loss": 1.0, "grad_norm": 0.25, "clipped": 1, "steps": 2,
                                    "skipped": 1, "samples_per_s": 4.0}
    meter.add_micro(torch.tensor(3.0), 2)
    meter.add_step(torch.tensor(1.0), torch.tensor(True), None)
    clock.now += 2.0
    meter.exclude(1.0)  # a validation inside the window
    assert meter.flush_window() == {"loss": 3.0, "grad_norm": 1.0, "clipped": 1, "steps": 1,
                                    "skipped": 0, "samples_per_s": 2.0}
    assert meter.train_seconds() == 5.0
    epoch = meter.flush_epoch()
    assert epoch == {"train_loss": 22.0 / 18, "clipped_frac": 2 / 3, "skipped": 1,
                     "train_seconds": 5.0, "samples_per_s": 18 / 5.0}


def test_a_step_that_weights_its_loss_reports_the_mean_per_token(clock):
    meter = Meter(torch.device("cpu"))
    meter.start_clock()
    meter.add_micro(torch.tensor(2.0), 2, weight=torch.tensor(30.0))
    meter.add_micro(torch.tensor(1.0), 2, weight=torch.tensor(10.0))
    meter.add_step(torch.tensor(1.0), torch.tensor(False), None)
    clock.now += 2.0
    row = meter.flush_window()
    assert row["loss"] == 70.0 / 40 and row["tokens_per_s"] == 20.0 and row["samples_per_s"] == 2.0
    assert float(meter.tokens) == 40.0


def test_a_bad_steps_flags_are_masked_and_its_counts_taken_back(clock):
    meter = Meter(torch.device("cpu"))
    meter.add_micro(torch.tensor(1.0), 4)
    meter.add_step(torch.tensor(1.0), torch.tensor(True), torch.tensor(1.0), ok=torch.tensor(True))
    meter.add_micro(torch.tensor(1.0), 4)
    meter.add_step(torch.tensor(1.0), torch.tensor(True), torch.tensor(1.0),
                   ok=torch.tensor(False))
    meter.forget(4, 1)  # the guard settled the second step: bad
    assert (meter.samples, meter.steps) == (4, 1)
    row = meter.flush_window()
    assert (row["clipped"], row["skipped"], row["steps"]) == (1, 1, 1)


def test_a_gradient_norm_with_a_graph_is_kept_without_it():
    meter = Meter(torch.device("cpu"))
    norm = torch.tensor(2.0, requires_grad=True) * 1.0
    meter.add_step(norm, torch.tensor(False), None)
    assert not meter.grad_norm.requires_grad and float(meter.grad_norm) == 2.0


def test_a_checkpoint_from_before_training_time_was_kept_times_from_the_resume(clock):
    # Older checkpoints carry no training time, in the state or its marks: the resumed
    # window and epoch count the time since the resume only.
    meter = Meter(torch.device("cpu"))
    meter.add_micro(torch.tensor(1.0), 4)
    meter.add_step(torch.tensor(1.0), torch.tensor(False), None)
    state = meter.state_dict()
    del state["train_seconds"]
    for name in ("window_mark", "epoch_mark"):
        del state[name]["train_seconds"]
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(state)
    clock.now += 2.0
    assert resumed.train_seconds() == 2.0
    assert resumed.flush_window()["samples_per_s"] == 2.0  # 4 samples in 2 s
    epoch = resumed.flush_epoch()
    assert (epoch["train_seconds"], epoch["samples_per_s"]) == (2.0, 2.0)
