"""What a run records: the classes and sizes it used, run.json, and time across resumes."""

from __future__ import annotations

import json

import pytest
import yaml

import ironloop
from ironloop.engine import progress
from ironloop.config import Config
from ironloop.data.loader import TensorData
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


def test_run_json_gets_an_entry_per_resume_and_events_show_redone_steps(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=3, checkpoint__keep_last=5)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    step6 = tmp_path / "run" / "checkpoints" / "step-00000006.pt"
    res = ironloop.fit(tiny_mlp(), blobs(), None, conf, resume=str(step6))
    assert len(json.loads((tmp_path / "run" / "run.json").read_text())["resumes"]) == 1
    event = json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])
    assert event["step"] == 6 and event["steps_redone"] == 14 - 6
    assert res.results["train_seconds"] >= 0 and "wall_seconds_this_process" in res.results


class FakeClock:
    """perf_counter for the meter that advances one second per training batch fetched."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class TimedData(TensorData):
    def __getitems__(self, indices):
        FakeClock.now += 1.0
        return super().__getitems__(indices)


def test_a_resumed_epoch_counts_both_processes_training_time(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "time", FakeClock)
    data = blobs(256)
    train = TimedData(data.x, data.y)  # 8 batches of 32 per epoch: 8 "seconds"
    conf = cfg(tmp_path, train__epochs=1, train__max_steps=5)
    ironloop.fit(tiny_mlp(), train, None, conf)
    res = ironloop.fit(tiny_mlp(), train, None, {**conf, "train.max_steps": 0}, resume=True,
                       allow_config_change=True)
    epoch = json.loads((tmp_path / "run" / "epochs.jsonl").read_text())
    assert epoch["train_seconds"] == pytest.approx(8.0)  # 5 before the resume + 3 after
    assert epoch["samples_per_s"] == pytest.approx(256 / 8.0)
    # less the real (tiny) seconds of the end-of-epoch checkpoint, which is not training time
    assert res.results["train_seconds"] == pytest.approx(8.0, abs=0.5)
