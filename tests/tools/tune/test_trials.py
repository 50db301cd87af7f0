"""tools.tune.trials in process, on a fake clock: a trial's plan, config, windows, warm-up, clock
and figures, its failures and its clean-up. fit() is replaced by a fake that stamps the clock."""

from __future__ import annotations

import itertools
import tempfile
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from ironloop.config import Config
from ironloop.errors import Preempted
from ironloop.tools.tune import stop, trials, tuner as tuner_mod
from ironloop.tools.tune.trials import Measure, Plan, TrialFailed, samples_in_step, window_rates
from tests.tools.tune.helpers import FakeClock, Reads, data, subject


def test_a_trial_is_measured_in_seconds_of_work_not_a_count_of_steps():
    from ironloop.tools.tune.trials import Plan, windows

    plan = tuner_mod.plan_for(step_s=0.1, seconds=2.0)  # the baseline: 20 steps of 0.1 s
    assert plan.measure_s == pytest.approx(plan.window * plan.repeats * 0.1)
    assert plan.cap > 10 * plan.steps  # room for a setting many times faster
    # a setting 4x faster stamps 4x the steps in the same seconds: equal windows over them all
    fast = windows(plan, stamped=plan.warmup + 4 * plan.window * plan.repeats)
    assert fast.window == 4 * plan.window and fast.repeats == plan.repeats
    assert windows(Plan(1, 3, 2), stamped=100).window == 3  # a fixed plan stays fixed


def test_windows_count_the_ragged_last_step_of_an_epoch():
    # 100 samples, 32 a step: steps of 32, 32, 32, 4, then the next epoch
    assert [samples_in_step(s, 100, 32) for s in range(1, 6)] == [32, 32, 32, 4, 32]
    stamps = [1.0, 2.0, 3.0, 4.0, 5.0]  # one step a second; 1 warm-up, windows of 2 steps
    assert window_rates(stamps, 1, 2, 100, 32) == [64 / 2, 36 / 2]
    assert tuner_mod.planned_samples(Config().with_overrides({"train.epochs": 3,
                                                             "train.batch_size": 32}), 100) == 300
    capped = Config().with_overrides({"train.max_steps": 5, "train.batch_size": 32})
    assert tuner_mod.planned_samples(capped, 100) == 100 + 32


def test_a_slow_early_step_and_the_buffer_it_fills_are_warm_up():
    from ironloop.tools.tune.trials import Plan, settled

    plan = Plan(warmup=1, window=2, repeats=4)
    steady = [0.1] * 9
    stamps = list(itertools.accumulate([2.0, *steady]))  # step 1: a 2 s compile
    assert settled(stamps, 0.0, plan, depth=4) == 1 + 4  # and 4 buffered batches after it
    assert settled(list(itertools.accumulate([0.1] * 10)), 0.0, plan, depth=4) == 1
    assert settled(stamps, 0.0, plan, depth=8) == 1  # it would leave under two windows


# -- trials.py: plans, figures, configs -----------------------------------------------------------


def test_a_plans_steps_and_its_cap_when_it_measures_seconds():
    assert Plan(3, 5, 4).steps == 23 and Plan(3, 5, 4).cap == 23
    assert Plan.FASTER == 64
    assert Plan(3, 5, 4, measure_s=2.0).cap == 3 + 64 * 5 * 4


def test_a_subjects_samples_are_its_training_sets_length():
    x, y = data(12)
    assert subject(train=(x, y)).samples == 12
    assert subject(train=[x, y]).samples == 12
    assert subject(train=Reads()).samples == 10
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    assert subject(train=loader).samples == 12  # samples, not batches


def test_a_measures_dict_rounds_its_figures():
    m = Measure(samples_per_s=123.45678, spread=(100.00049, 150.1234), windows=[1.23456, 2.0],
                step_ms=7.123456, extra_s=0.98765, seconds=12.34567, peak_mb=512.5,
                time_split={"data": 1.0})
    assert m.to_dict() == {"samples_per_s": 123.457, "spread": [100.0, 150.123],
                           "windows": [1.235, 2.0], "step_ms": 7.1235, "extra_s": 0.988,
                           "seconds": 12.346, "peak_mb": 512.5, "time_split": {"data": 1.0}}
    assert Measure(1.0, (1.0, 1.0), [1.0], 1.0, 0.0, 1.0).to_dict()["peak_mb"] is None
    assert Measure(1.0, (1.0, 1.0), [1.0], 1.0, 0.0, 1.0).to_dict()["time_split"] is None


