"""engine/build.py's parts, in this process: how a checkpoint is put back into a run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ironloop
from ironloop.callbacks import Callback
from ironloop.engine import build
from ironloop.engine.train_module import TrainModule
from ironloop.errors import CheckpointError
from ironloop.state import dcp as sharded
from ironloop.state.checkpointer import Checkpointer, Found
from ironloop.state.run_dir import RunDir
from tests.conftest import tiny_mlp
from tests.test_callbacks import StepCounter


def _trained():
    model = tiny_mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _run(tmp_path, model, opt, schedule_steps: int = 0):
    """The parts of a Run that _restore touches; load_state_dict records what it was given."""
    loaded: list[tuple[dict, str]] = []
    cfg = ironloop.Config().with_overrides({"run.dir": str(tmp_path / "run")})
    run = SimpleNamespace(
        cfg=cfg, outputs=SimpleNamespace(checkpoints=Checkpointer(
            RunDir(tmp_path / "run"), cfg.checkpoint, model=model, optimizer=opt)),
        module=SimpleNamespace(raw_model=model, optimizer=opt, schedule_steps=schedule_steps,
                               hold_onecycle=lambda: loaded.append(({}, "held"))),
        guard=None, tracker=SimpleNamespace(best_weights="stale"),
        load_state_dict=lambda state, source: loaded.append((state, source)))
    return run, loaded


def test_a_sharded_checkpoint_restores_the_model_and_the_optimizer_from_dcp(tmp_path):
    model, opt = _trained()
    manager = sharded.ShardedWriter(tmp_path / "run" / "checkpoints", keep_last=1, model=model,
                                    optimizer=opt)
    manager.save({"progress": {"step": 3}, "model": None, "optimizer": None}, 3, False)
    fresh = tiny_mlp(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    run, loaded = _run(tmp_path, fresh, fresh_opt)
    found = run.outputs.checkpoints.latest()
    path = tmp_path / "run" / "checkpoints" / "last.dcp"
    assert found.path == path
    build._restore(run, found)
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
    assert run.tracker.best_weights == "stale"  # no patience: early stopping restores nothing


def test_fsdp_refuses_a_single_file_checkpoint_naming_the_fix(tmp_path):
    model, opt = _trained()
    run, loaded = _run(tmp_path, model, opt)
    run.outputs.checkpoints.sharded = True  # as for an FSDP2 model: its shards on every rank
    with pytest.raises(CheckpointError) as e:
        build._restore(run, Found(tmp_path / "last.pt", {}))
    assert str(e.value) == (
        f"{tmp_path / 'last.pt'} is a single-file checkpoint (from ddp or one process); "
        "dist.strategy=fsdp resumes only sharded .dcp checkpoints. Resume it with "
        "dist.strategy=ddp")
    assert loaded == []


def test_a_resumed_schedule_keeps_the_checkpoint_s_length(tmp_path):
    model, opt = _trained()
    run, loaded = _run(tmp_path, model, opt, schedule_steps=40)
    TrainModule.resume_schedule(run.module, 25)
    assert run.module.schedule_steps == 25 and loaded[-1] == ({}, "held")
    run, loaded = _run(tmp_path, model, opt, schedule_steps=40)
    TrainModule.resume_schedule(run.module, None)  # an older checkpoint: its own
    assert run.module.schedule_steps == 40 and loaded[-1] == ({}, "held")
    run, loaded = _run(tmp_path, model, opt, schedule_steps=0)
    TrainModule.resume_schedule(run.module, 25)
    assert run.module.schedule_steps == 0 and loaded == []  # no schedule: nothing held


def test_the_metric_prefixes_are_one_per_validation_set_and_weight_set():
    one = SimpleNamespace(val_sets={"": None})
    two = SimpleNamespace(val_sets={"": None, "noisy": None})
    plain, averaged = SimpleNamespace(average=None), SimpleNamespace(average=object())
    assert build._prefixes(one, plain) == ("val_",)
    assert build._prefixes(two, plain) == ("val_", "val_noisy_")
    assert build._prefixes(two, averaged) == ("val_", "val_noisy_", "val_avg_", "val_avg_noisy_")


def test_callbacks_must_come_as_a_list_and_a_lone_callback_is_told_to_be_wrapped():
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


# ------------------------------------------------------------ the built run's parts ----------
def _built(tmp_path, model=None, val=None, given=None, **overrides):
    """What fit() builds before it trains (engine/fit.py), in this process on the CPU: the run
    with every config key wired in. Its outputs are closed by the caller's ``_done``."""
    from ironloop.data.source import open_data
    from ironloop.engine.fit import resolved
    from ironloop.guard.faults import Faults
    from ironloop.parallel.world import World
    from tests.conftest import blobs, cfg

    train = blobs(64)
    config = resolved(ironloop.Config().with_overrides(cfg(tmp_path, **overrides)), train, None,
                      val)
    device, faults = torch.device("cpu"), Faults(config.fault)
    data = open_data(config, train, val, None, 0, 1, device, poison=faults.poison)
    run, strategy = build.build_run(config, model or tiny_mlp(), data, device, World(), "fp32",
                                    given or build.Given(), faults)
    assert strategy == "none"
    return run


