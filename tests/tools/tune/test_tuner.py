"""tools.tune's tuner, in process, on fabricated measurements and a fake clock: which trial wins,
the pairs and the screen, the plans, the rows' verdicts and the budget. No trial trains here:
run_trial is replaced by fakes that stamp a clock the test controls."""

from __future__ import annotations

import math
import types

import pytest
import torch

from ironloop.config import Config
from ironloop.errors import ConfigError, UserError
from ironloop.tools import tune as tune_mod
from ironloop.tools.tune import output, rows as tune_rows, tuner as tuner_mod
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Measure, Plan, TrialFailed
from tests.tools.tune.helpers import Bar, data, mk, subject


def measure(median: float, lo: float, hi: float) -> Measure:
    return Measure(samples_per_s=median, spread=(lo, hi), windows=[lo, median, hi],
                   step_ms=1.0, extra_s=0.0, seconds=1.0)


# -- the decisions --------------------------------------------------------------------------------


def test_a_winner_is_faster_in_every_pair_beyond_the_noise():
    assert tuner_mod.paired([1.9, 1.4, 2.3, 1.7]).wins
    verdict = tuner_mod.paired([1.3, 1.25, 1.4, 1.35])
    assert verdict.wins and verdict.median == pytest.approx(1.325)
    assert verdict.spread == (1.25, 1.4)
    # one pair that says slower: one recheck that happened to be low no longer decides,
    # but neither does one lucky pair
    assert not tuner_mod.paired([1.9, 0.97, 2.3, 1.7]).wins
    assert "1 of 4 pairs not faster" in tuner_mod.paired([1.9, 0.97, 2.3, 1.7]).why
    assert not tuner_mod.paired([3.0, 2.5]).wins  # the budget ran out: 2 of 4 pairs
    assert not tuner_mod.paired([1.03, 1.04, 1.02, 1.06]).wins  # agree, but within 5%
    assert not tuner_mod.paired([]).wins


def test_pairs_are_interleaved_and_stop_at_the_first_that_disagrees():
    """The A/B order of the paired runs, and the ratio each pair gives (the config's projected
    time over the setting's), on measurements fed in."""
    order, rates = [], iter([100, 180, 190, 100, 100, 95, 100, 200])
    tuner = tuner_mod.Tuner.__new__(tuner_mod.Tuner)
    tuner.est_s, tuner.left = 0.0, lambda: 1e9
    tuner.projected = lambda m, overrides: 1000 / m.samples_per_s

    def fake(overrides, extra_s=0.0):
        order.append("B" if overrides.get("data.num_workers") else "A")
        return measure(next(rates), 0, 0)

    tuner.measure = fake
    verdict = tuner._pairs({}, {"data.num_workers": 2}, 0.0)
    assert order == ["A", "B", "B", "A", "A", "B"]  # A B, B A, A B: stopped at the slower pair
    assert verdict.ratios == pytest.approx([1.8, 1.9, 0.95]) and not verdict.wins


def test_a_setting_that_beats_the_first_winner_in_pairs_replaces_it():
    """The screen is one measurement each: here the load made 2 workers look slower than the
    threads alone. The threads win their pairs against the config, then the workers win theirs
    against the threads: the workers (with the threads) are chosen, at the product of the two
    medians. Measurements are fed in by config."""
    import types

    speed = {(): 100.0, (("run.threads", 1),): 150.0,
             (("data.num_workers", 2), ("run.threads", 1)): 250.0}
    screened: set = set()

    def fake(overrides, extra_s=0.0):
        key = tuple(sorted(overrides.items()))
        first = key not in screened
        screened.add(key)
        return measure(120.0 if first and len(key) == 2 else speed[key], 0, 0)

    tuner = tuner_mod.Tuner.__new__(tuner_mod.Tuner)
    tuner.est_s, tuner.left, tuner.measure, tuner.rows = 0.0, lambda: 1e9, fake, []
    tuner.projected = lambda m, overrides: 1000 / m.samples_per_s
    tuner.bar = types.SimpleNamespace(set_description=lambda text: None, update=lambda n: None)
    base = tune_rows.Row("baseline", {}, status="ok", measure=measure(100.0, 0, 0),
                         projected_s=10.0)
    tuner.baseline = base
    threads = tune_rows.Row("run.threads=1", {"run.threads": 1})
    both = tune_rows.Row("data.num_workers=2 run.threads=1",
                         {"data.num_workers": 2, "run.threads": 1})
    winner = tuner.group([threads, both], {}, base)
    assert winner is both and both.won and not threads.won
    assert both.gain == pytest.approx(1.5 * 250 / 150)
    assert both.pairs["against"] == {"run.threads": 1} and "beat it" in threads.verdict