def test_a_failed_trial_is_not_an_overrun_unless_told():
    assert TrialFailed("x").overrun is False and str(TrialFailed("x")) == "x"
    assert TrialFailed("y", overrun=True).overrun is True


def test_a_trials_config_is_a_short_quiet_run_in_its_own_directory(tmp_path):
    user = Config().with_overrides({"schedule.name": "plateau", "log.wandb": True,
                                    "log.mlflow": True, "profile.trace": True,
                                    "log.progress": "on", "fault.oom_at_step": 2,
                                    "fault.nan_at_step": [3], "fault.nan_sample": 5,
                                    "profile.breakdown": False})
    trial = trials.trial_config(user, {"train.batch_size": 16, "train.accumulation_steps": 2},
                                10, tmp_path, n=100)
    # 32 samples a step, 4 steps an epoch: 10 steps start 3 epochs, and one more is room
    assert (trial.train.batch_size, trial.train.accumulation_steps) == (16, 2)
    assert (trial.train.max_steps, trial.train.epochs) == (10, 4)
    assert trial.run.dir == str(tmp_path)
    assert trial.checkpoint.enabled is False and trial.log.progress == "off"
    assert (trial.log.tensorboard, trial.log.wandb, trial.log.mlflow) == (False, False, False)
    assert (trial.profile.trace, trial.profile.breakdown) == (False, True)
    assert (trial.early_stop.patience, trial.eval.every_steps) == (0, 0)
    assert (trial.fault.crash_at_step, trial.fault.oom_at_step) == (0, 0)
    assert (trial.fault.nan_at_step, trial.fault.nan_sample) == ([], -1)
    assert trial.schedule.name == "constant"  # plateau steps on evaluations: a trial has none
    cosine = Config().with_overrides({"schedule.name": "cosine"})
    assert trials.trial_config(cosine, {}, 5, tmp_path, n=64).schedule.name == "cosine"


def test_one_line_is_the_type_and_the_first_line_cut_for_a_table_cell():
    assert trials.one_line(RuntimeError("  out of memory\nat line 3\n")) == \
        "RuntimeError: out of memory"
    assert trials.one_line(ValueError()) == "ValueError: "
    assert trials.one_line(ValueError("x" * 300)) == ("ValueError: " + "x" * 300)[:160]
    assert len(trials.one_line(ValueError("x" * 300))) == 160


def test_peak_memory_on_cuda_is_the_peak_allocated_in_mib(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**20 + 2**19 + 2**15)
    assert trials._peak_mb(cuda=True) == 3.5  # 3.53... rounded to a tenth


def test_a_trials_clean_up_resets_compiled_graphs_and_cuda_memory(monkeypatch):
    calls = []
    cuda = types.SimpleNamespace(is_available=lambda: False,
                                 empty_cache=lambda: calls.append("empty"))
    fake_torch = types.SimpleNamespace(cuda=cuda, _dynamo=types.SimpleNamespace(
        reset=lambda: calls.append("reset")))  # importing the real dynamo takes seconds
    monkeypatch.setattr(trials, "torch", fake_torch)
    monkeypatch.setattr(trials.gc, "collect", lambda: calls.append("collect"))
    trials._clean_up(Config())
    assert calls == []
    trials._clean_up(Config().with_overrides({"train.compile": True}))
    assert calls == ["reset"]
    cuda.is_available = lambda: True
    trials._clean_up(Config())
    assert calls == ["reset", "collect", "empty"]


def test_windows_divide_the_stamped_steady_steps_and_a_fixed_plan_stays():
    assert trials.windows(Plan(3, 1, 5, measure_s=1.0), 28).window == 5
    assert trials.windows(Plan(3, 1, 5, measure_s=1.0), 27).window == 4
    assert trials.windows(Plan(3, 9, 5, measure_s=1.0), 4).window == 1  # never 0
    assert trials.windows(Plan(3, 9, 5), 100) == Plan(3, 9, 5)


def test_the_loaders_buffer_is_warm_up(monkeypatch):
    two = Config().with_overrides({"data.num_workers": 2})
    assert trials.buffered(Config()) == 0
    assert trials.buffered(two) == 4  # prefetch_factor's default: 2 each
    deep = types.SimpleNamespace(data=types.SimpleNamespace(num_workers=3, prefetch_factor=5))
    assert trials.buffered(deep) == 15
    deep.data.prefetch_factor = None
    assert trials.buffered(deep) == 6
    assert trials.loader_warmup(Plan(1, 2, 3), two) == Plan(5, 2, 3)
    assert trials.loader_warmup(Plan(7, 2, 3), two).warmup == 7
    assert trials.loader_warmup(Plan(0, 2, 3), Config()).warmup == 1


