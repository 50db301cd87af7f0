"""ironloop tune: the decisions (pure, on measurements fed in), and real tunes on this machine.

The real tunes assert what tune decides, never a time. The loader-bound dataset sleeps per
sample: an I/O-like latency (disk, network) that worker processes overlap whatever the
machine's load, which busy-looping work would not on 2 shared cores (that case is a benchmark:
examples/cpu_reads.yaml, BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import ironloop
from examples.slow_reads import SlowReads
from ironloop.config import Config
from ironloop.outputs.time_split import RunSettings, advice
from ironloop.tools import tune as tune_mod
from ironloop.tools.tune import rows as tune_rows
from ironloop.tools.tune.output import tuned_yaml
from ironloop.tools.tune.trials import Measure, samples_in_step, window_rates
from tests.conftest import REPO

# measured speed or timed signals: never beside the other (tests/conftest.py cpu_alone)
pytestmark = pytest.mark.usefixtures("cpu_alone")


def measure(median: float, lo: float, hi: float) -> Measure:
    return Measure(samples_per_s=median, spread=(lo, hi), windows=[lo, median, hi],
                   step_ms=1.0, extra_s=0.0, seconds=1.0)


# -- the decisions --------------------------------------------------------------------------------


def test_a_winner_is_faster_in_every_pair_beyond_the_noise():
    assert tune_mod.paired([1.9, 1.4, 2.3, 1.7]).wins
    verdict = tune_mod.paired([1.3, 1.25, 1.4, 1.35])
    assert verdict.wins and verdict.median == pytest.approx(1.325)
    assert verdict.spread == (1.25, 1.4)
    # one pair that says slower: one recheck that happened to be low no longer decides,
    # but neither does one lucky pair
    assert not tune_mod.paired([1.9, 0.97, 2.3, 1.7]).wins
    assert "1 of 4 pairs not faster" in tune_mod.paired([1.9, 0.97, 2.3, 1.7]).why
    assert not tune_mod.paired([3.0, 2.5]).wins  # the budget ran out: 2 of 4 pairs
    assert not tune_mod.paired([1.03, 1.04, 1.02, 1.06]).wins  # agree, but within 5%
    assert not tune_mod.paired([]).wins


def test_pairs_are_interleaved_and_stop_at_the_first_that_disagrees():
    """The A/B order of the paired runs, and the ratio each pair gives (the config's projected
    time over the setting's), on measurements fed in."""
    order, rates = [], iter([100, 180, 190, 100, 100, 95, 100, 200])
    tuner = tune_mod.Tuner.__new__(tune_mod.Tuner)
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

    tuner = tune_mod.Tuner.__new__(tune_mod.Tuner)
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

    tuner = tune_mod.Tuner.__new__(tune_mod.Tuner)
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

    from ironloop.tools.tune import output

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
            "plan": {"pairs": tune_mod.PAIRS}}
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
    assert tune_mod._verdict(bf16, base) == "faster"
    assert tune_mod._verdict(bf16, workers) == "within noise of data.num_workers=2"
    assert tune_mod._verdict(base, workers) == "slower than data.num_workers=2"
    assert tune_mod._verdict(workers, bf16) == "within noise of train.precision=bf16"


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


def test_a_trial_is_measured_in_seconds_of_work_not_a_count_of_steps():
    from ironloop.tools.tune.trials import Plan, windows

    plan = tune_mod.plan_for(step_s=0.1, seconds=2.0)  # the baseline: 20 steps of 0.1 s
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
    assert tune_mod.planned_samples(Config().with_overrides({"train.epochs": 3,
                                                             "train.batch_size": 32}), 100) == 300
    capped = Config().with_overrides({"train.max_steps": 5, "train.batch_size": 32})
    assert tune_mod.planned_samples(capped, 100) == 100 + 32


def test_a_slow_early_step_and_the_buffer_it_fills_are_warm_up():
    from ironloop.tools.tune.trials import Plan, settled

    plan = Plan(warmup=1, window=2, repeats=4)
    steady = [0.1] * 9
    stamps = list(itertools.accumulate([2.0, *steady]))  # step 1: a 2 s compile
    assert settled(stamps, 0.0, plan, depth=4) == 1 + 4  # and 4 buffered batches after it
    assert settled(list(itertools.accumulate([0.1] * 10)), 0.0, plan, depth=4) == 1
    assert settled(stamps, 0.0, plan, depth=8) == 1  # it would leave under two windows


