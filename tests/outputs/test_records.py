"""What a run records: the classes and sizes it used, run.json, and time across resumes."""

from __future__ import annotations

import json
import time

import pytest
import torch
import yaml

import ironloop
from ironloop.callbacks import Callback
from ironloop.config import Config
from ironloop.tools.report import summarize
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