def test_a_slow_step_is_warm_up_only_when_it_is_more_than_five_typical_steps():
    plan = Plan(warmup=1, window=1, repeats=2)

    def stamps(durations):
        out, t = [], 0.0
        for d in durations:
            t += d
            out.append(t)
        return out

    steady = [0.125] * 4
    assert trials.settled(stamps([0.625, 0.125, 0.125, 0.125]), 0.0, plan, 0) == 1  # 5x: not
    assert trials.settled(stamps([0.75, 0.125, 0.125, 0.125]), 0.0, plan, 0) == 1  # slow[0]
    assert trials.settled(stamps([0.75, 0.125, 0.125, 0.125]), 0.0, plan, 1) == 2
    assert trials.settled(stamps([0.125, 0.75, *steady]), 0.0, plan, 0) == 2
    assert trials.settled(stamps([0.75, 0.75, *steady]), 0.0, plan, 1) == 3  # the last slow
    # the first duration runs from the loop's start
    assert trials.settled(stamps([0.125, 0.125, *steady]), -0.75, plan, 2) == 3
    # at most: two windows left
    two = Plan(warmup=1, window=2, repeats=2)
    assert trials.settled(stamps([0.75, 0.75, *steady]), 0.0, two, 0) == 2  # 6 - 2 = 2 x 2
    assert trials.settled(stamps([0.75, 0.75, *steady]), 0.0, two, 1) == 1
    # too few steps to tell a slow one from the rest
    assert trials.settled(stamps([0.75, 0.125, 0.125]), 0.0, plan, 0) == 1
    assert trials.settled(stamps([5.0, 0.125, 0.125]), 0.0, Plan(0, 1, 1), 0) == 0


def test_window_rates_leave_out_the_warm_up_and_need_full_windows():
    stamps = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert trials.window_rates(stamps, 1, 2, 100, 10) == [20 / 2, 20 / 2]
    assert trials.window_rates(stamps, 2, 2, 100, 10) == [10.0, 10.0]
    assert trials.window_rates(stamps, 3, 2, 100, 10) == [10.0]
    assert trials.window_rates(stamps, 0, 2, 100, 10) == []  # no stamp to start from
    assert trials.window_rates(stamps, 5, 1, 100, 10) == [10.0]
    assert trials.window_rates([1.0, 1.0, 1.0], 1, 1, 100, 10) == [10 / 1e-9, 10 / 1e-9]
    assert trials.samples_in_step(4, 100, 25) == 25 and trials.samples_in_step(5, 100, 25) == 25


# -- trials.py: the clock and run_trial -----------------------------------------------------------


def test_the_clock_ends_a_trial_at_its_deadline_after_the_step_that_passes_it(clock):
    tick = trials._Clock(deadline=1001.0)
    with stop.stop_on_signals():
        clock.now = 1000.5
        tick.on_train_start(None, {})
        assert tick.start == 1000.5
        clock.now = 1001.0
        tick.on_step_end(None, {})  # at the deadline: not past it
        clock.now = 1001.25
        with pytest.raises(trials._Overrun):
            tick.on_step_end(None, {})
    assert tick.stamps == [1001.0, 1001.25]


def test_the_clock_ends_a_trial_once_its_steady_steps_took_measure_s(clock):
    # 2 warm-up steps; then at least 2 x 2 steps, and 1 s since the warm-up's end
    tick = trials._Clock(deadline=2000.0, plan=Plan(warmup=2, window=1, repeats=2, measure_s=1.0))
    clock.now = 0.0
    for _ in range(5):
        clock.now += 0.25
        tick.on_step_end(None, {})
    clock.now += 0.25
    with pytest.raises(trials._Enough):  # 1.5 - 0.5: the 4 steps after the warm-up took 1 s
        tick.on_step_end(None, {})
    fixed = trials._Clock(deadline=2000.0, plan=Plan(warmup=2, window=1, repeats=2))
    slow = trials._Clock(deadline=2000.0, plan=Plan(warmup=2, window=1, repeats=2, measure_s=9))
    for _ in range(20):
        clock.now += 1.0
        fixed.on_step_end(None, {})  # no measure_s: the trial's max_steps ends it
    for _ in range(10):  # 1 s steps: the 11th ends 9 s after the warm-up's
        clock.now += 1.0
        slow.on_step_end(None, {})
    clock.now += 1.0
    with pytest.raises(trials._Enough):
        slow.on_step_end(None, {})
    few = trials._Clock(deadline=2000.0, plan=Plan(warmup=2, window=1, repeats=3, measure_s=0.5))
    for _ in range(7):  # 2 + 2 x 3 = 8 steps at least, however long they took
        clock.now += 1.0
        few.on_step_end(None, {})
    clock.now += 1.0
    with pytest.raises(trials._Enough):
        few.on_step_end(None, {})