def test_the_screen_leaves_a_contender_the_budget_of_its_pairs():
    """On an H200, a 60 s tune screened all 13 loader rows and had no time left for a single
    pair: 4 workers at 3.5x the baseline went unconfirmed and nothing was applied. Once a row
    screens faster, the screen stops where the budget left would no longer hold that row's
    pairs. Every trial here costs one 'second' of a simulated budget of 12."""
    import types

    speed = {(): 100.0, (("data.num_workers", 1),): 95.0, (("data.num_workers", 2),): 170.0,
             (("data.num_workers", 4),): 350.0, (("data.num_workers", 8),): 390.0,
             (("data.num_workers", 16),): 380.0}
    clock = {"spent": 0.0}

    def fake(overrides, extra_s=0.0):
        clock["spent"] += 1.0
        return measure(speed[tuple(sorted(overrides.items()))], 0, 0)

    tuner = tuner_mod.Tuner.__new__(tuner_mod.Tuner)
    tuner.est_s, tuner.measure, tuner.rows = 1.0, fake, []
    tuner.left = lambda: 12.0 - clock["spent"]
    tuner.projected = lambda m, overrides: 1000 / m.samples_per_s
    tuner.bar = types.SimpleNamespace(set_description=lambda text: None, update=lambda n: None)
    base = tune_rows.Row("baseline", {}, status="ok", measure=measure(100.0, 0, 0),
                         projected_s=10.0)
    tuner.baseline = base
    rows = [tune_rows.Row(f"data.num_workers={n}", {"data.num_workers": n})
            for n in (1, 2, 4, 8, 16)]
    winner = tuner.group(rows, {}, base)
    # without the hold: 5 screens, then 3 pairs where a winner needs 4, and no winner
    assert winner is not None and winner.won and winner.setting == "data.num_workers=8"
    assert winner.pairs["ratios"] == pytest.approx([3.9] * 4)
    skipped = [r for r in rows if r.status == "skipped"]
    assert [r.setting for r in skipped] == ["data.num_workers=16"]
    assert "held for the paired runs" in skipped[0].reason


def test_when_the_budget_ends_the_pairs_the_last_line_says_so_not_no_faster_setting():
    """A contender faster in every pair measured, but fewer than PAIRS of them, is not applied;
    the table's last line says the budget ended its pairs and to raise --budget, instead of
    "no setting was faster" (which an H200's 3.9x num_workers was called)."""
    import types


    base = tune_rows.Row("baseline", {}, status="ok", measure=measure(100.0, 90, 110),
                         projected_s=100.0)
    cut = tune_rows.Row("data.num_workers=8", {"data.num_workers": 8}, status="ok",
                        measure=measure(390.0, 380, 400), projected_s=25.0,
                        pairs={"ratios": [3.8, 3.9], "wins": False})
    lost = tune_rows.Row("run.threads=1", {"run.threads": 1}, status="ok",
                         measure=measure(101.0, 90, 110), projected_s=99.0,
                         pairs={"ratios": [1.02, 0.97], "wins": False})
    base.measure.peak_mb = 512.0
    base.ratio, cut.ratio, lost.ratio = 1.0, 3.9, 1.01
    info = {"config": "c.yaml", "device": "cuda:0", "cpus": 16, "load_average": [1.0] * 3,
            "budget_s": 60, "used_s": 59, "tokens_per_sample": None, "max_steps": None,
            "planned_samples": 1000, "epochs": 1, "train_samples": 1000,
            "plan": {"pairs": tuner_mod.PAIRS}}
    result = types.SimpleNamespace(info=info, baseline=base, rows=[cut, lost], chosen={},
                                   speedup=1.0)
    last = output.table(result).splitlines()[-1]
    assert "the budget ran out during the paired runs of data.num_workers=8" in last
    assert "run.threads=1" not in last and "--budget" in last
    cut.pairs = {"ratios": [3.8, 3.9, 3.7, 4.0], "wins": False}  # all four ran: not the budget
    assert output.table(result).splitlines()[-1].startswith("no trajectory-free setting")


