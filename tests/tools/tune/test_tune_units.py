"""ironloop tune's parts, in process, on fabricated measurements and a fake clock: which trial
wins, the ratios, the rows, the verdicts, the stop rules at their boundaries, and the exact
text of the table, tune.json and tuned.yaml. No trial trains here (tests/tools/tune/test_tune.py has
the real ones): fit() and run_trial are replaced by fakes that stamp a clock the test controls."""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import types
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from ironloop.config import Config
from ironloop.data import TensorData
from ironloop.errors import ConfigError, Preempted, UserError
from ironloop.tools import tune as tune_mod
from ironloop.tools.tune import output, rows, stop, trials
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Measure, Plan, Subject, TrialFailed


class FakeClock:
    """time.perf_counter for a module under test: it moves only when the test moves it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    for module in (tune_mod, trials, output):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=fake))
    return fake


@pytest.fixture(autouse=True)
def _signal_handlers():
    """A trial's clock sets the signals' handlers (record_signals): put back the test run's."""
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def mk(sps: float, extra_s: float = 0.0, seconds: float = 1.0, peak_mb: float | None = None,
       spread: tuple[float, float] | None = None, step_ms: float = 10.0) -> Measure:
    lo, hi = spread or (sps, sps)
    return Measure(samples_per_s=sps, spread=(lo, hi), windows=[lo, sps, hi], step_ms=step_ms,
                   extra_s=extra_s, seconds=seconds, peak_mb=peak_mb)


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.zeros(n, dtype=torch.long)


def subject(cfg: dict | None = None, train=None, **fit_kwargs) -> Subject:
    return Subject(Config.from_dict(cfg or {}), lambda: nn.Linear(4, 2),
                   data() if train is None else train, fit_kwargs)


