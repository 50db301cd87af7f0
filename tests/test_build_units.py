"""engine/build.py's parts, in this process: how a checkpoint is put back into a run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ironloop
from ironloop.engine import build
from ironloop.errors import CheckpointError
from ironloop.state import dcp as sharded
from tests.conftest import tiny_mlp


def _trained():
    model = tiny_mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _run(tmp_path, model, opt, schedule_steps: int = 0):
    """The parts of a Run that _restore touches; load_state_dict records what it was given."""
    loaded: list[tuple[dict, str]] = []
    run = SimpleNamespace(
        cfg=ironloop.Config().with_overrides({"run.dir": str(tmp_path / "run")}),
        module=SimpleNamespace(raw_model=model, optimizer=opt, schedule_steps=schedule_steps,
                               hold_onecycle=lambda: loaded.append(({}, "held"))),
        guard=None, tracker=SimpleNamespace(best_weights="stale"),
        load_state_dict=lambda state, source: loaded.append((state, source)))
    return run, loaded


def test_a_sharded_checkpoint_restores_the_model_and_the_optimizer_from_dcp(tmp_path):
    manager = sharded.ShardedCheckpointManager(tmp_path / "ck", keep_last=1)
    model, opt = _trained()
    manager.save({"progress": {"step": 3}, "model": None, "optimizer": None}, model, opt, 3,
                 False)
    path, state = sharded.latest_valid(tmp_path / "ck", warn=pytest.fail)
    fresh = tiny_mlp(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    run, loaded = _run(tmp_path, fresh, fresh_opt)
    build._restore(run, state, str(path), "none")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    want = opt.state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"], want, rtol=0,
                               atol=0)
    # the rest of the run is loaded from the extras plus what DCP put back, naming the source
    (resumed, source), = loaded
    assert source == str(path) and resumed["progress"] == {"step": 3}
    torch.testing.assert_close(resumed["optimizer"]["state"][0]["exp_avg"], want, rtol=0, atol=0)
    assert resumed["model"].keys() == model.state_dict().keys()
    assert run.tracker.best_weights is None  # no best.pt (and no patience): nothing to restore


def test_fsdp_refuses_a_single_file_checkpoint_naming_the_fix(tmp_path):
    model, opt = _trained()
    run, loaded = _run(tmp_path, model, opt)
    with pytest.raises(CheckpointError) as e:
        build._restore(run, {}, str(tmp_path / "last.pt"), "fsdp")
    assert str(e.value) == (
        f"{tmp_path / 'last.pt'} is a single-file checkpoint (from ddp or one process); "
        "dist.strategy=fsdp resumes only sharded .dcp checkpoints. Resume it with "
        "dist.strategy=ddp")
    assert loaded == []


def test_a_resumed_schedule_keeps_the_checkpoint_s_length(tmp_path):
    model, opt = _trained()
    run, loaded = _run(tmp_path, model, opt, schedule_steps=40)
    build._restore(run, {"schedule_steps": 25}, str(tmp_path / "last.pt"), "ddp")
    assert run.module.schedule_steps == 25 and loaded[-1] == ({}, "held")
    run, loaded = _run(tmp_path, model, opt, schedule_steps=40)
    build._restore(run, {}, str(tmp_path / "last.pt"), "none")  # an older checkpoint: its own
    assert run.module.schedule_steps == 40 and loaded[-1] == ({}, "held")
    run, loaded = _run(tmp_path, model, opt, schedule_steps=0)
    build._restore(run, {"schedule_steps": 25}, str(tmp_path / "last.pt"), "none")
    assert run.module.schedule_steps == 0 and len(loaded) == 1  # no schedule: nothing held


def test_the_metric_prefixes_are_one_per_validation_set_and_weight_set():
    one = SimpleNamespace(val_sets={"": None})
    two = SimpleNamespace(val_sets={"": None, "noisy": None})
    plain, averaged = SimpleNamespace(average=None), SimpleNamespace(average=object())
    assert build._prefixes(one, plain) == ("val_",)
    assert build._prefixes(two, plain) == ("val_", "val_noisy_")
    assert build._prefixes(two, averaged) == ("val_", "val_noisy_", "val_avg_", "val_avg_noisy_")


def test_callbacks_must_come_as_a_list_and_a_lone_callback_is_told_to_be_wrapped():
    from ironloop.callbacks import Callback
    from ironloop.errors import UserError

    assert build._as_list(None) == [] and build._as_list(()) == []
    lone = Callback()
    assert build._as_list((lone,)) == [lone]
    with pytest.raises(UserError) as single:
        build._as_list(lone)
    assert str(single.value) == (f"callbacks={lone!r:.60}: must be a list of callbacks, not "
                                 "Callback; wrap it in one: callbacks=[...]")
    with pytest.raises(UserError) as number:
        build._as_list(5)
    assert str(number.value) == ("callbacks=5: must be a list of callbacks, not int; pass "
                                 "[MyCallback(), ...] (ironloop.callbacks.Callback subclasses)")
