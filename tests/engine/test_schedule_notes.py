"""What the schedule does that the user did not ask for, warned before the first step: a key the
schedule ignores, and a resume that runs past the schedule's end at its last (near-zero) LR."""

from __future__ import annotations

import ironloop
from ironloop.config import Config
from ironloop.engine import schedule_notes
from ironloop.errors import speaking_python
from tests.conftest import blobs, cfg, tiny_mlp


def onecycle(**keys) -> Config:
    return Config().with_overrides({"schedule.name": "onecycle", **keys})


def test_an_lr_override_that_onecycle_max_lr_ignores_warns():
    [warning] = schedule_notes.ignored_settings(onecycle(**{"schedule.max_lr": 0.005,
                                                             "optim.lr": 3e-3}))
    assert "optim.lr=0.003 has no effect" in warning and "schedule.max_lr" in warning


def test_an_lr_the_schedule_reads_is_not_named():
    # max_lr=0: onecycle peaks at 10 x optim.lr, so optim.lr counts
    assert schedule_notes.ignored_settings(onecycle(**{"optim.lr": 3e-3})) == []
    # optim.lr left at its default is not the user's choice
    assert schedule_notes.ignored_settings(onecycle(**{"schedule.max_lr": 0.005})) == []
    assert schedule_notes.ignored_settings(Config().with_overrides({"optim.lr": 3e-3})) == []


def test_steps_past_the_schedule_at_a_zero_lr_are_warned_with_the_fix():
    warning = schedule_notes.extension_warning("warmup_cosine", 23, 23, 300, 0.0, 2e-3)
    assert warning is not None
    assert "steps 24-300 (277 of them)" in warning and "barely change" in warning
    assert "--overwrite" in warning
    with speaking_python():
        python = schedule_notes.extension_warning("cosine", 23, 23, 300, 0.0, 2e-3)
    assert python is not None and "overwrite=True" in python and "--overwrite" not in python


def test_a_resume_inside_the_schedule_says_nothing():
    assert schedule_notes.extension_warning("cosine", 100, 23, 100, 1e-3, 2e-3) is None
    assert schedule_notes.extension_warning("cosine", 0, 23, 300, 1e-3, 2e-3) is None  # constant
    # mid-schedule, extended: the steps past its end are still named
    mid = schedule_notes.extension_warning("cosine", 50, 23, 80, 0.0, 2e-3)
    assert mid is not None and "steps 51-80 (30 of them)" in mid


def test_extending_a_finished_cosine_run_warns_before_its_first_step(tmp_path, capsys):
    conf = cfg(tmp_path, **{"schedule.name": "warmup_cosine", "schedule.warmup_steps": 2,
                            "train.max_steps": 6})
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    capsys.readouterr()
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 12}, resume=True,
                 allow_config_change=True)
    out = capsys.readouterr().out
    assert "steps 7-12 (6 of them) run at the LR of its last step, lr 0" in out
    assert out.index("past its LR schedule") < out.index("resumed from")  # before training
    assert "overwrite=True" in out  # fit() speaks Python


def test_the_ignored_override_warns_when_fit_starts(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(), None,
                 cfg(tmp_path, **{"schedule.name": "onecycle", "schedule.max_lr": 0.01,
                                  "optim.lr": 3e-3, "train.max_steps": 2}))
    assert "optim.lr=0.003 has no effect" in capsys.readouterr().out