class Reads(torch.utils.data.Dataset):
    """A dataset read item by item (not in-memory tensors): workers may help it."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        return torch.zeros(4), 0


class Bar:
    def __init__(self):
        self.descriptions: list[str] = []
        self.updates = 0

    def set_description(self, text: str) -> None:
        self.descriptions.append(text)

    def update(self, n: int) -> None:
        self.updates += n


# -- stop.py ------------------------------------------------------------------------------------


def test_a_signal_stop_names_the_signal_and_exits_as_a_shell_reports_it():
    e = stop.Stopped("SIGINT")
    assert (e.signal_name, e.exit_code) == ("SIGINT", 130)
    assert str(e) == ("tune stopped by SIGINT; nothing written (no tune.json, no tuned.yaml): "
                      "run it again to tune")
    assert stop.Stopped("SIGTERM").exit_code == 143
    with pytest.raises(stop.Stopped) as raised:
        stop._raise(signal.SIGTERM, None)
    assert raised.value.signal_name == "SIGTERM"


def test_the_tunes_handlers_raise_while_it_runs_and_the_previous_ones_come_back():
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    assert stop.SIGNALS == (signal.SIGINT, signal.SIGTERM)
    with stop.stop_on_signals():
        for sig in stop.SIGNALS:
            assert signal.getsignal(sig) is stop._raise
        received: list[str] = []
        stop.record_signals(received)  # a trial's loop: the signals are noted, not raised
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        assert received == ["SIGTERM", "SIGINT"]
    assert {sig: signal.getsignal(sig) for sig in stop.SIGNALS} == before


def test_only_the_main_thread_sets_signal_handlers():
    import threading

    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    seen = []

    def body():
        with stop.stop_on_signals():
            seen.append("in")
        stop.record_signals([])

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == ["in"]
    assert {sig: signal.getsignal(sig) for sig in stop.SIGNALS} == before


def test_stale_trial_directories_are_those_of_gone_processes_and_only_directories(
        tmp_path, monkeypatch):
    assert stop.trial_prefix() == f"ironloop-tune-{os.getpid()}-"
    gone = 4_000_000  # above any pid_max: never alive
    monkeypatch.setattr(stop, "alive", lambda pid: pid != gone)
    for name in (f"ironloop-tune-{gone}-a-b", f"ironloop-tune-{gone}-c", "ironloop-tune-12-live",
                 "ironloop-tune-x1-y"):
        (tmp_path / name).mkdir()
    (tmp_path / f"ironloop-tune-{gone}-file").write_text("")
    assert stop.clean_stale(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        f"ironloop-tune-{gone}-file", "ironloop-tune-12-live", "ironloop-tune-x1-y"])
    # no root: the temporary directory
    (tmp_path / f"ironloop-tune-{gone}-d").mkdir()
    monkeypatch.setattr(stop.tempfile, "gettempdir", lambda: str(tmp_path))
    assert stop.clean_stale() == 1 and not (tmp_path / f"ironloop-tune-{gone}-d").exists()


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


# -- output.py ------------------------------------------------------------------------------------


def test_the_progress_bar_follows_the_budgets_seconds(clock):
    class TqdmBar:
        n = 0.0

        def __init__(self):
            self.descriptions = []

        def set_description(self, text):
            self.descriptions.append(text)

        def update(self, n):
            self.n += n

    inner = TqdmBar()
    bar = output._Bar(inner, 100.0)
    assert bar.started == clock.now and bar.budget == 100.0
    bar.set_description("data.num_workers=2")
    assert inner.descriptions == ["tune: data.num_workers=2"]
    clock.now += 30.0
    bar.update(1)
    assert inner.n == 30.0
    clock.now += 30.0
    bar.update(1)
    assert inner.n == 60.0
    clock.now += 500.0
    bar.update(1)
    assert inner.n == 100.0  # never past the budget


def test_the_progress_bar_shows_on_a_terminal_or_when_asked_and_always_closes(monkeypatch):
    made = []

    class Tqdm:
        def __init__(self, **kwargs):
            self.kwargs, self.closed = kwargs, False
            made.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(output, "tqdm", Tqdm)
    with output.progress_bar("on", 59.6) as bar:
        assert isinstance(bar, output._Bar) and bar.bar is made[0] and bar.budget == 59.6
    assert made[0].kwargs == {"total": 60, "disable": False, "leave": False, "unit": "s",
                              "bar_format": "{desc} {bar} {n:.0f}/{total:.0f} s budget",
                              "dynamic_ncols": True}
    assert made[0].closed
    with pytest.raises(RuntimeError), output.progress_bar("off", 10):
        raise RuntimeError
    assert made[1].kwargs["disable"] is True and made[1].closed
    monkeypatch.setattr(output.sys, "stderr", types.SimpleNamespace(isatty=lambda: True))
    with output.progress_bar("auto", 10):
        pass
    assert made[2].kwargs["disable"] is False
    monkeypatch.setattr(output.sys, "stderr", types.SimpleNamespace(isatty=lambda: False))
    with output.progress_bar("auto", 10):
        pass
    assert made[3].kwargs["disable"] is True


class Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if isinstance(self.item, Exception):
            raise self.item
        return self.item


def test_tokens_per_sample_counts_a_language_models_integer_sequences():
    ids = torch.zeros(16, dtype=torch.long)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    labels = torch.zeros(4, dtype=torch.long)
    assert output.tokens_per_sample((tokens, labels)) == 16  # the inputs, not the labels
    assert output.tokens_per_sample((tokens[:1], labels[:1])) == 16  # the first sample's
    assert output.tokens_per_sample([tokens, labels]) == 16
    assert output.tokens_per_sample((torch.zeros(4, 16), tokens)) is None  # floats
    assert output.tokens_per_sample((torch.zeros(4, 16, dtype=torch.bool), tokens)) is None
    assert output.tokens_per_sample((torch.zeros(4, 2, 8, dtype=torch.long), tokens)) is None
    assert output.tokens_per_sample(Items({"input_ids": ids[:8], "labels": ids})) == 8
    assert output.tokens_per_sample(Items((ids[:12], ids))) == 12
    assert output.tokens_per_sample(Items([ids[:12], ids])) == 12
    assert output.tokens_per_sample(Items(ids[:5])) == 5
    assert output.tokens_per_sample(Items({"x": ids})) is None  # no input_ids
    assert output.tokens_per_sample(Items(3)) is None
    assert output.tokens_per_sample(Items(ValueError("unreadable"))) is None
    loader = torch.utils.data.DataLoader(Items((ids[:7], ids)), batch_size=2)
    assert output.tokens_per_sample(loader) == 7


def test_the_context_in_tune_json(clock, monkeypatch):
    monkeypatch.setattr(output.os, "getloadavg", lambda: (1.234, 0.5, 0.0))
    monkeypatch.setattr(output.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    subj = subject({"run": {"device": "cpu"}, "train": {"epochs": 3, "max_steps": 20}})
    tuner = types.SimpleNamespace(started=clock.now - 42.36, samples=500, pairs=4,
                                  plan=Plan(3, 5, 4, measure_s=1.23456), est_s=2.345678)
    info = output.context(subj, tuner, 60.0, Path("c.yaml"), ["train.epochs=3"])
    assert info == {"config": "c.yaml", "overrides": ["train.epochs=3"], "device": "cpu",
                    "torch": torch.__version__, "cpus": 3, "load_average": [1.23, 0.5, 0.0],
                    "budget_s": 60.0, "used_s": 42.4, "epochs": 3, "max_steps": 20,
                    "train_samples": 64, "planned_samples": 500, "tokens_per_sample": None,
                    "plan": {"warmup_steps": 3, "window_steps": 5, "windows": 4,
                             "measure_s": 1.235, "pairs": 4, "trial_estimate_s": 2.35}}
    monkeypatch.delattr(output.os, "sched_getaffinity")
    monkeypatch.setattr(output.os, "cpu_count", lambda: 7)
    info = output.context(subj, tuner, 60.0, None, [])
    assert (info["config"], info["overrides"], info["cpus"]) == (None, [], 7)


def test_durations_read_in_the_unit_that_suits_them():
    assert output.duration(None) == "-"
    assert output.duration(2 * 3600) == "2.0 h"
    assert output.duration(72 * 3600) == "72.0 h"
    assert output.duration(7199) == "120 min"
    assert output.duration(120) == "2 min"
    assert output.duration(119.4) == "119 s"
    assert output.duration(10) == "10 s"
    assert output.duration(9.96) == "10.0 s"
    assert output.duration(9.44) == "9.4 s"


def _info(**changes) -> dict:
    info = {"config": "c.yaml", "overrides": [], "device": "cpu", "cpus": 2,
            "load_average": [1.5, 0.25, 0.0], "budget_s": 120.0, "used_s": 118.6,
            "tokens_per_sample": None, "epochs": 10, "max_steps": 0, "train_samples": 640,
            "planned_samples": 6400, "plan": {"pairs": 4}}
    return {**info, **changes}


def _result(**changes) -> types.SimpleNamespace:
    """A tune's result: the baseline, a chosen worker count, a failed row, a trajectory
    winner."""
    base = Row("baseline (the config as it is)", {}, status="ok", ratio=1.0, projected_s=5185.0,
               measure=Measure(1234.4, (1200.0, 1300.4), [1200.0, 1234.4, 1300.4], 12.5, 0.0,
                               2.0, peak_mb=2048.4,
                               time_split={"data": 50.0, "forward": 100.0, "backward": 48.0,
                                           "optimizer": 1.0, "checkpoint": 0.5, "other": 0.5}))
    workers = Row("data.num_workers=2", {"data.num_workers": 2}, status="ok", ratio=2.0,
                  projected_s=2592.5, measure=mk(2468.8, spread=(2400.0, 2500.0)), won=True,
                  gain=2.0, verdict="chosen (paired)")
    failed = Row("data.num_workers=4", {"data.num_workers": 4}, status="failed",
                 reason="RuntimeError: boom")
    bf16 = Row("train.precision=bf16", {"train.precision": "bf16"}, kind="trajectory",
               status="ok", ratio=1.5, projected_s=3456.7, measure=mk(1851.6, spread=(1800, 1900)),
               note="autocast, no scaler", verdict="faster")
    result = types.SimpleNamespace(
        info=_info(), baseline=base, rows=[workers, failed, bf16],
        chosen={"data.num_workers": 2}, trajectory={"train.precision": "bf16"},
        applied_trajectory=False, speedup=2.0, paths={})
    for key, value in changes.items():
        setattr(result, key, value)
    return result


HEAD = ("  " + "setting".ljust(44) + "samples/s".rjust(10) + "  " + "spread".ljust(15)
        + "x base".rjust(7) + "run time".rjust(10) + "   verdict")


def _line(setting: str, figures: str, verdict: str) -> str:
    return "  " + setting.ljust(44) + figures + "   " + verdict


def test_the_table_shows_the_baseline_both_tables_and_the_run_time(no_cuda):
    result = _result()
    assert output.table(result).splitlines() == [
        "ironloop tune c.yaml: cpu, 2 CPU cores, load 1.5 0.25 0.0, budget 120 s, used 119 s",
        "baseline: 1,234 samples/s, 12.50 ms/step; peak memory 2,048 MB (process RSS)",
        "  time split: data 25%, forward 50%, backward 24%, optimizer 0%",
        "",
        "settings that cannot change the trajectory (tune applies the chosen ones):",
        HEAD,
        _line("baseline (the config as it is)",
              "     1,234  1,200-1,300       1.00    86 min", ""),
        _line("data.num_workers=2", "     2,469  2,400-2,500       2.00    43 min",
              "chosen (paired)"),
        _line("data.num_workers=4", "-".rjust(10) + " " * 24 + "-".rjust(10),
              "failed: RuntimeError: boom"),
        "",
        "settings that change the trajectory (reported; --apply-trajectory-changes applies the "
        "winners):",
        HEAD,
        _line("train.precision=bf16", "     1,852  1,800-1,900       1.50    58 min",
              "faster (autocast, no scaler)"),
        "",
        "run time at 10 epochs of 640 samples (training only): 86 min -> 43 min (2.00x)"]


def test_the_tables_head_line_counts_tokens_and_cuda_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = _result(info=_info(config=None, tokens_per_sample=16, max_steps=50,
                                planned_samples=1600))
    lines = output.table(result).splitlines()
    assert lines[0] == ("ironloop tune: cpu, 2 CPU cores, load 1.5 0.25 0.0, budget 120 s, "
                        "used 119 s")
    assert lines[1] == ("baseline: 1,234 samples/s (19,750 tokens/s), 12.50 ms/step; peak memory "
                        "2,048 MB (CUDA allocated)")
    assert lines[-1] == "run time at 50 steps (training only): 86 min -> 43 min (2.00x)"
    # max_steps past the configured epochs: the epochs end the run
    result.info = _info(max_steps=100000, planned_samples=6400)
    assert output.table(result).splitlines()[-1].startswith("run time at 10 epochs of 640 ")


def test_the_table_without_a_winner_says_why_tuned_yaml_is_the_input(no_cuda):
    base = _result().baseline
    base.measure.time_split = None
    threads = Row("run.threads=1", {"run.threads": 1}, status="ok", ratio=1.01, projected_s=5100.0,
                  measure=mk(1250.0), verdict="within noise",
                  pairs={"ratios": [1.2, 1.3], "wins": False})
    result = _result(baseline=base, rows=[threads], chosen={}, trajectory={}, speedup=1.0)
    lines = output.table(result).splitlines()
    assert lines[2] == ""  # no time split; and no trajectory table without its rows
    assert "settings that change the trajectory" not in "\n".join(lines)
    assert lines[-2] == ("run time at 10 epochs of 640 samples (training only): 86 min -> "
                         "86 min (1.00x)")
    assert lines[-1] == ("the budget ran out during the paired runs of run.threads=1 (faster in "
                         "every pair measured): tuned.yaml is the input config; rerun with a "
                         "larger --budget to confirm them")
    no_faster = ("no trajectory-free setting was faster beyond the noise (faster in every paired "
                 "run, median more than 5%): tuned.yaml is the input config")
    for pairs in ({"ratios": [1.2, 1.3, 1.2, 1.1], "wins": False},  # all ran
                  {"ratios": [1.2, 1.0], "wins": False},  # one said not faster
                  None):
        threads.pairs = pairs
        assert output.table(result).splitlines()[-1] == no_faster
    threads.pairs = {"ratios": [], "wins": False}  # the budget ended them before the first
    assert output.table(result).splitlines()[-1].startswith("the budget ran out")
    threads.pairs = {"ratios": [1.2, 1.3], "wins": False}
    result.info["plan"] = {"pairs": 2}  # a tune of two pairs: both ran
    assert output.table(result).splitlines()[-1] == no_faster
    result.info["plan"] = {}  # the default: 4 pairs
    assert output.table(result).splitlines()[-1].startswith("the budget ran out")
    threads.pairs = {"ratios": [1.2, 1.3, 1.2, 1.1], "wins": False}
    assert output.table(result).splitlines()[-1] == no_faster
    del result.info["plan"]
    assert output.table(result).splitlines()[-1] == no_faster
    threads.pairs = {"ratios": [1.2, 1.3, 1.2], "wins": False}
    assert output.table(result).splitlines()[-1].startswith("the budget ran out")
    threads.kind = "trajectory"  # only free settings are applied
    assert output.table(result).splitlines()[-1] == no_faster
    threads.kind, result.chosen = "free", {"x": 1}
    assert output.table(result).splitlines()[-1].startswith("run time at")


def test_the_table_of_free_settings_shows_the_baseline_even_with_none_tried(no_cuda):
    result = _result()
    result.rows = [r for r in result.rows if r.kind == "trajectory"]
    lines = output.table(result).splitlines()
    assert lines[4:8] == [
        "settings that cannot change the trajectory (tune applies the chosen ones):", HEAD,
        _line("baseline (the config as it is)", "     1,234  1,200-1,300       1.00    86 min",
              ""), ""]
    assert lines[8].startswith("settings that change the trajectory")


def test_the_time_split_leaves_out_the_parts_under_half_a_percent(no_cuda):
    result = _result()
    result.baseline.measure.time_split = {"other": 0.0}
    assert output.table(result).splitlines()[2] == "  time split: "


def test_set_makes_the_sections_it_needs():
    raw = {"a": 5, "keep": {"x": 1}}
    output._set(raw, "a.b.c", 1)
    output._set(raw, "keep.y", 2)
    output._set(raw, "top", 3)
    assert raw == {"a": {"b": {"c": 1}}, "keep": {"x": 1, "y": 2}, "top": 3}
    assert output._get(Config(), "train.precision") == "fp32"
    assert output._get(Config(), "data.num_workers") == 0


def test_tuned_yaml_from_python_objects_is_the_whole_config(tmp_path):
    cfg = Config().with_overrides({"train.epochs": 3})
    applied = {"data.num_workers": 2, "run.threads": 1}
    text = tuned_yaml_lines = output.tuned_yaml(cfg, None, [], applied)
    expected = cfg.with_overrides(applied).to_dict()
    assert text == ("# from ironloop.tune(): the model and data were Python objects; pass this "
                    "config to ironloop.fit()\n#   data.num_workers: 2\n#   run.threads: 1\n"
                    + yaml.safe_dump(expected, sort_keys=False))
    assert list(yaml.safe_load(tuned_yaml_lines)) == list(cfg.to_dict())  # the config's order
    unchanged = output.tuned_yaml(cfg, None, [], {})
    assert unchanged.splitlines()[1] == "#   (no change)"
    assert yaml.safe_load(unchanged) == cfg.to_dict()


def test_tuned_yaml_from_a_file_keeps_its_keys_and_the_command_lines(tmp_path):
    from ironloop.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 3\ndata:\n  name: synthetic\n")
    overrides = ["train.batch_size=16", "data.root="]
    cfg = load_config(path, overrides)
    text = output.tuned_yaml(cfg, path, overrides, {"data.num_workers": 2})
    assert text == (f"# ironloop tune {path} train.batch_size=16 data.root=\n"
                    f"#   data.num_workers: 2\n"
                    + yaml.safe_dump({"train": {"epochs": 3, "batch_size": 16},
                                      "data": {"name": "synthetic", "root": "",
                                               "num_workers": 2}}, sort_keys=False))
    plain = load_config(path)
    assert output.tuned_yaml(plain, path, [], {"run.threads": 1}).splitlines()[:2] == [
        f"# ironloop tune {path}", "#   run.threads: 1"]
    assert output.tuned_yaml(cfg, path, overrides, {}).splitlines()[1] == "#   (no change)"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert yaml.safe_load(output.tuned_yaml(load_config(empty), empty, [], {"run.threads": 1})) \
        == {"run": {"threads": 1}}


def test_write_puts_tune_json_and_tuned_yaml_in_run_dir_and_says_what_to_run(
        tmp_path, capsys, no_cuda):
    run = tmp_path / "a" / "run"
    cfg = Config().with_overrides({"run.dir": str(run)})
    result = _result(speedup=2.000049)
    output.write(result, cfg, None, [], {"data.num_workers": 2})
    doc = {"info": result.info, "baseline": result.baseline.to_dict(),
           "trials": [r.to_dict() for r in result.rows], "chosen": {"data.num_workers": 2},
           "trajectory_winners": {"train.precision": "bf16"},
           "applied_trajectory_changes": False, "speedup": 2.0}
    assert (run / "tune.json").read_text() == json.dumps(doc, indent=2) + "\n"
    assert (run / "tuned.yaml").read_text() == output.tuned_yaml(cfg, None, [],
                                                                 {"data.num_workers": 2})
    assert result.paths == {"tune.json": run / "tune.json", "tuned.yaml": run / "tuned.yaml"}
    out = capsys.readouterr().out
    assert out == (output.table(result) + "\n"
                   "the second table's winners change the trajectory and were not applied: "
                   "train.precision=bf16 (--apply-trajectory-changes applies them)\n"
                   f"wrote {run}/tune.json and {run}/tuned.yaml; train with: ironloop train "
                   f"{run}/tuned.yaml\n")


def test_write_notes_each_applied_trajectory_change(tmp_path, capsys, no_cuda):
    cfg = Config().with_overrides({"run.dir": str(tmp_path)})
    result = _result(applied_trajectory=True,
                     trajectory={"train.precision": "bf16", "train.batch_size": 128})
    output.write(result, cfg, None, [], {"train.precision": "bf16", "train.batch_size": 128})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:-1] == [
        "notice: --apply-trajectory-changes: train.precision: 'fp32' -> 'bf16' changes the "
        "training trajectory",
        "notice: --apply-trajectory-changes: train.batch_size: 64 -> 128 changes the training "
        "trajectory"]
    assert json.loads((tmp_path / "tune.json").read_text())["applied_trajectory_changes"] is True
    result = _result(trajectory={})
    output.write(result, cfg, None, [], {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == output.table(result).splitlines()[-1] and lines[-1].startswith("wrote ")


def test_a_run_dir_that_cannot_be_written_is_a_one_line_error(tmp_path, no_cuda):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = Config().with_overrides({"run.dir": str(blocker / "run")})
    result = _result()
    with pytest.raises(UserError) as raised:
        output.write(result, cfg, None, [], {})
    assert str(raised.value) == (f"run.dir {blocker / 'run'} cannot be created or written (Not a "
                                 f"directory); choose a writable run.dir")
    assert isinstance(raised.value.__cause__, OSError) and result.paths == {}


# -- the decisions (__init__.py) ------------------------------------------------------------------


def test_a_setting_wins_only_faster_in_every_pair_and_beyond_the_noise():
    assert (tune_mod.NOISE, tune_mod.PAIRS, tune_mod.CONFIRMS) == (0.05, 4, 3)
    won = tune_mod.paired([1.9, 1.4, 2.3, 1.7])
    assert (won.wins, won.spread, won.why) == (True, (1.4, 2.3), "4 of 4 pairs faster")
    assert won.median == pytest.approx(1.8)
    assert won.ratios == [1.9, 1.4, 2.3, 1.7]
    tie = tune_mod.paired([1.0, 2.0, 2.0, 2.0])  # a pair that is no faster says slower
    assert (tie.wins, tie.why) == (False, "1 of 4 pairs not faster")
    assert tune_mod.paired([0.5, 0.9, 2.0, 2.0]).why == "2 of 4 pairs not faster"
    assert tune_mod.paired([2.0, 2.0, 2.0]).why == "3 of 4 pairs measured"
    at = tune_mod.paired([1.05] * 4)  # the median must be more than 5% faster
    assert (at.wins, at.why) == (False, "median 1.05x is within 5%")
    assert tune_mod.paired([1.06] * 4).wins
    assert tune_mod.paired([1.06] * 5).why == "5 of 4 pairs faster"
    none = tune_mod.paired([])
    assert (none.wins, none.median, none.spread, none.why) == (False, 1.0, (1.0, 1.0),
                                                               "0 of 4 pairs measured")
    assert tune_mod.paired([1.2, 1.2], pairs=2).why == "2 of 2 pairs faster"
    assert tune_mod.paired([1.2] * 4, margin=0.25).why == "median 1.20x is within 25%"
    assert tune_mod.Paired([1.234567], True, 1.234567, (1.00004, 1.3), "w").to_dict() == {
        "ratios": [1.2346], "median": 1.2346, "spread": [1.0, 1.3], "wins": True, "why": "w"}


def test_planned_samples_are_the_runs_epochs_or_its_max_steps():
    def planned(n=100, **train):
        return tune_mod.planned_samples(Config.from_dict({"train": train}), n)

    assert planned(epochs=3, batch_size=32) == 300
    assert planned(epochs=3, batch_size=32, max_steps=5) == 100 + 32  # 4 steps an epoch
    assert planned(epochs=3, batch_size=32, max_steps=100) == 300
    assert planned(epochs=2, batch_size=32, accumulation_steps=2, max_steps=3) == 100 + 64
    assert planned(epochs=2, batch_size=25, max_steps=8) == 200  # no ragged step
    assert planned(epochs=1, batch_size=200) == 100


def test_a_plan_fills_the_trials_seconds_at_the_probes_speed():
    assert tune_mod.plan_for(0.5, 15.0) == Plan(3, 5, 5, measure_s=12.5)  # 30 steps
    assert tune_mod.plan_for(0.5, 14.5) == Plan(1, 5, 5, measure_s=12.5)  # 29
    assert tune_mod.plan_for(0.5, 5.0) == Plan(1, 1, 5, measure_s=2.5)  # 10
    assert tune_mod.plan_for(0.5, 4.5) == Plan(1, 4, 2, measure_s=4.0)  # 9
    assert tune_mod.plan_for(0.5, 0.5) == Plan(1, 1, 2, measure_s=1.0)  # 3 at least
    assert tune_mod.plan_for(0.0, 1.0).window == 199_999  # a step of 1 us at least


@pytest.fixture
def trial_log(clock, monkeypatch):
    """run_trial replaced: each call is logged as (overrides, plan, deadline) and answered by
    ``trial_log.answer(overrides)`` (a Measure, or an exception to raise); it costs
    ``trial_log.cost`` seconds of the fake clock."""
    log = types.SimpleNamespace(calls=[], subjects=[], cost=1.0,
                                answer=lambda overrides: mk(100.0))

    def run_trial(subj, overrides, plan, deadline):
        log.calls.append((dict(overrides), plan, deadline))
        log.subjects.append(subj)
        clock.now += log.cost
        answer = log.answer(overrides)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(tune_mod, "run_trial", run_trial)
    return log


def _tuner(cfg=None, budget=100.0, n=64) -> tune_mod.Tuner:
    return tune_mod.Tuner(subject(cfg or {"train": {"batch_size": 8, "epochs": 2}},
                                  train=data(n)), budget, Bar())


def test_a_new_tuner_has_the_budget_ahead_and_the_runs_length(clock):
    tuner = _tuner({"train": {"batch_size": 8, "epochs": 3, "max_steps": 10}})
    assert (tuner.started, tuner.deadline, tuner.left()) == (1000.0, 1100.0, 100.0)
    assert (tuner.plan, tuner.est_s, tuner.rows, tuner.baseline) == (Plan(1, 1, 2), 0.0, [], None)
    assert (tuner.samples, tuner.epochs) == (64 + 2 * 8, 2)  # 10 steps: 1 epoch and 2 steps
    assert tune_mod.Tuner.pairs == 4
    clock.now += 30.5
    assert tuner.left() == 69.5


def test_a_trials_deadline_is_three_times_its_share_and_within_the_budget(clock, trial_log):
    tuner = _tuner()
    tuner.plan = Plan(3, 5, 5)
    for est, extra, deadline in ((2.0, 0.0, 1000 + 7.0), (10.0, 0.0, 1000 + 30.0),
                                 (10.0, 1.0, 1000 + 33.0), (40.0, 0.0, 1100.0)):
        tuner.est_s, start = est, clock.now
        tuner.measure({"run.threads": 1}, extra)
        assert trial_log.subjects[-1] is tuner.subject
        assert trial_log.calls[-1] == ({"run.threads": 1}, Plan(3, 5, 5),
                                       min(1100.0, deadline + start - 1000.0))
        clock.now = 1000.0


def _start(trial_log, probe: Measure, budget=100.0, probe_cost=20.0, rows=3):
    answers = iter([probe, mk(64.0, extra_s=0.5, seconds=2.5)])
    trial_log.answer = lambda overrides: next(answers)
    costs = iter([probe_cost, 1.0])
    tuner = _tuner(budget=budget)
    original = trial_log.answer

    def answer(overrides):
        trial_log.cost = next(costs, 1.0)
        return original(overrides)

    trial_log.answer = answer
    return tuner, tuner.start(planned_rows=rows)


def test_start_plans_the_trials_from_a_probe_and_measures_the_baseline(clock, trial_log):
    trial_log.cost = 20.0  # the probe's 20 s: 80 left for 3 rows, a baseline and 12 paired
    answers = iter([mk(50.0, step_ms=125.0, seconds=0.75), mk(64.0, extra_s=0.5, seconds=2.5)])
    trial_log.answer = lambda overrides: next(answers)
    tuner = _tuner()
    base = tuner.start(planned_rows=3)
    # share = 0.85 x 80 / 16 - 0.5 s of set-up = 3.75 s: 30 steps of 0.125 s
    assert tuner.plan == Plan(3, 5, 5, measure_s=3.125)
    assert trial_log.calls == [({}, Plan(1, 1, 2), 1100.0),
                               # the baseline's share: 0.5 + 28 x 0.125 = 4 s, three times over
                               ({}, Plan(3, 5, 5, measure_s=3.125), 1020.0 + 12.0)]
    assert tuner.baseline is base and tuner.est_s == 2.5 and tuner.rows == []
    assert (base.setting, base.overrides, base.status) == ("baseline (the config as it is)", {},
                                                           "ok")
    assert (base.ratio, base.projected_s) == (1.0, 128 / 64 + 0.5)
    assert tuner.bar.descriptions == ["baseline (the config as it is)"] and tuner.bar.updates == 1


@pytest.mark.parametrize(("probe_s", "budget", "plan", "est"), [
    (5.0, 100.0, Plan(1, 5, 5, measure_s=3.125), 1.0 + 26 * 0.125),  # set-up: 1 s at most
    (0.1, 100.0, Plan(3, 6, 5, measure_s=3.75), 33 * 0.125),  # 0 at least
    (0.75, 10000.0, Plan(3, 15, 5, measure_s=9.375), 0.5 + 78 * 0.125),  # 10 s a trial at most
    (0.75, 25.0, Plan(1, 3, 2, measure_s=0.75), 0.5 + 7 * 0.125)])  # 1 s at least
def test_a_trials_share_and_set_up_are_bounded(clock, trial_log, probe_s, budget, plan, est):
    trial_log.cost = 20.0
    seen = []
    answers = iter([mk(50.0, step_ms=125.0, seconds=probe_s), mk(64.0, seconds=2.5)])

    def answer(overrides):
        seen.append(tuner.est_s)
        return next(answers)

    trial_log.answer = answer
    tuner = _tuner(budget=budget)
    tuner.start(planned_rows=3)
    assert tuner.plan == plan and seen == [0.0, est]


def test_a_config_that_cannot_train_or_fit_the_budget_stops_the_tune(clock, trial_log):
    trial_log.answer = lambda overrides: TrialFailed("RuntimeError: bad")
    with pytest.raises(UserError) as raised:
        _tuner().start(planned_rows=3)
    assert str(raised.value) == ("the config does not train as it stands (RuntimeError: bad); "
                                 "fix that first (ironloop train fails the same way)")
    assert raised.value.__suppress_context__
    trial_log.answer = lambda overrides: TrialFailed("slow", overrun=True)
    with pytest.raises(UserError) as raised:
        _tuner().start(planned_rows=3)
    assert str(raised.value) == ("--budget=100 s does not fit even a 3-step probe of this run; "
                                 "raise --budget")
    answers = iter([mk(50.0, step_ms=125.0, seconds=0.75), TrialFailed("RuntimeError: late")])
    trial_log.answer = lambda overrides: next(answers)
    with pytest.raises(UserError, match=r"^the baseline could not be measured "
                                        r"\(RuntimeError: late\)$"):
        _tuner().start(planned_rows=3)
    trial_log.cost = 21.0  # the probe leaves 1 s: not the baseline's 1.4
    trial_log.answer = lambda overrides: mk(50.0, step_ms=125.0, seconds=0.75)
    with pytest.raises(UserError, match=r"^the baseline could not be measured \(budget: needs "
                                        r"~1 s, 1 s left\)$"):
        _tuner(budget=22.0).start(planned_rows=3)


def _measured_tuner(clock, est_s=4.0, budget=100.0) -> tune_mod.Tuner:
    tuner = _tuner(budget=budget)
    tuner.baseline = Row("baseline", {}, status="ok", measure=mk(64.0), projected_s=2.0)
    tuner.est_s = est_s
    return tuner


def test_a_row_runs_on_top_of_its_base_and_gets_its_figures(clock, trial_log):
    tuner = _measured_tuner(clock)
    trial_log.answer = lambda overrides: mk(96.0, extra_s=0.5)
    row = Row("run.threads=1", {"run.threads": 1})
    tuner.run_row(row, {"data.num_workers": 2}, extra_s=2.0)
    assert trial_log.calls == [({"data.num_workers": 2, "run.threads": 1}, Plan(1, 1, 2),
                                1000.0 + 18.0)]
    assert (row.status, row.base, row.ratio) == ("ok", {"data.num_workers": 2}, 1.5)
    # 128 samples at 96/s, and the workers start at each of the 2 epochs
    assert row.projected_s == 128 / 96 + 2 * 0.5
    assert tuner.rows == [row] and tuner.bar.descriptions == ["run.threads=1"]
    assert tuner.bar.updates == 1
    trial_log.answer = lambda overrides: TrialFailed("RuntimeError: x")
    failed = Row("run.threads=2", {"run.threads": 2})
    tuner.run_row(failed, {})
    assert (failed.status, failed.reason, failed.measure, failed.ratio, failed.projected_s) == \
        ("failed", "RuntimeError: x", None, None, None)
    assert tuner.rows == [row, failed] and tuner.bar.updates == 2


def test_a_row_the_budget_cannot_fit_is_skipped_and_says_so(clock, trial_log):
    tuner = _measured_tuner(clock)
    clock.now = 1090.0  # 10 s left, 4 a trial
    held = Row("a", {"run.threads": 1})
    tuner.run_row(held, {}, extra_s=2.0, hold_s=4.0)  # 10 - 4 = 4 + 2: it fits
    assert held.status == "ok"
    held = Row("b", {"run.threads": 1})
    tuner.run_row(held, {}, extra_s=2.0, hold_s=5.0)
    assert (held.status, held.reason) == (
        "skipped", "budget: needs ~6 s, 9 s left, 5 s of them held for the paired runs")
    short = Row("c", {"run.threads": 1})
    clock.now = 1103.0
    tuner.run_row(short, {"data.num_workers": 1})
    assert (short.status, short.reason, short.base) == ("skipped", "budget: needs ~4 s, 0 s left",
                                                        {"data.num_workers": 1})
    planned = Row("d", {}, status="skipped", reason="in-memory")
    tuner.run_row(planned, {"x": 1})
    assert (planned.status, planned.reason, planned.base) == ("skipped", "in-memory", {"x": 1})
    assert len(trial_log.calls) == 1 and tuner.rows[-1] is planned and tuner.bar.updates == 4
    assert tuner.bar.descriptions == ["a"]


def test_the_projected_time_charges_worker_start_ups_per_epoch_and_a_compile_once(clock):
    tuner = _tuner()  # 128 samples: 2 epochs
    m = mk(40.0, extra_s=3.0)
    assert tuner.projected(m, {}) == 128 / 40 + 3.0
    assert tuner.projected(m, {"data.num_workers": 2}) == 128 / 40 + 2 * 3.0
    assert tuner.projected(m, {"data.num_workers": 2, "train.compile": True}) == 128 / 40 + 3.0


def _group_tuner(clock, speeds: dict, est_s: float = 1.0, left: float = 1000.0):
    """A tuner whose trials answer ``speeds[overrides]`` (a rate, or (screen, later) rates: the
    first measurement of a config is its screen) and cost no time."""
    tuner = _measured_tuner(clock, est_s=est_s)
    tuner.baseline.measure, tuner.baseline.projected_s = mk(100.0), 1.28  # 128 samples
    tuner.left = lambda: left
    seen: set = set()
    calls = []

    def measure(overrides, extra_s=0.0):
        key = tuple(sorted(overrides.items()))
        calls.append((key, extra_s))
        speed = speeds[key]
        if isinstance(speed, tuple):
            speed = speed[0] if key not in seen else speed[1]
        seen.add(key)
        return mk(speed)

    tuner.measure = measure
    return tuner, calls


def test_a_group_pairs_its_three_fastest_and_says_why_each_row_lost(clock):
    speeds = {(): 100.0, (("run.threads", 1),): 200.0, (("run.threads", 2),): 50.0,
              (("run.threads", 3),): 101.0, (("run.threads", 4),): 300.0,
              (("run.threads", 5),): 400.0, (("run.threads", 6),): 500.0}
    tuner, calls = _group_tuner(clock, speeds)
    group = [Row(f"run.threads={t}", {"run.threads": t}) for t in range(1, 7)]
    group.insert(2, Row("data.num_workers=1", {}, status="skipped", reason="in-memory"))
    winner = tuner.group(group, {}, tuner.baseline)
    one, two, skipped, three, four, five, six = group
    assert winner is six and six.won and six.gain == 5.0
    assert six.verdict == ("chosen (paired against the config: median 5.00x, 5.00-5.00x, "
                           "4 of 4 pairs faster)")
    assert six.pairs == {"ratios": [5.0] * 4, "median": 5.0, "spread": [5.0, 5.0], "wins": True,
                         "why": "4 of 4 pairs faster", "against": {}}
    assert five.verdict == ("faster once, not in the paired runs against run.threads=6 (1 of 1 "
                            "pairs not faster; ratios 0.80): within the machine's noise")
    assert five.pairs["against"] == {"run.threads": 6} and not five.won
    assert four.verdict.startswith("faster once, not in the paired runs against run.threads=6 "
                                   "(1 of 1 pairs not faster; ratios 0.60):")
    assert one.verdict == "faster, but other settings were faster still" and one.pairs is None
    assert (two.verdict, three.verdict, skipped.verdict) == ("slower", "within noise", "")
    # the screen, then A B, B A, A B, B A for six, then one pair each for five and four
    six_key, five_key, four_key = ((("run.threads", t),) for t in (6, 5, 4))
    assert [key for key, _ in calls[6:]] == [(), six_key, six_key, (), (), six_key, six_key, (),
                                             six_key, five_key, six_key, four_key]
    assert tuner.rows == group


def test_a_later_winner_replaces_the_first_and_multiplies_its_gain(clock):
    bf16, big = (("train.precision", "bf16"),), (("train.batch_size", 128),)
    current = (("data.num_workers", 2),)
    speeds = {current: 100.0, current + big: (250.0, 400.0),
              tuple(sorted(current + bf16)): (300.0, 200.0)}
    tuner, calls = _group_tuner(clock, speeds)
    best = Row("data.num_workers=2", {"data.num_workers": 2}, status="ok", measure=mk(100.0),
               projected_s=1.28)
    p = Row("train.precision=bf16", {"train.precision": "bf16"}, kind="trajectory")
    q = Row("train.batch_size=128", {"train.batch_size": 128}, kind="trajectory")
    assert tuner.group([p, q], {"data.num_workers": 2}, best, extra_s=0.5) is q
    assert (q.won, p.won, q.gain, p.gain) == (True, False, 4.0, 2.0)
    assert q.verdict == ("winner (paired against train.precision=bf16: median 2.00x, 2.00-2.00x, "
                         "4 of 4 pairs faster)")
    assert p.verdict == ("won its pairs (paired against the config: median 2.00x, 2.00-2.00x, "
                         "4 of 4 pairs faster); train.batch_size=128 beat it")
    assert q.pairs["against"] == {"data.num_workers": 2, "train.precision": "bf16"}
    # the extra seconds go with the setting's trials (screen and pairs), never the config's
    assert {extra for key, extra in calls if key == current + big} == {0.5}
    assert {extra for key, extra in calls if key == current} == {0.0}
    # the first winner's verdict is rewritten the same way for a free setting
    tuner2, _ = _group_tuner(clock, {})
    tuner2._pairs = lambda a, b, extra_s: tune_mod.paired([2.0] * 4)
    one = Row("run.threads=1", {"run.threads": 1})
    two = Row("run.threads=2", {"run.threads": 2})
    tuner2.run_row = _fake_screen({"run.threads=1": 0.4, "run.threads=2": 0.5})
    assert tuner2.group([one, two], {}, tuner2.baseline) is two
    assert one.verdict == ("won its pairs (paired against the config: median 2.00x, 2.00-2.00x, "
                           "4 of 4 pairs faster); run.threads=2 beat it")
    assert two.verdict.startswith("chosen (paired against run.threads=1: ")


def _fake_screen(projected: dict):
    def run_row(row, base, extra_s=0.0, hold_s=0.0):
        row.base, row.status, row.measure = dict(base), "ok", mk(100.0)
        row.projected_s = projected[row.setting]

    return run_row


def test_a_group_judges_rows_against_the_best_so_far(clock):
    speeds = {(("data.num_workers", 2),): 100.0,
              (("data.num_workers", 2), ("run.threads", 1)): 40.0}
    tuner, _ = _group_tuner(clock, speeds)
    best = Row("data.num_workers=2", {"data.num_workers": 2}, status="ok", measure=mk(100.0),
               projected_s=1.28)
    slow = Row("run.threads=1", {"run.threads": 1})
    assert tuner.group([slow], {"data.num_workers": 2}, best) is None
    assert slow.verdict == "slower than data.num_workers=2" and slow.pairs is None


@pytest.mark.parametrize(("left", "extra_s", "second"), [
    (9.0, 0.0, "ok"), (8.75, 0.0, "skipped"), (10.0, 0.5, "ok"), (9.75, 0.5, "skipped"),
    (1.0, 0.0, "skipped")])  # nothing held before a row screens faster
def test_once_a_row_screens_faster_the_screen_holds_its_pairs_budget(clock, left, extra_s, second):
    # est 1 s: 4 pairs of 2 trials hold 8 s, plus the setting's extra seconds
    speeds = {(): 100.0, (("run.threads", 1),): 200.0, (("run.threads", 2),): 100.0}
    tuner, _ = _group_tuner(clock, speeds, est_s=1.0, left=left)
    first, then = Row("run.threads=1", {"run.threads": 1}), Row("run.threads=2", {"run.threads": 2})
    tuner.group([first, then], {}, tuner.baseline, extra_s=extra_s)
    assert first.status == "ok" and then.status == second
    assert first.won == (left >= 2 * 1.0 + extra_s)  # room for its pairs
    if second == "skipped":
        assert then.reason == (f"budget: needs ~{1 + extra_s:.0f} s, {left:.0f} s left, "
                               f"{8 + extra_s:.0f} s of them held for the paired runs")


def test_pairs_stop_when_the_budget_cannot_hold_another(clock):
    tuner = _measured_tuner(clock, est_s=1.0, budget=4.5)
    calls = []

    def measure(overrides, extra_s=0.0):
        calls.append(("B" if overrides else "A", extra_s))
        clock.now += 0.5
        return mk(200.0 if overrides else 100.0)

    tuner.measure = measure
    verdict = tuner._pairs({}, {"run.threads": 1}, 0.5)  # a pair needs 2 x 1 + 0.5 s
    assert calls == [("A", 0.0), ("B", 0.5), ("B", 0.5), ("A", 0.0), ("A", 0.0), ("B", 0.5)]
    assert verdict.ratios == [2.0, 2.0, 2.0] and verdict.why == "3 of 4 pairs measured"
    assert not verdict.wins


def test_a_paired_trial_that_fails_ends_the_pairs_without_a_win(clock):
    tuner = _measured_tuner(clock, est_s=1.0)
    answers = iter([mk(100.0), mk(200.0), TrialFailed("RuntimeError: oom")])

    def measure(overrides, extra_s=0.0):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    tuner.measure = measure
    assert tuner._pairs({}, {"run.threads": 1}, 0.0) == tune_mod.Paired(
        [2.0], False, 1.0, (1.0, 1.0), "a paired trial failed: RuntimeError: oom")
    answers = iter([mk(100.0)] * 8)  # as fast as the config: no faster, so no more pairs
    verdict = tuner._pairs({}, {"run.threads": 1}, 0.0)
    assert verdict.ratios == [1.0] and verdict.why == "1 of 1 pairs not faster"
    assert len(list(answers)) == 6


def test_the_screens_verdicts_and_a_compile_that_does_not_pay():
    def row(overrides, sps, run_s):
        return Row("x", overrides, status="ok", measure=mk(sps), projected_s=run_s)

    base = Row("baseline", {}, status="ok", measure=mk(100.0), projected_s=20.0)
    assert tune_mod._verdict(row({}, 100.0, 18.99), base) == "faster"
    assert tune_mod._verdict(row({}, 100.0, 19.0), base) == "within noise"  # 5% exactly
    assert tune_mod._verdict(row({}, 100.0, 21.0), base) == "within noise"  # 21 x 0.95 < 20
    assert tune_mod._verdict(row({}, 100.0, 21.1), base) == "slower"
    compiled = row({"train.compile": True}, 150.0, 40.0)
    assert tune_mod._verdict(compiled, base) == ("faster steps, but the compile does not pay for "
                                                 "itself in this run")
    assert tune_mod._verdict(row({"train.compile": True}, 100.0, 40.0), base) == "slower"
    assert tune_mod._verdict(row({"train.compile": False}, 150.0, 40.0), base) == "slower"
    assert tune_mod._verdict(row({"run.threads": 1}, 150.0, 40.0), base) == "slower"
    assert tune_mod._ratios([]) == "no pairs"
    assert tune_mod._ratios([1.234, 0.5]) == "ratios 1.23, 0.50"
    assert tune_mod._name(None, "the config") == "the config" and tune_mod._name(base, "") == \
        "baseline"


def test_the_largest_micro_batch_that_fits_on_cuda_is_reported_not_applied(
        clock, trial_log, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=1000 * 2**20))
    peaks = {16: 100.0, 32: 850.0, 64: 851.0}  # 85% of 1000 MiB: 850 fits, 851 does not
    trial_log.answer = lambda o: mk(50.0 * o["train.batch_size"] / 8,
                                    peak_mb=peaks[o["train.batch_size"]])
    tuner = _measured_tuner(clock, est_s=2.0)
    cuda = torch.device("cuda")
    assert tuner.largest_fit({}, torch.device("cpu")) is None
    row = tuner.largest_fit({"run.threads": 1}, cuda)
    assert [call[0] for call in trial_log.calls] == [
        {"run.threads": 1, "train.batch_size": b, "train.accumulation_steps": 1}
        for b in (16, 32, 64)]
    assert [call[1:] for call in trial_log.calls] == [(Plan(1, 1, 2), 1000.0 + 6.0),
                                                      (Plan(1, 1, 2), 1001.0 + 6.0),
                                                      (Plan(1, 1, 2), 1002.0 + 6.0)]
    assert row == Row(
        "train.batch_size=32 train.accumulation_steps=1",
        {"train.batch_size": 32, "train.accumulation_steps": 1}, kind="trajectory",
        status="ok", measure=row.measure, base={"run.threads": 1}, ratio=200.0 / 64,
        projected_s=128 / 200.0, verdict="reported, not applied",
        note="the largest that fits: peak 850 of 1,000 MiB; a larger global batch unless "
             "accumulation drops to match")
    assert tuner.rows == [row] and row.measure.peak_mb == 850.0


def test_without_room_for_a_larger_micro_batch_the_row_says_so(clock, trial_log, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=1000 * 2**20))
    cuda = torch.device("cuda")
    skipped = Row("largest micro-batch that fits", {}, kind="trajectory", status="skipped",
                  reason="train.batch_size=8 is the largest that fits with 15% of the memory "
                         "free")
    trial_log.answer = lambda o: TrialFailed("RuntimeError: CUDA out of memory")
    tuner = _measured_tuner(clock, est_s=2.0)
    assert tuner.largest_fit({}, cuda) == skipped and len(trial_log.calls) == 1
    trial_log.answer = lambda o: mk(50.0, peak_mb=1.0)
    row = _measured_tuner(clock, est_s=2.0).largest_fit({"train.batch_size": 16}, cuda)
    assert row.setting == "train.batch_size=64 train.accumulation_steps=1"  # 64 samples: no more
    for spent, status in ((98.0, "skipped"), (97.9, "ok")):  # left > a trial's share
        tuner = _measured_tuner(clock, est_s=2.0)
        clock.now += spent
        assert tuner.largest_fit({}, cuda).status == status


# -- the whole tune, on fabricated trials ---------------------------------------------------------


@pytest.mark.parametrize("budget", [0, -1.0, math.nan, math.inf])
def test_a_budget_must_be_a_finite_number_of_seconds(budget):
    with pytest.raises(ConfigError) as raised:
        tune_mod.run_tune(subject(), budget)
    assert str(raised.value) == (f"--budget={budget}: must be a finite number of seconds > 0 "
                                 f"(default 120)")
    assert tune_mod.DEFAULT_BUDGET == 120.0


def test_a_tune_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="^ironloop tune runs in one process: start it without "
                                        "torchrun$"):
        tune_mod.run_tune(subject(), 10.0)


def _speed(overrides: dict) -> Measure:
    """What the fabricated machine gives: one thread doubles the speed, bf16 makes it 1.5x, a
    compile too (after 10 s of compiling); the micro-batch changes nothing."""
    sps = 100.0 * (2 if overrides.get("run.threads") == 1 else 1) \
        * (1.5 if overrides.get("train.precision") == "bf16" else 1) \
        * (1.5 if overrides.get("train.compile") else 1)
    return mk(sps, extra_s=10.0 if overrides.get("train.compile") else 0.0, seconds=1.0,
              peak_mb=512.0, step_ms=125.0)


@pytest.fixture
def fabricated(tmp_path, clock, trial_log, monkeypatch):
    """A tune of a BatchNorm model on in-memory data on 2 cores and 2 threads, whose trials
    answer ``_speed``: 200 epochs of 64 samples, 8 a step, 2 micro-batches a step."""
    monkeypatch.setattr(rows, "cpus", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(rows, "_cpu_has_bf16", lambda: True)
    monkeypatch.setattr(tune_mod, "clean_stale", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(output.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    trial_log.answer = _speed
    cfg = Config.from_dict({"run": {"device": "cpu", "dir": str(tmp_path / "run")},
                            "train": {"batch_size": 4, "accumulation_steps": 2, "epochs": 200},
                            "log": {"progress": "off"}})
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return Subject(cfg, lambda: model, data(64), {})


def test_a_tune_applies_the_free_winners_and_reports_the_trajectory_ones(fabricated, trial_log,
                                                                       tmp_path, capsys):
    result = tune_mod._finish(fabricated, 101.0, False, None, [])
    # the probe's 1 s leaves 100: a share of 0.85 x 100 / (2 rows + 5 + 1 + 12) - 0.75 s of
    # set-up = 3.5 s, 28 steps of 0.125 s
    assert [call[1] for call in trial_log.calls[:3]] == [Plan(1, 1, 2)] + 2 * [
        Plan(1, 5, 5, measure_s=3.125)]
    assert {id(s) for s in trial_log.subjects} == {id(fabricated)}
    threads, compiled = {"run.threads": 1}, {"run.threads": 1, "train.compile": True}
    bf16 = {"run.threads": 1, "train.precision": "bf16"}
    micro = {"run.threads": 1, "train.batch_size": 8, "train.accumulation_steps": 1}
    assert [call[0] for call in trial_log.calls] == [
        {}, {},  # the probe, the baseline
        threads, *[{}, threads, threads, {}] * 2,  # the screen, then the pairs
        bf16, *[threads, bf16, bf16, threads] * 2,
        micro,  # within noise: no pairs
        compiled, *[threads, compiled, compiled, threads] * 2]
    assert result.chosen == {"run.threads": 1, "train.compile": True}
    assert result.trajectory == {"train.precision": "bf16"} and not result.applied_trajectory
    assert result.config.to_dict() == fabricated.cfg.with_overrides(result.chosen).to_dict()
    # 12,800 samples: 128 s, 64 s with one thread, 12,800 / 300 + 10 s compiled
    compiled_s = 12800 / 300 + 10.0
    assert result.speedup == pytest.approx(2.0 * 64 / compiled_s)
    assert [(r.setting, r.status, r.won) for r in result.rows] == [
        ("data.num_workers", "skipped", False), ("run.threads=1", "ok", True),
        ("train.precision=bf16", "ok", True),
        ("train.batch_size=8 train.accumulation_steps=1", "ok", False),
        ("train.compile=true", "ok", True)]
    _, one, half, batch, compile_row = result.rows
    assert (one.gain, half.gain) == (2.0, 1.5)
    assert compile_row.gain == pytest.approx(64 / compiled_s)
    assert batch.note == "BatchNorm: NOT the same trajectory (it normalises each micro-batch)"
    assert batch.verdict == "within noise of run.threads=1"
    assert half.base == threads and compile_row.base == threads
    assert result.baseline.projected_s == 128.0 and one.projected_s == 64.0
    assert compile_row.projected_s == pytest.approx(compiled_s)
    run = tmp_path / "run"
    doc = json.loads((run / "tune.json").read_text())
    assert doc["chosen"] == result.chosen and doc["trajectory_winners"] == result.trajectory
    assert doc["info"]["budget_s"] == 101.0 and doc["info"]["plan"]["pairs"] == 4
    assert doc["info"]["planned_samples"] == 12800 and doc["info"]["used_s"] == 30.0
    assert yaml.safe_load((run / "tuned.yaml").read_text()) == result.config.to_dict()
    out = capsys.readouterr().out
    assert out.startswith(f"tune: removed 1 trial directory left in {tempfile.gettempdir()} by "
                          f"tunes that were killed\nironloop tune: cpu, ")
    assert "were not applied: train.precision=bf16" in out
    assert result.paths == {"tune.json": run / "tune.json", "tuned.yaml": run / "tuned.yaml"}


def test_a_tune_applies_the_trajectory_winners_when_told(fabricated, monkeypatch, capsys):
    monkeypatch.setattr(tune_mod, "clean_stale", lambda: 3)
    result = tune_mod._finish(fabricated, 1000.0, True, None, [])
    assert result.applied_trajectory is True
    assert result.config.train.precision == "bf16" and result.config.run.threads == 1
    out = capsys.readouterr().out
    assert out.startswith("tune: removed 3 trial directories left in ")
    assert "notice: --apply-trajectory-changes: train.precision: 'fp32' -> 'bf16'" in out


def test_a_compile_gets_its_reserve_only_when_the_budget_has_it(fabricated, trial_log, clock):
    _, chosen, _ = tune_mod.run_tune(fabricated, 1000.0, "off")
    deadlines = {tuple(sorted(call[0].items())): call[2] - t for call, t in
                 zip(trial_log.calls, _starts(trial_log))}
    compiled = (("run.threads", 1), ("train.compile", True))
    # the compile's trials: 3 x (1 s + 30 s of reserve) past their start
    assert deadlines[compiled] == 3 * (1.0 + 30.0)
    assert chosen == {"run.threads": 1, "train.compile": True}


def _starts(trial_log):
    """Each logged trial started at the clock's reading before its cost: 1000, 1001, ..."""
    return [1000.0 + i * trial_log.cost for i in range(len(trial_log.calls))]