def test_each_part_of_the_run_gets_its_config_keys(tmp_path):
    """Non-default values of the keys build.py hands on, read back from the built parts."""
    from tests.conftest import blobs

    run = _built(tmp_path, val=blobs(32, seed=1), train__epochs=3, train__max_steps=5,
                 train__accumulation_steps=2, early_stop__patience=3,
                 early_stop__min_delta=0.25, log__loss_growth=7.5, log__every_steps=3,
                 eval__every_steps=2, checkpoint__every_steps=4, checkpoint__keep_last=2,
                 checkpoint__async=True, profile__breakdown=False,
                 schedule__name="cosine", optim__lr=0.05)
    try:
        t = run.tracker
        assert (t.mode, t.patience, t.min_delta) == ("min", 3, 0.25)
        assert run.outputs.growth.factor == 7.5
        c = run.cadence
        # 64 samples in batches of 32 and 2 micro-batches a step: 1 step an epoch, 3 epochs
        assert (c.log_every, c.eval_every, c.checkpoint_every, c.total_steps, c.validates) == \
            (3, 2, 4, 3, True)
        manager = run.outputs.checkpoints.writer
        assert (manager.directory, manager.keep_last, manager.async_write, manager.mirror) == \
            (tmp_path / "run/checkpoints", 2, True, None)
        assert run.outputs.timer.enabled is False and run.outputs.timer.trace is None
        reporter = run.guard.reporter
        assert (reporter.from_files, reporter.accumulation) == (True, 2)
        m = run.module
        assert (m.total_steps, m.schedule_steps, m.frozen) == (3, 3, False)
    finally:
        run.outputs.close()


def test_without_validation_data_the_run_evaluates_never_and_a_constant_schedule_holds_no_length(
        tmp_path):
    run = _built(tmp_path, eval__every_steps=2, checkpoint__enabled=False, guard__enabled=False,
                 schedule__name="constant")
    try:
        assert (run.cadence.eval_every, run.cadence.validates) == (0, False)
        assert (run.outputs.checkpoints.writes, run.outputs.checkpoints.writer, run.guard) == \
            (False, None, None)
        assert run.outputs.timer.enabled is True
        assert (run.module.total_steps, run.module.schedule_steps) == (4, 0)
    finally:
        run.outputs.close()


def test_the_guard_rolls_back_to_the_checkpoint_file_only_with_checkpoints_on(tmp_path):
    cases = (({}, True), ({"checkpoint__enabled": False}, False),
             ({"guard__rollback_to": "memory"}, False))
    for i, (overrides, from_files) in enumerate(cases):
        run = _built(tmp_path / str(i), **overrides)
        run.outputs.close()
        assert run.guard.reporter.from_files is from_files, overrides


