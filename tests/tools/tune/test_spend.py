"""tools.tune's budget decisions (spend.py and the tuner that wires them), on fabricated
measurements and a fake clock: what a clear screen keeps on, what a row is estimated to cost,
what the combination's pairs decide, and which group goes first. No trial trains here."""

from __future__ import annotations

import pytest
import torch

from ironloop.config import Config
from ironloop.tools import tune as tune_mod
from ironloop.tools.tune import rows, spend, tuner as tuner_mod
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Subject
from tests.tools.tune.helpers import Bar, Reads, mk


def _tuner(clock, budget: float = 200.0, est_s: float = 1.0) -> tuner_mod.Tuner:
    """A tuner whose baseline ran at 100 samples/s."""
    subj = Subject(Config.from_dict({"train": {"batch_size": 8}}), lambda: torch.nn.Linear(4, 2),
                   Reads(), {})
    tuner = tuner_mod.Tuner(subj, budget, Bar())
    tuner.baseline = Row("baseline", {}, status="ok", measure=mk(100.0),
                         projected_s=tuner.samples / 100.0)
    tuner.est_s = est_s
    return tuner


def _speed(overrides: dict) -> float:
    """Two workers triple the speed (one: 1.5x), pinned memory doubles it on top; the two
    interact with nothing else."""
    return 100.0 * {0: 1, 1: 1.5}.get(overrides.get("data.num_workers", 0), 3) \
        * (2 if overrides.get("data.pin_memory") else 1)


def test_a_clearly_faster_screen_stays_on_for_the_next_screen_without_pairs(clock, trial_log):
    tuner = _tuner(clock)
    trial_log.answer = lambda o: mk(_speed(o))
    base = tuner.baseline
    workers = Row("data.num_workers=2", {"data.num_workers": 2})
    kept = tuner.group([workers], {}, base, keep=True)
    assert kept is workers and workers.kept and not workers.won
    assert len(trial_log.calls) == 1  # the screen only: its pairs wait for the combination
    assert workers.verdict.startswith("kept on for the next screens (screened 3.00x")
    assert tuner.reserved == spend.confirm_cost(1.0, tuner_mod.PAIRS)
    # the same screen without keep goes to its pairs, as every trajectory group does
    again = Row("data.num_workers=2", {"data.num_workers": 2})
    assert tuner.group([again], {}, base) is again and again.won and not again.kept
    assert len(trial_log.calls) == 2 + 2 * tuner_mod.PAIRS


def test_a_screen_only_just_faster_is_not_kept_but_paired(clock, trial_log):
    tuner = _tuner(clock)
    trial_log.answer = lambda o: mk(115.0 if o else 100.0)  # 15%: beyond NOISE, not CLEAR
    row = Row("run.threads=1", {"run.threads": 1})
    assert tuner.group([row], {}, tuner.baseline, keep=True) is row
    assert row.won and not row.kept and len(trial_log.calls) == 1 + 2 * tuner_mod.PAIRS


def test_a_screen_whose_windows_overlap_the_best_is_not_clear():
    best = Row("b", {}, status="ok", measure=mk(100.0, spread=(90.0, 130.0)), projected_s=10.0)
    fast = Row("f", {}, status="ok", measure=mk(150.0, spread=(120.0, 160.0)), projected_s=6.0)
    assert not spend.clearly_faster(fast, best)
    fast.measure = mk(150.0, spread=(135.0, 160.0))
    assert spend.clearly_faster(fast, best)
    fast.projected_s = 8.5  # windows clear, but only 15% faster over the run
    assert not spend.clearly_faster(fast, best)


def test_the_next_screen_runs_on_top_of_a_kept_setting(clock, trial_log, monkeypatch):
    """The whole tune: workers screen clearly faster and stay on, pinned memory is screened on
    top of them (CUDA faked), and the pair of them is confirmed once, at the end."""
    monkeypatch.setattr(tune_mod, "resolve_device", lambda _: torch.device("cuda"))
    monkeypatch.setattr(rows, "pin_rows", lambda s, d: [Row("data.pin_memory=true",
                                                            {"data.pin_memory": True})])
    monkeypatch.setattr(spend, "pin_rows", rows.pin_rows)
    for name in ("precision_rows", "cuda_graph_rows"):
        monkeypatch.setattr(spend, name, lambda s, d: [])
    monkeypatch.setattr(tuner_mod.Tuner, "largest_fit", lambda self, cur, dev: None)
    monkeypatch.setattr(rows, "cpus", lambda: 2)
    trial_log.answer = lambda o: mk(_speed(o))
    # run.threads pinned: torch's own count depends on the machine and on what an earlier test
    # set, and a workers row with fewer threads would tie with the workers alone (_speed ignores
    # threads)
    subj = Subject(Config.from_dict({"train": {"batch_size": 8}, "log": {"progress": "off"},
                                     "run": {"threads": 1}}),
                   lambda: torch.nn.Linear(4, 2), Reads(), {})
    tuner, chosen, _ = tune_mod.run_tune(subj, 200.0, "off")
    pin = next(r for r in tuner.rows if r.setting == "data.pin_memory=true")
    assert pin.base == {"data.num_workers": 2} and pin.kept  # screened with the workers on
    assert chosen == {"data.num_workers": 2, "data.pin_memory": True}
    both = {"data.num_workers": 2, "data.pin_memory": True}
    # the last trials: the combination against the config, A B, B A, A B, B A
    assert [c[0] for c in trial_log.calls[-8:]] == [{}, both, both, {}] * 2
    assert tuner_mod.math.prod(r.gain for r in tuner.rows if r.won) == pytest.approx(6.0)