@pytest.mark.parametrize(("budget", "after", "trials"), [(52.0, 1.0 + 5.0, 1 + 4 * 2),
                                                       (52.25, 31.25, 1)])
def test_a_compile_reserve_is_held_only_beyond_a_trials_share(fabricated, trial_log, clock,
                                                               budget, after, trials):
    # 21 trials of 1 s before the compile's: 31 s left is 30 s of reserve and a trial's 1 s,
    # not more: no reserve, and the compile's trials have a trial's deadline, 1 s + 5 at least;
    # 31.25 s left holds it, and the deadline is the budget's end (with no room for pairs)
    tune_mod.run_tune(fabricated, budget, "off")
    compiled = [call[2] - start for call, start in zip(trial_log.calls, _starts(trial_log))
                if "train.compile" in call[0]]
    pairs = [call for call in trial_log.calls[21:] if "train.compile" not in call[0]]
    assert compiled[0] == after and len(compiled) + len(pairs) == trials


def test_tune_hands_its_objects_to_the_trials_and_never_trains_the_model(monkeypatch):
    seen = {}

    def finish(subj, budget, apply, path, overrides):
        seen.update(subject=subj, args=(budget, apply, path, overrides))
        return "result"

    monkeypatch.setattr(tune_mod, "_finish", finish)
    model = nn.Linear(4, 2)
    loss, step, optimizer, scheduler = object(), object(), object(), object()
    x, y = data(32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    assert tune_mod.tune(model, loader, {"train.epochs": 2}, loss_fn=loss, step_fn=step,
                         num_classes=2, optimizer=optimizer, scheduler=scheduler, budget=30.0,
                         apply_trajectory_changes=True) == "result"
    subj = seen["subject"]
    assert seen["args"] == (30.0, True, None, [])
    assert subj.cfg.train.batch_size == 16 and subj.cfg.train.epochs == 2  # as fit() does
    assert subj.train is loader
    assert subj.fit_kwargs == {"loss_fn": loss, "step_fn": step, "num_classes": 2,
                               "optimizer": optimizer, "scheduler": scheduler}
    copy = subj.make_model()
    assert copy is not model and subj.make_model() is not copy
    with torch.no_grad():
        model.weight.fill_(7.0)  # the user's model after tune(): the trials' copies are of before
    assert not torch.equal(subj.make_model().weight, model.weight)
    tune_mod.tune(model, (x, y))
    assert seen["subject"].cfg.train.batch_size == Config().train.batch_size
    assert seen["args"] == (tune_mod.DEFAULT_BUDGET, False, None, [])
    sampled = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=None)
    tune_mod.tune(model, sampled, {"train.batch_size": 8})
    assert seen["subject"].cfg.train.batch_size == 8