def test_tuned_yaml_is_the_input_when_nothing_changes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# my comment\ntrain:\n  epochs: 3\ndata:\n  name: synthetic\n")
    cfg = ironloop.load_config(path)
    assert tuned_yaml(cfg, path, [], {}) == path.read_text()
    text = tuned_yaml(cfg.with_overrides(["train.batch_size=16"]), path,
                      ["train.batch_size=16"], {"data.num_workers": 2})
    back = Config.from_dict(yaml.safe_load(text))
    assert back.data.num_workers == 2 and back.train.batch_size == 16 and back.train.epochs == 3


def test_tune_arguments_mix_like_train_s():
    from ironloop.cli import parser, train_argv

    argv = train_argv(["--budget", "30", "c.yaml", "train.epochs=3", "--apply-trajectory-changes",
                       "data.num_workers=1"], valued=("--budget",))
    args = parser().parse_args(["tune", *argv])
    assert (args.config, args.overrides, args.budget, args.apply_trajectory_changes) == \
        ("c.yaml", ["train.epochs=3", "data.num_workers=1"], 30.0, True)


def test_a_budget_of_zero_is_refused(tmp_path):
    with pytest.raises(ironloop.errors.ConfigError,
                       match="--budget=0: must be a finite number of seconds > 0"):
        ironloop.tune(nn.Linear(4, 2), (torch.randn(8, 4), torch.zeros(8, dtype=torch.long)),
                      {"run.dir": str(tmp_path / "run")}, budget=0)
    assert not (tmp_path / "run").exists()


def test_an_optimizer_instance_is_refused_before_any_trial(tmp_path):
    model = nn.Linear(4, 2)
    with pytest.raises(ironloop.errors.UserError, match="pass optimizer as a factory"):
        ironloop.tune(model, (torch.randn(8, 4), torch.zeros(8, dtype=torch.long)),
                      {"run.dir": str(tmp_path / "run")},
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert not (tmp_path / "run").exists()


def test_data_wait_advice_names_ironloop_tune(monkeypatch):
    monkeypatch.setattr("sys.argv", ["ironloop", "train", "configs/x.yaml", "--overwrite",
                                     "train.epochs=3"])
    slow = {"data": 1.0, "copy": 0.01, "forward": 1, "backward": 1, "optimizer": 0.3,
            "checkpoint": 0.0, "validation": 0.0, "other": 0.01}
    run = RunSettings(cores=2)
    lines = advice(slow, run)
    assert any("ironloop tune configs/x.yaml train.epochs=3" in a for a in lines), lines
    assert not any("ironloop tune" in a for a in advice({**slow, "data": 0.01}, run))


# -- real tunes -------------------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """One intra-op thread: on 2 shared cores, a second one spin-waits for a busy core, which
    adds tens of milliseconds to a tiny model's step at random."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_loader_bound_tune_picks_two_workers_and_the_threads_that_go_with_them(tmp_path, capsys,
                                                                              one_thread):
    """10 ms a read, 8 reads a step: two workers halve the wait whatever the machine's load (a
    sleep needs no core), a gain the paired runs find every time. Whether the tuned config
    then trains faster is a figure, measured by benchmarks/tune_speedup.py (BENCHMARKS.md),
    not asserted here."""
    data = SlowReads(n=160, delay=0.01)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = {"run.dir": str(tmp_path / "run"), "train.epochs": 2, "train.batch_size": 8,
              "log.progress": "off"}
    result = ironloop.tune(model, data, config, budget=40)
    out = capsys.readouterr().out
    workers = result.chosen.get("data.num_workers", 0)
    assert workers >= 2, out
    # the threads that go with them leave the workers their cores (on 2 cores: one, as now)
    assert result.chosen.get("run.threads", 1) <= max(1, tune_rows.cpus() - workers), out
    (won,) = [r for r in result.rows if r.won and r.kind == "free"]
    assert won.pairs and len(won.pairs["ratios"]) == tune_mod.PAIRS, won.pairs
    assert all(r > 1 for r in won.pairs["ratios"])
    assert result.speedup == pytest.approx(won.pairs["median"], rel=1e-3)
    assert "x base" in out and "run time at 2 epochs" in out and "chosen (paired against" in out
    doc = json.loads((tmp_path / "run/tune.json").read_text())
    assert doc["chosen"] == result.chosen and doc["speedup"] == pytest.approx(result.speedup,
                                                                               rel=1e-3)
    tuned = Config.from_dict(yaml.safe_load((tmp_path / "run/tuned.yaml").read_text()))
    assert tuned.data.num_workers == result.chosen["data.num_workers"]
    assert not (tmp_path / "run/checkpoints").exists()  # trials wrote elsewhere


