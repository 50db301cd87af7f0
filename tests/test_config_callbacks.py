"""Callbacks named in the config (``train.callbacks``), so that ``ironloop train`` can use them:
built with their keyword arguments, run, and their state saved and restored as for fit()'s."""

from __future__ import annotations

import json

import pytest

import ironloop
from ironloop.callbacks import Callback
from ironloop.errors import ConfigError
from tests.conftest import REPO, blobs, cfg, run_cli, tiny_mlp

COUNTING = """
from ironloop.callbacks import Callback

class Counter(Callback):
    def __init__(self, label="seen"):
        self.label, self.seen = label, 0

    def on_step_end(self, run, metrics):
        self.seen += 1
        run.log_scalars({self.label: self.seen})

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]
"""


@pytest.mark.slow
def test_a_cli_named_callback_runs_and_resumes_its_state(tmp_path):
    """A crash after step 6 (checkpoint at 4): the resumed counter goes on from 4, so it counts
    every step once, 10 in all; a fresh counter would end at 6."""
    (tmp_path / "counting.py").write_text(COUNTING)
    run_dir = tmp_path / "run"
    args = ["train", "data.name=digits", "model.name=mlp", "train.max_steps=10",
            "checkpoint.every_steps=4", "log.progress=off", "doctor.preflight=false",
            f"run.dir={run_dir}", "train.callbacks=[{spec: 'counting:Counter', label: n}]"]
    env = {"PYTHONPATH": f"{REPO / 'src'}:{tmp_path}"}
    first = run_cli(*args, "fault.crash_at_step=6", cwd=tmp_path, env=env)
    assert first.returncode == 1, first.stderr
    second = run_cli(*args, "--resume", cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr
    rows = [json.loads(x) for x in (run_dir / "scalars.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))  # the redone steps logged once
    assert all(r["n"] == r["step"] for r in rows)


class Order(Callback):
    def __init__(self, seen: list, name: str = "given"):
        self.seen, self.name = seen, name

    def on_train_start(self, run, metrics):
        self.seen.append(self.name)


SEEN: list = []


def test_config_callbacks_follow_fits_own(tmp_path):
    SEEN.clear()
    spec = {"spec": "tests.test_config_callbacks:Order", "seen": SEEN, "name": "config"}
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1,
                                                 train__callbacks=[spec]),
                 callbacks=[Order(SEEN)])
    assert SEEN == ["given", "config"]


def test_bad_callback_specs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train.callbacks=.*must be a list of 'module:Class'"):
        ironloop.config.load_config(None, ["train.callbacks=[counting.Counter]"])
    with pytest.raises(ConfigError, match="train.callbacks: .*Order.*failed"):
        ironloop.fit(tiny_mlp(), blobs(64), None,
                     cfg(tmp_path, train__callbacks=[{"spec": "tests.test_config_callbacks:Order",
                                                      "colour": 1}]))
    res = run_cli("train", "data.name=digits", f"run.dir={tmp_path / 'r'}",
                  "train.callbacks=[no_such_module:Cb]", cwd=tmp_path)
    assert res.returncode == 2 and "train.callbacks='no_such_module:Cb'" in res.stderr
    assert "Traceback" not in res.stderr