def test_tune_refuses_a_scheduler_instance():
    # an instance, not built: a real optimizer's first construction imports torch._dynamo
    instance = torch.optim.lr_scheduler.StepLR.__new__(torch.optim.lr_scheduler.StepLR)
    with pytest.raises(UserError) as raised:
        tune_mod.tune(nn.Linear(4, 2), data(8), scheduler=instance)
    assert str(raised.value) == ("tune: pass scheduler as a factory (e.g. lambda params: "
                                 "torch.optim.AdamW(params)), not an instance: every trial trains "
                                 "its own copy of the model")


def test_tune_config_tunes_the_configs_data_and_model(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  name: synthetic\n  num_samples: 40\n  input_shape: [4]\n"
                    "  num_classes: 3\nmodel:\n  name: mlp\n")
    seen = {}
    monkeypatch.setattr(tune_mod, "_finish", lambda subj, *args: seen.update(
        subject=subj, args=args) or "result")
    assert tune_mod.tune_config(str(path), ["train.epochs=2"], 15.0, True) == "result"
    subj = seen["subject"]
    assert seen["args"] == (15.0, True, path, ["train.epochs=2"])
    assert subj.cfg.train.epochs == 2 and subj.samples == 32  # 20% held out for validation
    assert subj.fit_kwargs == {"num_classes": 3, "from_config": True}
    assert isinstance(subj.make_model(), nn.Module)
    tune_mod.tune_config(str(path), [])
    assert seen["args"] == (tune_mod.DEFAULT_BUDGET, False, path, [])