def test_a_row_after_a_winner_is_judged_against_the_winner_and_says_so():
    """The table's "x base" is against the baseline, the screen's verdict against the best so
    far: a bf16 row at 1.9x the baseline beside a 1.9x winner is "within noise of" that winner,
    never a bare "within noise" that reads as no gain at all."""
    base = tune_rows.Row("baseline", {}, status="ok", measure=measure(100.0, 0, 0))
    workers = tune_rows.Row("data.num_workers=2", {"data.num_workers": 2}, status="ok",
                            measure=measure(190.0, 0, 0))
    bf16 = tune_rows.Row("train.precision=bf16", {"train.precision": "bf16"}, status="ok",
                         measure=measure(188.0, 0, 0))
    for row, seconds in ((base, 19.0), (workers, 10.0), (bf16, 10.1)):
        row.projected_s = seconds
    assert tuner_mod._verdict(bf16, base) == "faster"
    assert tuner_mod._verdict(bf16, workers) == "within noise of data.num_workers=2"
    assert tuner_mod._verdict(base, workers) == "slower than data.num_workers=2"
    assert tuner_mod._verdict(workers, bf16) == "within noise of train.precision=bf16"


# -- the decisions (__init__.py) ------------------------------------------------------------------


def test_a_setting_wins_only_faster_in_every_pair_and_beyond_the_noise():
    assert (tuner_mod.NOISE, tuner_mod.PAIRS, tuner_mod.CONFIRMS) == (0.05, 4, 3)
    won = tuner_mod.paired([1.9, 1.4, 2.3, 1.7])
    assert (won.wins, won.spread, won.why) == (True, (1.4, 2.3), "4 of 4 pairs faster")
    assert won.median == pytest.approx(1.8)
    assert won.ratios == [1.9, 1.4, 2.3, 1.7]
    tie = tuner_mod.paired([1.0, 2.0, 2.0, 2.0])  # a pair that is no faster says slower
    assert (tie.wins, tie.why) == (False, "1 of 4 pairs not faster")
    assert tuner_mod.paired([0.5, 0.9, 2.0, 2.0]).why == "2 of 4 pairs not faster"
    assert tuner_mod.paired([2.0, 2.0, 2.0]).why == "3 of 4 pairs measured"
    at = tuner_mod.paired([1.05] * 4)  # the median must be more than 5% faster
    assert (at.wins, at.why) == (False, "median 1.05x is within 5%")
    assert tuner_mod.paired([1.06] * 4).wins
    assert tuner_mod.paired([1.06] * 5).why == "5 of 4 pairs faster"
    none = tuner_mod.paired([])
    assert (none.wins, none.median, none.spread, none.why) == (False, 1.0, (1.0, 1.0),
                                                               "0 of 4 pairs measured")
    assert tuner_mod.paired([1.2, 1.2], pairs=2).why == "2 of 2 pairs faster"
    assert tuner_mod.paired([1.2] * 4, margin=0.25).why == "median 1.20x is within 25%"
    assert tuner_mod.Paired([1.234567], True, 1.234567, (1.00004, 1.3), "w").to_dict() == {
        "ratios": [1.2346], "median": 1.2346, "spread": [1.0, 1.3], "wins": True, "why": "w"}


def test_planned_samples_are_the_runs_epochs_or_its_max_steps():
    def planned(n=100, **train):
        return tuner_mod.planned_samples(Config.from_dict({"train": train}), n)

    assert planned(epochs=3, batch_size=32) == 300
    assert planned(epochs=3, batch_size=32, max_steps=5) == 100 + 32  # 4 steps an epoch
    assert planned(epochs=3, batch_size=32, max_steps=100) == 300
    assert planned(epochs=2, batch_size=32, accumulation_steps=2, max_steps=3) == 100 + 64
    assert planned(epochs=2, batch_size=25, max_steps=8) == 200  # no ragged step
    assert planned(epochs=1, batch_size=200) == 100