def test_a_signal_during_a_trial_stops_it_at_the_next_step_end(clock):
    tick = trials._Clock(deadline=2000.0)
    tick.signals.append("SIGTERM")
    with pytest.raises(stop.Stopped) as raised:
        tick.on_step_end(None, {})
    assert raised.value.signal_name == "SIGTERM" and tick.stamps == []


class FakeFit:
    """fit() for run_trial: it stamps the trial's clock after steps of the given seconds."""

    def __init__(self, clock: FakeClock, steps: list[float], setup: float = 0.5,
                 after: float = 0.5, raises: BaseException | None = None, signal_at_end=""):
        self.clock, self.steps, self.setup, self.after = clock, steps, setup, after
        self.raises, self.signal_at_end = raises, signal_at_end
        self.calls: list[tuple] = []

    def __call__(self, model, train, val, cfg, callbacks, **kwargs):
        self.calls.append((model, train, val, cfg, callbacks, kwargs))
        self.dir_existed = Path(cfg.run.dir).is_dir()
        print("fit's own table")  # run_trial keeps it off the terminal
        if self.raises is not None:
            raise self.raises
        tick = callbacks[0]
        self.clock.now += self.setup
        tick.on_train_start(None, {})
        for seconds in self.steps:
            self.clock.now += seconds
            tick.on_step_end(None, {})
        if self.signal_at_end:
            tick.signals.append(self.signal_at_end)
        self.clock.now += self.after
        return types.SimpleNamespace(results={"time_split": {"forward": 1.0}})


def test_a_trials_figures_come_from_its_windows_after_the_warm_up(clock, monkeypatch, no_cuda,
                                                                    capsys):
    # 64 samples, 8 a step. Steps: a 1 s first step, then 0.25, 0.25, 0.125, 0.125 s
    fake = FakeFit(clock, [1.0, 0.25, 0.25, 0.125, 0.125])
    monkeypatch.setattr(trials, "fit", fake)
    monkeypatch.setattr(trials.resource, "getrusage",
                        lambda who: types.SimpleNamespace(ru_maxrss=2048 * 1024 + 410))
    clock.now = 100.0
    marker = object()
    subj = subject({"train": {"batch_size": 8}}, loss_fn=marker)
    m = trials.run_trial(subj, {"run.threads": 1}, Plan(1, 2, 2), deadline=200.0)
    # windows of steps 2-3 (16 samples in 0.5 s) and 4-5 (16 in 0.25 s)
    assert m.windows == [32.0, 64.0] and m.spread == (32.0, 64.0) and m.samples_per_s == 48.0
    assert m.step_ms == 187.5  # the median of 0.25, 0.25, 0.125, 0.125
    assert m.extra_s == 1.0 - 0.1875  # the warm-up step beyond a steady one
    assert m.seconds == 0.5 + 1.75 + 0.5 and m.peak_mb == 2048.4  # MiB, to a tenth
    assert m.time_split == {"forward": 1.0}
    (model, train, val, cfg, callbacks, kwargs), = fake.calls
    assert isinstance(model, nn.Linear) and train is subj.train and val is None
    assert kwargs == {"loss_fn": marker} and isinstance(callbacks[0], trials._Clock)
    assert cfg.train.max_steps == 5 and cfg.run.threads == 1 and cfg.checkpoint.enabled is False
    assert Path(cfg.run.dir).name.startswith(stop.trial_prefix()) and fake.dir_existed
    assert Path(cfg.run.dir).parent == Path(tempfile.gettempdir())
    assert not Path(cfg.run.dir).exists()  # removed with the trial
    assert capsys.readouterr().out == ""