def test_an_lr_of_zero_freezes_the_configured_optimizer_not_a_given_one(tmp_path):
    run = _built(tmp_path, optim__lr=0.0)
    run.outputs.close()
    assert run.module.frozen is True
    model = tiny_mlp()
    given = build.Given(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    run = _built(tmp_path / "given", model=model, given=given, optim__lr=0.0)
    run.outputs.close()
    assert run.module.frozen is False


def test_a_stateful_step_resets_its_carry_as_train_carry_reset_says(tmp_path):
    def step(model, batch, state):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {}

    for reset in ("never", "epoch"):
        run = _built(tmp_path / reset, given=build.Given(step_fn=step),
                     train__carry_reset=reset)
        run.outputs.close()
        assert run.module.carry.reset == reset


class _Watcher(Callback):
    def on_step_end(self, run, metrics):
        pass


def test_a_callback_with_its_own_on_step_end_makes_the_guard_settle_every_step(tmp_path):
    assert build._watches_steps([Callback(), _Watcher()]) is True
    assert build._watches_steps([Callback()]) is False
    assert build._watches_steps([]) is False
    watched = _built(tmp_path / "watched", given=build.Given(callbacks=[_Watcher()]))
    watched.outputs.close()
    plain = _built(tmp_path / "plain", given=build.Given(callbacks=[Callback()]))
    plain.outputs.close()
    assert (watched.guard.reporter.verdicts.always, plain.guard.reporter.verdicts.always) == \
        (True, False)
    # the guard rolls back through the run's checkpointer (it waits for an async write first)
    assert plain.guard.reporter.checkpoints is plain.outputs.checkpoints


def test_batchnorm_with_accumulation_is_warned_about_once_accumulating(capsys):
    from ironloop.parallel.world import World

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    config = ironloop.Config().with_overrides({"train.batch_size": 16,
                                               "train.accumulation_steps": 2})
    build._warn_batchnorm(model, config, World())
    assert capsys.readouterr().out == (
        "warning: the model has BatchNorm and train.accumulation_steps=2: BatchNorm normalises "
        "each micro-batch of 16 separately, so accumulation is not equivalent to a batch of "
        "32\n")
    build._warn_batchnorm(model, config.with_overrides({"train.accumulation_steps": 1}), World())
    build._warn_batchnorm(model, config, World(rank=1, size=2))  # rank 0 says it
    build._warn_batchnorm(tiny_mlp(), config, World())  # no BatchNorm
    assert capsys.readouterr().out == ""


def test_a_run_s_state_loads_back_into_a_fresh_run_part_by_part(tmp_path):
    """Run.state_dict then Run.load_state_dict (a resume, a rollback): progress, meter, tracker,
    the callbacks', the carry, the last evaluation, the LR the last step used, and the guard's
    skip list all come back."""
    from tests.conftest import blobs

    def step(model, batch, state):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {}

    def built(name):
        return _built(tmp_path / name, val=blobs(32, seed=1),
                      given=build.Given(step_fn=step, callbacks=[StepCounter()]))

    old, new = built("old"), built("new")
    try:
        old.progress.epoch, old.progress.step, old.progress.offset = 1, 5, 32
        old.meter.add_micro(torch.tensor(2.0), 4)
        old.tracker.best, old.tracker.best_epoch, old.tracker.bad_epochs = 0.5, 1, 2
        old.hooks.callbacks[0].steps = 5
        old.module.carry.train["n"] = torch.tensor(3.0)
        old.last_eval = {"step": 4, "val_loss": 0.5}
        old.module.lr = 0.0123
        state = {**old.state_dict(), "guard": {"skip": [7, 3]}}
        new.load_state_dict(state, "old's")
        assert new.progress == old.progress
        assert (new.meter.samples, new.meter.loss_sum.item()) == (4, 8.0)
        t = new.tracker
        assert (t.best, t.best_epoch, t.bad_epochs) == (0.5, 1, 2)
        assert new.hooks.callbacks[0].steps == 5
        assert new.module.carry.train["n"].item() == 3.0
        assert new.last_eval == {"step": 4, "val_loss": 0.5}
        assert new.module.lr == 0.0123
        assert new.data.source.sampler.skip.tolist() == [3, 7]
        # a checkpoint from before the LR, the evaluation and the guard were kept
        for key in ("lr", "evaluation", "guard"):
            del state[key]
        new.module.lr = 0.5
        new.load_state_dict(state)
        assert (new.module.lr, new.last_eval) == (0.5, {})
        assert new.data.source.sampler.skip.tolist() == []
    finally:
        old.outputs.close()
        new.outputs.close()


def test_a_run_s_state_holds_its_position_world_size_schedule_length_and_lr(tmp_path):
    """What a checkpoint holds beyond the parts' own states: the sampler's position (epoch and
    offset), the world size the drift check compares, the schedule's length, the last LR."""
    run = _built(tmp_path, schedule__name="cosine", average__kind="ema")
    try:
        run.progress.epoch, run.progress.step, run.progress.offset = 1, 5, 32
        run.module.lr = 0.0123
        state = run.state_dict()
        assert (state["sampler"]["epoch"], state["sampler"]["offset"]) == (1, 32)
        assert state["progress"] == {"epoch": 1, "step": 5, "offset": 32}
        assert (state["world_size"], state["schedule_steps"], state["lr"]) == (1, 4, 0.0123)
        assert state["config"] == run.cfg.to_dict()
        assert state["average"].keys() == run.module.average.state_dict().keys()
        assert state["carry"] is None and state["evaluation"] == {}
        assert state["callbacks"] == {}
    finally:
        run.outputs.close()


def test_a_callback_s_view_of_the_run_is_the_run_s_live_parts(tmp_path):
    run = _built(tmp_path)
    try:
        view = run.view
        assert view is run.view  # one view for the run's life
        assert (view.cfg, view.model, view.optimizer, view.scheduler) == \
            (run.cfg, run.module.raw_model, run.module.optimizer, run.module.scheduler)
        run.progress.step, run.progress.epoch = 3, 1
        assert (view.step, view.epoch, view.world) == (3, 1, run.world)
        assert (view.device, view.precision, view.run_dir) == \
            (torch.device("cpu"), "fp32", tmp_path / "run")
        run.last_eval = {"val_loss": 0.5}
        view.last_eval["val_loss"] = 9.0  # a copy: the run's own row is untouched
        assert run.last_eval == {"val_loss": 0.5}
        assert not run.finished
        view.stop()
        assert run.hooks.stop_requested and run.finished
    finally:
        run.outputs.close()


def test_a_run_is_finished_at_its_last_step_or_when_early_stopping_says(tmp_path):
    # 64 samples in batches of 32, 2 micro-batches a step: 1 step an epoch, 3 steps
    from tests.conftest import blobs

    run = _built(tmp_path, val=blobs(32, seed=1), train__epochs=3,
                 train__accumulation_steps=2, early_stop__patience=1)
    try:
        run.progress.step = 2
        assert not run.finished
        run.progress.step = 3
        assert run.finished
        run.progress.step = 0
        run.tracker.bad_epochs = 1
        assert run.finished
        assert tuple(run.plan()) == (3, 1, 3, 64, True)  # epoch_known: map-style
    finally:
        run.outputs.close()
