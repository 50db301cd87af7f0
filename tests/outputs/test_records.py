"""What a run records: the classes and sizes it used, run.json, and time across resumes.

What a run records about itself (outputs/records.py), unit by unit: the ``used:`` block,
config.yaml's names, the git commit, the environment and run.json across resumes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time

import pytest
import torch
import yaml

import ironloop
from ironloop.callbacks import Callback
from ironloop.config import Config
from ironloop.outputs import records
from ironloop.tools.report import summarize
from ironloop.version import __version__
from tests.conftest import blobs, cfg, tiny_mlp


def test_fit_records_what_it_used_and_no_unused_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git checkout: git_commit is None, and nothing fails
    ironloop.fit(tiny_mlp(), blobs(200), blobs(60, seed=1), cfg(tmp_path, train__epochs=1))
    run_dir = tmp_path / "run"
    record = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert record["model"]["name"] == "user: Sequential"
    assert record["data"]["name"] == "user: TensorData"
    used = record["used"]
    assert used["model"] == {"class": "Sequential", "parameters": 8 * 16 + 16 + 16 * 3 + 3,
                             "trainable": 8 * 16 + 16 + 16 * 3 + 3}
    assert used["data"] == {"train": {"type": "TensorData", "size": 200},
                            "val": {"type": "TensorData", "size": 60}}
    assert used["optimizer"] == "AdamW" and used["scheduler"] is None
    text = summarize(run_dir)
    assert "Sequential (195 parameters)" in text and "TensorData (200 train, 60 val)" in text
    assert "digits" not in text and "| mlp" not in text
    assert Config.from_dict(record).optim.lr == 1e-3  # the `used:` block is not config
    env = json.loads((run_dir / "run.json").read_text())
    assert env["torch"] and env["device_name"] and env["world_size"] == 1
    assert env["git_commit"] is None and env["command"] and env["resumes"] == []


class FakeClock:
    """time.perf_counter for the whole process, advancing one second per training forward
    and never otherwise: training time is then an exact count of batches trained. (Not per
    batch fetched: the loop fetches one batch ahead, data/prefetch.py.)"""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class Timed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_mlp()

    def forward(self, x):
        if self.training:  # class-count inference and evaluation run in eval mode
            FakeClock.now += 1.0
        return self.net(x)


@pytest.fixture
def clock(monkeypatch):
    FakeClock.now = 0.0  # whatever ran before
    monkeypatch.setattr(time, "perf_counter", FakeClock.perf_counter)
    return FakeClock


class SlowStart(Callback):
    """100 s of set-up after fit() built the run: not training time."""

    def on_train_start(self, run, metrics):
        FakeClock.now += 100.0


def test_run_json_gets_an_entry_per_resume_and_events_show_redone_steps(tmp_path, clock):
    data = blobs()
    train = data  # 7 batches of 32 per epoch: 7 "seconds"
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=3, checkpoint__keep_last=5)
    first = ironloop.fit(Timed(), train, None, conf, callbacks=[SlowStart()])
    assert first.results["train_seconds"] == 14.0
    step6 = tmp_path / "run" / "checkpoints" / "step-00000006.pt"
    res = ironloop.fit(Timed(), train, None, conf, resume=str(step6),
                       callbacks=[SlowStart()])
    assert len(json.loads((tmp_path / "run" / "run.json").read_text())["resumes"]) == 1
    event = json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])
    assert event["step"] == 6 and event["steps_redone"] == 14 - 6
    # 6 s up to the checkpoint, then 8 batches redone in the resumed process: the 8 seconds
    # the first process spent past step 6 were lost with it and are not counted twice.
    assert res.results["train_seconds"] == 6.0 + 8.0
    epochs = [json.loads(x) for x in (tmp_path / "run" / "epochs.jsonl").read_text().splitlines()]
    assert [e["train_seconds"] for e in epochs] == [7.0, 7.0]
    assert "wall_seconds_this_process" in res.results


def test_a_resumed_epoch_counts_both_processes_training_time(tmp_path, clock):
    data = blobs(256)
    train = data  # 8 batches of 32 per epoch: 8 "seconds"
    conf = cfg(tmp_path, train__epochs=1, train__max_steps=5)
    ironloop.fit(Timed(), train, None, conf)
    res = ironloop.fit(Timed(), train, None, {**conf, "train.max_steps": 0}, resume=True,
                       allow_config_change=True)
    epoch = json.loads((tmp_path / "run" / "epochs.jsonl").read_text())
    assert epoch["train_seconds"] == 8.0  # 5 before the resume + 3 after
    assert epoch["samples_per_s"] == pytest.approx(256 / 8.0)
    # the end-of-epoch checkpoint is not training time (on this clock it takes none anyway)
    assert res.results["train_seconds"] == 8.0


def my_loss(out, y):
    return out.sum()


class Stepper:
    def __call__(self, batch):
        return batch


def test_the_used_block_names_the_objects_the_run_holds():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].weight.requires_grad_(False)  # 2 frozen of 8 + 3 = 11
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    data = {"train": {"type": "TensorData", "size": 10}}
    block = records.used(model, opt, sched, True, data, loss_fn=my_loss, step_fn=Stepper())
    assert block == {"model": {"class": "Sequential", "parameters": 11, "trainable": 9},
                     "data": data, "optimizer": "SGD", "scheduler": "StepLR",
                     "source": "config", "loss_fn": "my_loss", "step_fn": "Stepper"}
    plain = records.used(model, opt, None, False, data)
    assert plain["scheduler"] is None and plain["source"] == "fit"
    assert "loss_fn" not in plain and "step_fn" not in plain


def test_config_yaml_names_a_fit_runs_own_model_and_data():
    cfg = {"model": {"name": "mlp", "width": 4}, "data": {"name": "digits"}, "optim": {"lr": 1}}
    used = {"source": "fit", "model": {"class": "Net"},
            "data": {"train": {"type": "Rows", "size": 3}}}
    record = records.config_record(cfg, used)
    assert record == {"model": {"name": "user: Net", "width": 4},
                      "data": {"name": "user: Rows"}, "optim": {"lr": 1}, "used": used}
    assert cfg["model"]["name"] == "mlp"  # the config itself is left as it was
    no_train = records.config_record(cfg, {**used, "data": {}})
    assert no_train["data"]["name"] == "user"
    from_config = records.config_record(cfg, {**used, "source": "config"})
    assert from_config["model"]["name"] == "mlp" and from_config["data"]["name"] == "digits"


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_git_commit_is_the_head_and_dirty_only_for_changed_tracked_files(tmp_path):
    assert records.git_commit(tmp_path) is None  # not a checkout
    _git(tmp_path, "init", "-q")
    assert records.git_commit(tmp_path) is None  # a checkout without a commit
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("new\n")  # not a change to the commit's files
    assert records.git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert records.git_commit(tmp_path) == head + "+dirty"


def test_git_commit_never_waits_on_git_without_a_limit(tmp_path, monkeypatch):
    """A git that hangs (a stale lock, a slow network mount) must not hang the run's start:
    every git call has a timeout (a timed-out one gives None, as no git does)."""
    limits, run = [], subprocess.run

    def timed(*args, **kwargs):
        limits.append(kwargs.get("timeout"))
        return run(*args, **kwargs)

    monkeypatch.setattr(records.subprocess, "run", timed)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    limits.clear()
    assert records.git_commit(tmp_path) is not None
    assert len(limits) == 2 and all(t is not None and 0 < t <= 30 for t in limits), limits


def test_git_commit_is_none_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to run
    assert records.git_commit(tmp_path) is None


def test_the_environment_says_where_and_with_what_the_process_ran(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(records, "git_commit", lambda: "abc")
    env = records.environment(torch.device("cpu"), 3)
    assert env["command"] == [sys.executable, *sys.argv]
    assert env["cwd"] == str(tmp_path) and env["git_commit"] == "abc"
    assert env["ironloop"] == __version__ and env["torch"] == str(torch.__version__)
    assert env["python"] == platform.python_version() and env["host"] == platform.node()
    assert env["device"] == "cpu" and env["world_size"] == 3 and env["cuda"] == torch.version.cuda
    assert env["device_name"] == (platform.processor() or platform.machine() or "cpu")
    assert isinstance(env["time"], float)


def test_the_cpu_device_name_falls_back_to_the_machine_then_the_device_type(monkeypatch):
    monkeypatch.setattr(records, "git_commit", lambda: None)
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert records.environment(torch.device("cpu"), 1)["device_name"] == "arm64"
    monkeypatch.setattr(platform, "machine", lambda: "")
    assert records.environment(torch.device("cpu"), 1)["device_name"] == "cpu"


@pytest.mark.parametrize("resumed", [False, True])
def test_run_json_starts_with_the_first_process(tmp_path, resumed):
    records.write_run_json(tmp_path, {"host": "a"}, resumed=resumed)  # resumed, but no file yet
    text = (tmp_path / "run.json").read_text()
    assert text.endswith("}\n") and json.loads(text) == {"host": "a", "resumes": []}
    assert text == json.dumps({"host": "a", "resumes": []}, indent=2) + "\n"


def test_run_json_gets_one_entry_per_resume_and_a_fresh_start_replaces_it(tmp_path):
    records.write_run_json(tmp_path, {"host": "a"}, resumed=False)
    records.write_run_json(tmp_path, {"host": "b"}, resumed=True)
    records.write_run_json(tmp_path, {"host": "c"}, resumed=True)
    assert json.loads((tmp_path / "run.json").read_text()) == {
        "host": "a", "resumes": [{"host": "b"}, {"host": "c"}]}
    records.write_run_json(tmp_path, {"host": "d"}, resumed=False)
    assert json.loads((tmp_path / "run.json").read_text()) == {"host": "d", "resumes": []}


def test_a_resume_over_an_unreadable_or_old_run_json_starts_it_again(tmp_path):
    (tmp_path / "run.json").write_text("{torn")
    records.write_run_json(tmp_path, {"host": "b"}, resumed=True)
    assert json.loads((tmp_path / "run.json").read_text()) == {"host": "b", "resumes": []}
    (tmp_path / "run.json").write_text(json.dumps({"host": "a"}))  # no "resumes" key yet
    records.write_run_json(tmp_path, {"host": "c"}, resumed=True)
    assert json.loads((tmp_path / "run.json").read_text()) == {"host": "a",
                                                              "resumes": [{"host": "c"}]}


def test_a_cuda_device_is_named_by_the_device_the_run_uses(monkeypatch):
    monkeypatch.setattr(records, "git_commit", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU of {device}")
    env = records.environment(torch.device("cuda", 1), 2)
    assert env["device_name"] == "GPU of cuda:1" and env["device"] == "cuda:1"
