"""ironloop tune: real tunes on this machine, and what tune() checks, applies and hands its
trials (the decisions, pure, on measurements fed in: test_tuner.py, test_rows.py, test_trials.py,
test_output.py, test_stop.py). The real tunes assert what tune decides, never a time. The
loader-bound dataset sleeps per sample: an I/O-like latency (disk, network) that worker processes
overlap whatever the machine's load, which busy-looping work would not on 2 shared cores (that
case is a benchmark: examples/cpu_reads.yaml, BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
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
from ironloop.errors import UserError
from ironloop.outputs.time_split import RunSettings, advice
from ironloop.tools import tune as tune_mod
from ironloop.tools.tune import output, rows, trials, tuner as tuner_mod
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Measure, Plan, Subject, TrialFailed
from tests.conftest import REPO
from tests.tools.tune.helpers import data, mk

# measured speed or timed signals: never beside the other (tests/conftest.py cpu_alone)
pytestmark = pytest.mark.usefixtures("cpu_alone")


def test_tune_arguments_mix_like_train_s():
    from ironloop.cli import parser, train_argv

    argv = train_argv(["--budget", "30", "c.yaml", "train.epochs=3", "--apply-trajectory-changes",
                       "data.num_workers=1"], valued=("--budget",))
    args = parser().parse_args(["tune", *argv])
    assert (args.config, args.overrides, args.budget, args.apply_trajectory_changes) == \
        ("c.yaml", ["train.epochs=3", "data.num_workers=1"], 30.0, True)


def test_a_budget_of_zero_is_refused_naming_tunes_argument(tmp_path):
    with pytest.raises(ironloop.errors.ConfigError,
                       match="^budget=0: must be a finite number of seconds > 0"):
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
    assert result.chosen.get("run.threads", 1) <= max(1, rows.cpus() - workers), out
    (won,) = [r for r in result.rows if r.won and r.kind == "free"]
    assert won.pairs and len(won.pairs["ratios"]) == tuner_mod.PAIRS, won.pairs
    assert all(r > 1 for r in won.pairs["ratios"])
    assert result.speedup == pytest.approx(won.pairs["median"], rel=1e-3)
    assert "x base" in out and "run time at 2 epochs" in out and "chosen (" in out
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
    from ironloop.tools.tune import output

    _CLOCK.now = 0.0
    for module in (tuner_mod, trials, output):
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
    # from Python, the notice names tune()'s argument, not the CLI's flag
    assert "notice: apply_trajectory_changes=True: train.batch_size: 1 -> " in out
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
    from ironloop.tools.tune.trials import Plan, run_trial

    def one_trial(subject, budget, progress):
        tuner = tuner_mod.Tuner(subject, budget, None)
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


def test_tune_writes_tune_json_and_a_tuned_yaml_that_fit_takes_and_says_so_in_python(
        tmp_path, one_trial_tune, capsys):
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    result = ironloop.tune(nn.Linear(4, 2), data, {"run.dir": str(tmp_path / "run"),
                                                   "train.batch_size": 8, "train.epochs": 3})
    run = tmp_path / "run"
    assert result.paths == {"tune.json": run / "tune.json", "tuned.yaml": run / "tuned.yaml"}
    assert json.loads((run / "tune.json").read_text())["baseline"]["status"] == "ok"
    tuned = ironloop.load_config(run / "tuned.yaml")
    assert tuned.to_dict() == result.config.to_dict() and tuned.train.epochs == 3
    text = (run / "tuned.yaml").read_text()
    assert text.startswith("# from ironloop.tune() of a Linear on 64 training samples: ")
    assert "digits" not in text and "mlp" not in text  # the defaults the objects replaced
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith("train with: ironloop.fit(model, train_data, config=result.config), "
                         f"or config=ironloop.load_config('{run}/tuned.yaml')")
    assert "ironloop train" not in last


def test_a_probe_that_overruns_the_budget_says_to_raise_budget(tmp_path, monkeypatch):

    def overrun(*_args):
        raise TrialFailed("stopped at its deadline", overrun=True)

    monkeypatch.setattr(tuner_mod, "run_trial", overrun)
    tuner = tuner_mod.Tuner(_linear_subject(tmp_path), 30.0, None)
    with pytest.raises(ironloop.errors.UserError,
                       match=r"--budget=30 s does not fit even a 3-step probe.*raise --budget"):
        tuner.start(planned_rows=4)


def test_tune_json_says_how_much_of_the_budget_was_used(tmp_path):
    from ironloop.tools.tune import output

    subject = _linear_subject(tmp_path)
    tuner = tuner_mod.Tuner(subject, 600.0, None)
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


    # Linux reports ru_maxrss in KiB: 300 MiB of it must read as 300.0.
    monkeypatch.setattr(trials.resource, "getrusage",
                        lambda _who: SimpleNamespace(ru_maxrss=300 * 1024))
    assert trials._peak_mb(cuda=False) == 300.0


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
    compile_only = {"train.compile": True}
    micro = {"run.threads": 1, "train.batch_size": 8, "train.accumulation_steps": 1}
    assert [call[0] for call in trial_log.calls] == [
        {}, {},  # the probe, the baseline
        threads,  # 2x, every window: kept on, its pairs held for the end
        bf16, *[threads, bf16, bf16, threads] * 2,
        micro,  # within noise: no pairs
        compiled, *[threads, compiled, compiled, threads] * 2,  # 1.22x: not clear, paired
        *[compile_only, compiled, compiled, compile_only] * 2]  # the kept threads confirmed
    assert result.chosen == {"run.threads": 1, "train.compile": True}
    assert result.trajectory == {"train.precision": "bf16"} and not result.applied_trajectory
    assert result.config.to_dict() == fabricated.cfg.with_overrides(result.chosen).to_dict()
    # 12,800 samples: 128 s, 64 s with one thread, 12,800 / 300 + 10 s compiled
    # (the kept threads' gain is their confirmation's: on top of the compile, 12,800 / 150 + 10 s
    # against compiled_s)
    compiled_s = 12800 / 300 + 10.0
    threads_gain = (12800 / 150 + 10.0) / compiled_s
    assert result.speedup == pytest.approx(threads_gain * 64 / compiled_s)
    assert [(r.setting, r.status, r.won) for r in result.rows] == [
        ("data.num_workers", "skipped", False), ("run.threads=1", "ok", True),
        ("train.precision=bf16", "ok", True),
        ("train.batch_size=8 train.accumulation_steps=1", "ok", False),
        ("train.compile=true", "ok", True)]
    _, one, half, batch, compile_row = result.rows
    assert (one.gain, half.gain) == (pytest.approx(threads_gain), 1.5) and one.kept
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
    assert ironloop.load_config(run / "tuned.yaml").to_dict() == result.config.to_dict()
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


@pytest.mark.parametrize(("budget", "after", "compiled_n", "others"),
                         [(52.0, 1.0 + 5.0, 1 + 4 + 8, 4), (52.25, 39.25, 1, 8)])
def test_a_compile_reserve_is_held_only_beyond_a_trials_share(fabricated, trial_log, clock,
                                                               budget, after, compiled_n, others):
    # 13 trials of 1 s before the compile's, and 8 s held for the kept threads' pairs: 31 s
    # beyond those is 30 s of reserve and a trial's 1 s, not more: no reserve, the compile's
    # trials have a trial's deadline (1 s + 5 at least), its 4 pairs run and the confirmation's
    # 8 trials all compile; 31.25 s holds it, the deadline is the budget's end, no room is left
    # for the compile's pairs, and the threads are confirmed alone (8 trials)
    tune_mod.run_tune(fabricated, budget, "off")
    compiled = [call[2] - start for call, start in zip(trial_log.calls, _starts(trial_log))
                if "train.compile" in call[0]]
    rest = [call for call in trial_log.calls[13:] if "train.compile" not in call[0]]
    assert compiled[0] == after and (len(compiled), len(rest)) == (compiled_n, others)


def test_tune_hands_its_objects_to_the_trials_and_never_trains_the_model(monkeypatch):
    seen = {}

    def finish(subj, budget, apply, path, overrides, tuned):
        seen.update(subject=subj, args=(budget, apply, path, overrides), tuned=tuned)
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
    assert seen["tuned"] == "a Linear on 32 training samples"  # tuned.yaml's header names it
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