SUBJECTS = textwrap.dedent('''
    import os
    import torch
    from torch import nn


    class Rows(torch.utils.data.Dataset):
        """Cheap reads; with crash=True a read inside a DataLoader worker kills the worker."""

        def __init__(self, n, crash=False):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 256, generator=g)
            self.y = torch.randint(0, 10, (n,), generator=g)
            self.crash = crash

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            if self.crash and torch.utils.data.get_worker_info() is not None:
                os._exit(3)  # a dataset that is not fork-safe, say
            return self.x[i], self.y[i]


    def data(root, n=512, crash=False):
        return Rows(n, crash), Rows(64, crash)


    def narrow():
        """Compute-bound, and no setting can speed it up: many small ops, too small to split
        over a second intra-op thread (it only adds synchronisation: on a busy machine it is
        far slower), fed by cheap reads that workers only slow down with their copies."""
        layers = [nn.Linear(256, 32), nn.ReLU()]
        for _ in range(12):
            layers += [nn.Linear(32, 32), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(32, 10))


    def small():
        return nn.Sequential(nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 10))
''')


def _cli_subject(tmp_path, extra: str = "") -> str:
    (tmp_path / "tune_subjects.py").write_text(SUBJECTS)
    (tmp_path / "c.yaml").write_text(textwrap.dedent(f"""\
        # a compute-bound run
        run: {{dir: run}}
        data: {{name: "tune_subjects:data"{extra}}}
        model: {{name: "tune_subjects:narrow"}}
        train: {{epochs: 2, batch_size: 64}}
        log: {{progress: "off"}}
    """))
    return "c.yaml"