def test_a_plan_fills_the_trials_seconds_at_the_probes_speed():
    assert tuner_mod.plan_for(0.5, 15.0) == Plan(3, 5, 5, measure_s=12.5)  # 30 steps
    assert tuner_mod.plan_for(0.5, 14.5) == Plan(1, 5, 5, measure_s=12.5)  # 29
    assert tuner_mod.plan_for(0.5, 5.0) == Plan(1, 1, 5, measure_s=2.5)  # 10
    assert tuner_mod.plan_for(0.5, 4.5) == Plan(1, 4, 2, measure_s=4.0)  # 9
    assert tuner_mod.plan_for(0.5, 0.5) == Plan(1, 1, 2, measure_s=1.0)  # 3 at least
    assert tuner_mod.plan_for(0.0, 1.0).window == 199_999  # a step of 1 us at least


def _tuner(cfg=None, budget=100.0, n=64) -> tuner_mod.Tuner:
    return tuner_mod.Tuner(subject(cfg or {"train": {"batch_size": 8, "epochs": 2}},
                                  train=data(n)), budget, Bar())


def test_a_new_tuner_has_the_budget_ahead_and_the_runs_length(clock):
    tuner = _tuner({"train": {"batch_size": 8, "epochs": 3, "max_steps": 10}})
    assert (tuner.started, tuner.deadline, tuner.left()) == (1000.0, 1100.0, 100.0)
    assert (tuner.plan, tuner.est_s, tuner.rows, tuner.baseline) == (Plan(1, 1, 2), 0.0, [], None)
    assert (tuner.samples, tuner.epochs) == (64 + 2 * 8, 2)  # 10 steps: 1 epoch and 2 steps
    assert tuner_mod.Tuner.pairs == 4
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


def _measured_tuner(clock, est_s=4.0, budget=100.0) -> tuner_mod.Tuner:
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
    tuner2._pairs = lambda a, b, extra_s: tuner_mod.paired([2.0] * 4)
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
    assert tuner._pairs({}, {"run.threads": 1}, 0.0) == tuner_mod.Paired(
        [2.0], False, 1.0, (1.0, 1.0), "a paired trial failed: RuntimeError: oom")
    answers = iter([mk(100.0)] * 8)  # as fast as the config: no faster, so no more pairs
    verdict = tuner._pairs({}, {"run.threads": 1}, 0.0)
    assert verdict.ratios == [1.0] and verdict.why == "1 of 1 pairs not faster"
    assert len(list(answers)) == 6


def test_the_screens_verdicts_and_a_compile_that_does_not_pay():
    def row(overrides, sps, run_s):
        return Row("x", overrides, status="ok", measure=mk(sps), projected_s=run_s)

    base = Row("baseline", {}, status="ok", measure=mk(100.0), projected_s=20.0)
    assert tuner_mod._verdict(row({}, 100.0, 18.99), base) == "faster"
    assert tuner_mod._verdict(row({}, 100.0, 19.0), base) == "within noise"  # 5% exactly
    assert tuner_mod._verdict(row({}, 100.0, 21.0), base) == "within noise"  # 21 x 0.95 < 20
    assert tuner_mod._verdict(row({}, 100.0, 21.1), base) == "slower"
    compiled = row({"train.compile": True}, 150.0, 40.0)
    assert tuner_mod._verdict(compiled, base) == ("faster steps, but the compile does not pay for "
                                                 "itself in this run")
    assert tuner_mod._verdict(row({"train.compile": True}, 100.0, 40.0), base) == "slower"
    assert tuner_mod._verdict(row({"train.compile": False}, 150.0, 40.0), base) == "slower"
    assert tuner_mod._verdict(row({"run.threads": 1}, 150.0, 40.0), base) == "slower"
    assert tuner_mod._ratios([]) == "no pairs"
    assert tuner_mod._ratios([1.234, 0.5]) == "ratios 1.23, 0.50"
    assert tuner_mod._name(None, "the config") == "the config" and tuner_mod._name(base, "") == \
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