def test_a_combination_is_applied_only_after_it_wins_its_pairs(clock, trial_log):
    tuner = _tuner(clock)
    workers = Row("data.num_workers=2", {"data.num_workers": 2}, kept=True, gain=3.0)
    pin = Row("data.pin_memory=true", {"data.pin_memory": True}, kept=True, gain=2.0)
    tuner.rows += [workers, pin]
    # the screens were lucky: in the pairs, pinned memory makes the workers slower than the
    # config itself
    trial_log.answer = lambda o: mk(90.0 if o.get("data.pin_memory") else
                                    300.0 if o.get("data.num_workers") else 100.0)
    assert tuner.confirm({}, [workers, pin]) == {"data.num_workers": 2}
    assert not pin.won and not pin.kept and "not faster in the paired runs" in pin.verdict
    assert workers.won and workers.gain == pytest.approx(3.0)
    # nothing is applied when the budget leaves no room for the pairs
    late = _tuner(clock, budget=1.0)
    kept = Row("data.num_workers=2", {"data.num_workers": 2}, kept=True, gain=3.0)
    assert late.confirm({}, [kept]) == {} and not kept.won


def test_a_row_whose_estimate_exceeds_what_is_left_is_skipped_and_cheaper_ones_still_run(
        clock, trial_log):
    tuner = _tuner(clock, budget=20.0, est_s=4.0)
    compiled, threads = Row("train.compile=true", {"train.compile": True}), \
        Row("run.threads=1", {"run.threads": 1})
    tuner.run_row(compiled, {}, extra_s=30.0)  # estimated before it starts: 4 + 30 s
    tuner.run_row(threads, {})
    assert (compiled.status, compiled.est_s) == ("skipped", 34.0)
    assert compiled.reason == "budget: needs ~34 s, 20 s left"
    assert (threads.status, threads.est_s) == ("ok", 4.0) and len(trial_log.calls) == 1
    # what is held for the kept settings' pairs is not there to spend
    tuner.reserved = 16.0
    held = Row("run.threads=2", {"run.threads": 2})
    tuner.run_row(held, {})
    assert held.status == "skipped" and "16 s of them held for the paired runs" in held.reason


def _groups() -> list[spend.Group]:
    return [spend.Group("loader", (), parts=("data",), factor=8.0),
            spend.Group("pin", (), parts=("copy",), factor=2.0),
            spend.Group("precision", (), kind="trajectory", parts=("forward", "backward"),
                        factor=2.0)]


@pytest.mark.parametrize(("split", "first"), [
    ({"data": 8.0, "copy": 0.5, "forward": 1.0, "backward": 0.5}, ["loader", "precision", "pin"]),
    ({"data": 0.1, "copy": 3.0, "forward": 0.5, "backward": 0.5}, ["pin", "precision", "loader"]),
    ({"data": 0.1, "copy": 0.1, "forward": 5.0, "backward": 4.0}, ["precision", "loader", "pin"]),
    (None, ["loader", "pin", "precision"]),  # no time split: the order given
])
def test_the_groups_go_by_expected_gain(split, first):
    assert [g.name for g in spend.order(_groups(), split)] == first


def test_expected_gain_is_amdahls_bound():
    split = {"data": 3.0, "forward": 1.0}
    assert spend.expected_gain(split, ("data",), 3.0) == pytest.approx(1 / (0.25 + 0.75 / 3))
    assert spend.expected_gain(split, ("copy",), 2.0) == 1.0
    assert spend.expected_gain({}, ("data",), 8.0) == 1.0


def test_a_confirmed_gain_is_shared_by_the_kept_rows_in_proportion_to_their_screens():
    a, b = Row("a", {}), Row("b", {})
    shares = spend.apportion([a, b], [3.0, 2.0], 5.0)
    assert shares[0] * shares[1] == pytest.approx(5.0) and shares[0] > shares[1]
    assert spend.apportion([a], [3.0], 2.5) == [2.5]