def test_a_trial_measured_in_seconds_stops_once_it_has_them(clock, monkeypatch, no_cuda):
    fake = FakeFit(clock, [0.5] * 50)
    monkeypatch.setattr(trials, "fit", fake)
    monkeypatch.setattr(trials, "_peak_mb", lambda cuda: 1.0)
    subj = subject({"train": {"batch_size": 8}})
    m = trials.run_trial(subj, {}, Plan(1, 1, 2, measure_s=2.0), deadline=clock.now + 100)
    # 1 warm-up step, then 4 steps of 0.5 s make 2 s: two windows of 2 steps, 16 samples/s
    assert m.windows == [16.0, 16.0] and m.step_ms == 500.0 and m.extra_s == 0.0
    assert m.time_split is None  # fit() did not return: no time table
    assert fake.calls[0][3].train.max_steps == 1 + 64 * 2  # room for a faster setting


def test_a_trial_too_slow_for_its_deadline_fails_as_an_overrun(clock, monkeypatch, no_cuda):
    monkeypatch.setattr(trials, "fit", FakeFit(clock, [1.0] * 5))
    subj = subject({"train": {"batch_size": 8}})
    with pytest.raises(TrialFailed) as raised:
        trials.run_trial(subj, {}, Plan(1, 2, 2), deadline=clock.now + 2.75)
    assert raised.value.overrun is True
    assert str(raised.value) == ("stopped at its time limit after 3 of 5 steps: far slower than "
                                 "the baseline, or the budget ran out")
    # one window is enough for a plan of one
    monkeypatch.setattr(trials, "fit", FakeFit(clock, [1.0] * 3))
    m = trials.run_trial(subj, {}, Plan(1, 2, 1), deadline=clock.now + 100)
    assert m.windows == [8.0]


def test_a_trial_that_raises_fails_with_its_one_line_and_a_signal_stops_the_tune(
        clock, monkeypatch, no_cuda):
    subj = subject({"train": {"batch_size": 8}})

    def run(fake):
        monkeypatch.setattr(trials, "fit", fake)
        return trials.run_trial(subj, {}, Plan(1, 2, 2), deadline=clock.now + 100)

    with pytest.raises(TrialFailed) as failed:
        run(FakeFit(clock, [], raises=RuntimeError("CUDA out of memory.\nTried to allocate")))
    assert str(failed.value) == "RuntimeError: CUDA out of memory." and not failed.value.overrun
    with pytest.raises(stop.Stopped) as stopped:
        run(FakeFit(clock, [], raises=Preempted("SIGTERM", 3, saved=False)))
    assert stopped.value.signal_name == "SIGTERM" and stopped.value.__cause__ is None
    signal_stop = stop.Stopped("SIGINT")
    with pytest.raises(stop.Stopped) as stopped:
        run(FakeFit(clock, [], raises=signal_stop))
    assert stopped.value is signal_stop
    with stop.stop_on_signals(), pytest.raises(stop.Stopped) as stopped:
        run(FakeFit(clock, [1.0] * 5, signal_at_end="SIGINT"))  # after the last step
    assert stopped.value.signal_name == "SIGINT"


def test_a_trial_with_workers_leaves_their_buffer_out_of_its_windows(clock, monkeypatch, no_cuda):
    fake = FakeFit(clock, [1.0] + [0.25] * 10)
    monkeypatch.setattr(trials, "fit", fake)
    monkeypatch.setattr(trials, "_peak_mb", lambda cuda: 1.0)
    subj = subject({"train": {"batch_size": 8}})
    m = trials.run_trial(subj, {"data.num_workers": 2}, Plan(1, 3, 2), deadline=clock.now + 100)
    # warm-up 1 + 2 x 2 buffered batches = 5: 11 steps leave two windows of 3
    assert fake.calls[0][3].train.max_steps == 5 + 3 * 2
    assert m.windows == [24 / 0.75, 24 / 0.75]
    assert m.extra_s == (1.0 + 4 * 0.25) - 5 * 0.25


def test_a_trial_on_cuda_resets_and_reads_the_peak_allocated(clock, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 256 * 2**20)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(trials.gc, "collect", lambda: None)
    monkeypatch.setattr(trials, "fit", FakeFit(clock, [1.0] * 5))
    m = trials.run_trial(subject({"train": {"batch_size": 8}}), {}, Plan(1, 2, 2),
                         deadline=clock.now + 100)
    assert calls == ["reset"] and m.peak_mb == 256.0