def _env():
    """The package under test, and one intra-op thread (see ``one_thread``)."""
    return {"PYTHONPATH": os.pathsep.join([str(tune_mod.Path(ironloop.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


@pytest.fixture
def tune_cli(tmp_path, monkeypatch, capsys, one_thread):
    """``ironloop tune ARGS`` from tmp_path, run by the CLI's main in this process with one
    intra-op thread (what _env gives a subprocess), tmp_path's modules importable as from its
    directory: the same tune without an interpreter's and torch's start-up (issue 45). Returns
    (exit code, stdout, stderr)."""
    from ironloop.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = ("tune_subjects", "lm_subject")  # tmp_path's, written by each test anew

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["tune", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    for name in modules:
        sys.modules.pop(name, None)


@pytest.mark.slow
def test_compute_bound_tune_reports_no_worthwhile_change(tmp_path, tune_cli):
    config = _cli_subject(tmp_path)
    code, out, err = tune_cli(config, "--budget", "30")
    assert code == 0, err
    assert "no trajectory-free setting was faster beyond the noise" in out, out
    assert (tmp_path / "run/tuned.yaml").read_text() == (tmp_path / config).read_text()
    doc = json.loads((tmp_path / "run/tune.json").read_text())
    assert doc["chosen"] == {} and doc["speedup"] == 1.0
    workers = [t for t in doc["trials"] if t["setting"].startswith("data.num_workers=")]
    assert workers and all(t["status"] == "ok" for t in workers), doc["trials"]


@pytest.mark.slow
def test_a_crashing_trial_is_reported_and_skipped(tmp_path, tune_cli):
    config = _cli_subject(tmp_path, extra=", kwargs: {crash: true, n: 256}")
    # 30 s: once a row screens faster (run.threads=1 may), the screen holds back its pairs'
    # budget, and 10 s left no worker row a trial
    code, out, err = tune_cli(config, "model.name=tune_subjects:small", "--budget", "30")
    assert code == 0, err
    doc = json.loads((tmp_path / "run/tune.json").read_text())
    failed = [t for t in doc["trials"] if t["status"] == "failed"]
    assert failed and all(t["setting"].startswith("data.num_workers=") for t in failed)
    assert all("worker" in t["reason"].lower() for t in failed), failed
    assert "data.num_workers" not in doc["chosen"]
    assert "failed: " in out
    tuned = Config.from_dict(yaml.safe_load((tmp_path / "run/tuned.yaml").read_text()))
    assert tuned.model.name == "tune_subjects:small" and tuned.data.num_workers == 0


class _VirtualClock:
    """The tune's clock (``time.perf_counter`` in tools/tune), advanced only by the model's
    forward passes: what tune measures and decides then does not depend on the machine's speed
    or load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


_CLOCK = _VirtualClock()


class _OverheadPerCall(nn.Module):
    """nn.Linear(8, 3) whose every forward costs the virtual clock 10 ms plus 1 ms a sample:
    per-call overhead is most of a small micro-batch's time (the clock is a module global, not
    an attribute: tune deep-copies the model for every trial)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x):
        _CLOCK.now += 0.01 + 0.001 * len(x)
        return self.linear(x)


@pytest.fixture
def virtual_clock(monkeypatch):
    from ironloop.tools.tune import output, trials

    _CLOCK.now = 0.0
    for module in (tune_mod, trials, output):
        monkeypatch.setattr(module, "time", _CLOCK)
    return _CLOCK


def test_apply_trajectory_changes_puts_the_larger_micro_batch_in(tmp_path, capsys, one_thread,
                                                                 virtual_clock):
    """Micro-batches of 1 whose per-call overhead is nearly all of the step: larger
    micro-batches of the same 32 samples a step are far faster (one of 32: ~8x). The real
    trials run, timed by a virtual clock that only the forward passes advance (on a loaded
    machine a measured gain was blurred into the noise, or the budget ran out before the
    pairs: issue 45), so tune's decision is the same on every machine; 512 samples keep the
    projected run (~11 virtual s) too short for a compile row, and the budget of 30 virtual
    seconds holds every pair (it uses ~24)."""
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(512, 8, generator=g), torch.randint(0, 3, (512,), generator=g))
    config = {"run.dir": str(tmp_path / "run"), "train.epochs": 2, "train.batch_size": 1,
              "train.accumulation_steps": 32, "log.progress": "off"}
    result = ironloop.tune(_OverheadPerCall(), data, config, budget=30,
                           apply_trajectory_changes=True)
    out = capsys.readouterr().out
    assert result.chosen == {}, out  # in-memory tensors: no worker trials, nothing else to win
    assert "train.batch_size" in result.trajectory, out
    batch, accum = result.trajectory["train.batch_size"], result.trajectory[
        "train.accumulation_steps"]
    assert batch > 1 and batch * accum == 32, out
    tuned = Config.from_dict(yaml.safe_load((tmp_path / "run/tuned.yaml").read_text()))
    assert (tuned.train.batch_size, tuned.train.accumulation_steps) == (batch, accum)
    assert "notice: --apply-trajectory-changes: train.batch_size: 1 -> " in out
    assert "same trajectory up to float rounding" in out


# -- a model factory that needs the data factory's values (examples/char_gpt.py) -------------------

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 60
#: configs/char_gpt.yaml's model, behind a factory that needs what the data factory returns
#: (nanoGPT's GPTConfig has no vocab_size or block_size it could fall back on either).
LM_SUBJECT = """
from examples.char_gpt import CharGPT


def gpt(vocab_size, block_size):
    return CharGPT(block_size, layers=1, heads=2, dim=16, vocab_size=vocab_size)
"""


def _char_lm(tmp_path) -> list[str]:
    """configs/char_gpt.yaml, tiny, with LM_SUBJECT's model: data.root and the module are in
    tmp_path, which the caller puts on the path."""
    (tmp_path / "input.txt").write_text(CORPUS)
    (tmp_path / "lm_subject.py").write_text(LM_SUBJECT)
    return [f"data.root={tmp_path}", f"run.dir={tmp_path / 'run'}", "model.name=lm_subject:gpt",
            "data.kwargs={block_size: 16}", "model.kwargs={}", "train.max_steps=40",
            "eval.every_steps=0", "log.progress=off"]


def test_tune_builds_a_model_from_the_data_factory_values_as_train_does(tmp_path, monkeypatch):
    """The model each trial trains is the one ironloop train builds: the data factory's
    vocab_size and block_size reach the model factory, and so do the same initial weights."""
    from ironloop.tools.models import from_config

    monkeypatch.syspath_prepend(str(REPO))  # examples.char_gpt
    monkeypatch.syspath_prepend(str(tmp_path))  # lm_subject
    cfg = ironloop.load_config(REPO / "configs/char_gpt.yaml", _char_lm(tmp_path))
    tuned = tune_mod.config_subject(cfg).make_model()
    trained, _ = from_config(cfg)
    assert tuned.block_size == trained.block_size == 16
    a, b = tuned.state_dict(), trained.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_tune_runs_a_char_lm_whose_model_needs_the_data_factory_values(tmp_path, monkeypatch,
                                                                       tune_cli):
    monkeypatch.syspath_prepend(str(REPO))  # examples.char_gpt
    code, out, err = tune_cli(str(REPO / "configs/char_gpt.yaml"), *_char_lm(tmp_path),
                              "--budget", "15")
    assert code == 0, out + err
    assert (tmp_path / "run/tuned.yaml").is_file()


# -- stopping a tune (issue 42, finding 13) -------------------------------------------------------


def _trial_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("ironloop-tune-*"))


def _start_tune(tmp_path, wait_for: str = "") -> tuple[subprocess.Popen, Path]:
    """``ironloop tune`` on the compute-bound subject, its temporary directories under
    tmp_path/tmp; returns once a trial's directory holds ``wait_for`` ("": once one exists;
    "metrics.jsonl": once a trial's loop has logged, inside fit()'s own signal handlers)."""
    config = _cli_subject(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "ironloop", "tune", config, "--budget", "60"],
                            cwd=tmp_path, env={**os.environ, **_env(), "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    polls = 1200  # of 0.1 s at most: a bound, not a wait the test relies on
    while not list(tmp.glob(f"ironloop-tune-*/{wait_for}")) and proc.poll() is None and polls:
        polls -= 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    assert list(tmp.glob(f"ironloop-tune-*/{wait_for}")), proc.communicate()
    return proc, tmp


@pytest.mark.slow
@pytest.mark.parametrize("inside", ["", "metrics.jsonl"], ids=["setting-up", "in-the-loop"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_tune_without_a_tuned_yaml(tmp_path, sig, code, inside):
    """Ctrl-C or SIGTERM in a trial: not a "failed: Preempted" trial and exit 0, but a stop,
    said on one line, with 128 + the signal and nothing written. Sent as a trial sets up (the
    tune's handler) or once it trains (fit()'s handler, which ends the step first)."""
    proc, tmp = _start_tune(tmp_path, inside)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, out + err
    assert f"tune stopped by {sig.name}" in err and "Traceback" not in err
    assert "Preempted" not in out + err
    assert not (tmp_path / "run" / "tuned.yaml").exists()
    assert not (tmp_path / "run" / "tune.json").exists()
    assert _trial_dirs(tmp) == []  # the trial's directory went with it


@pytest.mark.slow
def test_a_sigkilled_tunes_directories_are_removed_at_the_next_start(tmp_path):
    from ironloop.tools.tune.stop import clean_stale

    proc, tmp = _start_tune(tmp_path)
    mine = tmp / f"ironloop-tune-{os.getpid()}-live"  # a live tune's: kept
    mine.mkdir()
    proc.kill()
    proc.communicate(timeout=60)
    left = [p for p in _trial_dirs(tmp) if p != mine]
    assert left  # SIGKILL runs no clean-up
    assert clean_stale(tmp) == len(left)
    assert _trial_dirs(tmp) == [mine]


def test_a_signal_before_a_trials_with_still_removes_its_directory(tmp_path, monkeypatch):
    """The signal can land between a trial directory's mkdtemp and the ``with`` that would
    remove it (seen once at load 13: test_a_signal_stops_the_tune_without_a_tuned_yaml found
    the directory left): the stop removes this process's trial directories, no one else's."""
    import tempfile

    from ironloop.tools.tune.stop import PREFIX, Stopped, stop_on_signals, trial_prefix

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = tmp_path / f"{PREFIX}1-other"  # another tune's (pid 1): not this one's to remove
    other.mkdir()
    with pytest.raises(Stopped), stop_on_signals():
        tempfile.mkdtemp(prefix=trial_prefix())  # created, its with never entered
        os.kill(os.getpid(), signal.SIGINT)
    assert _trial_dirs(tmp_path) == [other]


class _SignalsAt(nn.Module):
    """A linear model that sends its own process SIGINT during its ``at``-th forward."""

    def __init__(self, at: int):
        super().__init__()
        self.linear, self.at, self.calls = nn.Linear(4, 2), at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return self.linear(x)


def test_a_signal_in_a_trials_last_step_stops_the_tune(tmp_path):
    """The trial ends at step 3's on_step_end (its measurement is done), the step the signal
    came in: fit()'s own handler acts after on_step_end, which the trial's end skips, and the
    signal was lost (the tune went on and exited 0)."""
    from ironloop.tools.tune.stop import Stopped, stop_on_signals
    from ironloop.tools.tune.trials import Plan, Subject, run_trial

    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    cfg = Config.from_dict({"run": {"dir": str(tmp_path / "run")}, "train": {"batch_size": 8}})
    subject = Subject(cfg, lambda: _SignalsAt(4), data, {})  # 1: fit() infers the classes
    plan = Plan(warmup=1, window=1, repeats=1, measure_s=1e-9)  # ends at step 3
    with stop_on_signals(), pytest.raises(Stopped, match="stopped by SIGINT"):
        run_trial(subject, {}, plan, deadline=time.perf_counter() + 120)
    quiet = Subject(cfg, lambda: _SignalsAt(0), data, {})  # no signal: the trial is measured
    with stop_on_signals():
        assert run_trial(quiet, {}, plan, time.perf_counter() + 120).step_ms > 0


def test_a_signal_inside_a_model_factory_stops_the_tune_and_is_not_the_factorys_error(tmp_path):
    """SIGINT while the config's model factory runs (a trial setting up): the tune's handler
    raises Stopped there, and the factory's error wrapper (specs.call_factory) must let it
    through; it turned it into "the config does not train as it stands", exit 2 (CI, stop 47)."""
    from ironloop.specs import call_factory
    from ironloop.tools.tune.stop import Stopped, stop_on_signals

    def factory():
        os.kill(os.getpid(), signal.SIGINT)
        return nn.Linear(4, 2)

    with stop_on_signals(), pytest.raises(Stopped, match="stopped by SIGINT"):
        call_factory(factory, "model factory 'f'", "model.name")


def test_a_trials_config_writes_no_checkpoint_evaluates_nothing_and_plants_no_fault(tmp_path):
    """A trial is timed: a checkpoint, an evaluation or a tracker would be timed with it, and
    the fault knobs would crash or poison it on purpose."""
    from ironloop.tools.tune.trials import trial_config

    user = Config().with_overrides({"checkpoint.enabled": True, "checkpoint.every_steps": 1,
                                    "eval.every_steps": 5, "log.tensorboard": True,
                                    "fault.crash_at_step": 3, "early_stop.patience": 2})
    trial = trial_config(user, {"train.batch_size": 16}, 12, tmp_path, n=64)
    assert trial.checkpoint.enabled is False and trial.eval.every_steps == 0
    assert trial.log.tensorboard is False and trial.fault.crash_at_step == 0
    assert trial.early_stop.patience == 0
    assert (trial.run.dir, trial.train.max_steps, trial.train.batch_size) == \
        (str(tmp_path), 12, 16)


def _linear_subject(tmp_path, **fit_kwargs):
    from ironloop.tools.tune.trials import Subject

    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    cfg = Config.from_dict({"run": {"dir": str(tmp_path / "run")}, "train": {"batch_size": 8}})
    return Subject(cfg, lambda: nn.Linear(4, 2), data, fit_kwargs)


def test_a_trial_that_runs_to_its_last_step_reports_where_its_time_went(tmp_path):
    from ironloop.tools.tune.trials import Plan, run_trial

    m = run_trial(_linear_subject(tmp_path), {}, Plan(1, 1, 2), time.perf_counter() + 120)
    assert m.time_split is not None and m.time_split["forward"] > 0
    assert set(m.time_split) >= {"data", "forward", "backward", "optimizer"}


@pytest.fixture
def one_trial_tune(monkeypatch):
    """ironloop.tune() with its budgeted search cut to one real trial, the baseline: what
    tune() hands the trials and what it writes, in a fraction of a second."""
    from ironloop.tools.tune.rows import Row
    from ironloop.tools.tune.trials import Plan, run_trial

    def one_trial(subject, budget, progress):
        tuner = tune_mod.Tuner(subject, budget, None)
        m = run_trial(subject, {}, Plan(1, 1, 2), time.perf_counter() + 120)
        tuner.baseline = Row("baseline (the config as it is)", {}, status="ok", measure=m,
                             ratio=1.0, projected_s=m.seconds)
        return tuner, {}, {}

    monkeypatch.setattr(tune_mod, "run_tune", one_trial)


def test_tune_trains_each_trial_with_the_users_scheduler_factory(tmp_path, one_trial_tune):
    built = []

    def scheduler(opt):
        built.append(opt)
        return torch.optim.lr_scheduler.StepLR(opt, 10)

    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    ironloop.tune(nn.Linear(4, 2), data, {"run.dir": str(tmp_path / "run"),
                                          "train.batch_size": 8}, scheduler=scheduler)
    assert built  # the trial's own optimizer, given to the user's factory


def test_tune_writes_tune_json_and_a_tuned_yaml_that_fit_takes(tmp_path, one_trial_tune):
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    result = ironloop.tune(nn.Linear(4, 2), data, {"run.dir": str(tmp_path / "run"),
                                                   "train.batch_size": 8, "train.epochs": 3})
    run = tmp_path / "run"
    assert result.paths == {"tune.json": run / "tune.json", "tuned.yaml": run / "tuned.yaml"}
    assert json.loads((run / "tune.json").read_text())["baseline"]["status"] == "ok"
    tuned = ironloop.load_config(run / "tuned.yaml")
    assert tuned.to_dict() == result.config.to_dict() and tuned.train.epochs == 3


def test_a_probe_that_overruns_the_budget_says_to_raise_budget(tmp_path, monkeypatch):
    from ironloop.tools.tune.trials import TrialFailed

    def overrun(*_args):
        raise TrialFailed("stopped at its deadline", overrun=True)

    monkeypatch.setattr(tune_mod, "run_trial", overrun)
    tuner = tune_mod.Tuner(_linear_subject(tmp_path), 30.0, None)
    with pytest.raises(ironloop.errors.UserError,
                       match=r"--budget=30 s does not fit even a 3-step probe.*raise --budget"):
        tuner.start(planned_rows=4)


def test_tune_json_says_how_much_of_the_budget_was_used(tmp_path):
    from ironloop.tools.tune import output

    subject = _linear_subject(tmp_path)
    tuner = tune_mod.Tuner(subject, 600.0, None)
    tuner.started -= 100.0  # as if the tune had been running for 100 s
    info = output.context(subject, tuner, 600.0, None, [])
    assert 100.0 <= info["used_s"] < 600.0


def test_tune_json_records_the_baseline_rate_under_samples_per_s(tmp_path, one_trial_tune):
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    ironloop.tune(nn.Linear(4, 2), data, {"run.dir": str(tmp_path / "run"),
                                          "train.batch_size": 8})
    baseline = json.loads((tmp_path / "run" / "tune.json").read_text())["baseline"]
    assert baseline["samples_per_s"] > 0


def test_tune_creates_a_run_dir_whose_parents_do_not_exist(tmp_path, one_trial_tune):
    run = tmp_path / "new" / "nested" / "run"
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    ironloop.tune(nn.Linear(4, 2), data, {"run.dir": str(run), "train.batch_size": 8})
    assert (run / "tune.json").is_file() and (run / "tuned.yaml").is_file()


def test_cpu_peak_memory_is_the_processs_max_rss_in_mib(monkeypatch):
    from types import SimpleNamespace

    from ironloop.tools.tune import trials

    # Linux reports ru_maxrss in KiB: 300 MiB of it must read as 300.0.
    monkeypatch.setattr(trials.resource, "getrusage",
                        lambda _who: SimpleNamespace(ru_maxrss=300 * 1024))
    assert trials._peak_mb(cuda=False) == 300.0
