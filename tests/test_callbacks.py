"""The callback protocol: hook order, the metrics each hook gets, logging, checkpointed state."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ironloop
from ironloop.callbacks import Callback
from ironloop.errors import CheckpointError, UserError
from ironloop.outputs.readers import read_jsonl
from tests.conftest import blobs, cfg, tiny_mlp


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def _rec(name):
        def hook(self, run, metrics):
            self.calls.append((name, metrics))
        return hook

    on_train_start = _rec("train_start")
    on_step_end = _rec("step")
    on_eval_end = _rec("eval")
    on_epoch_end = _rec("epoch")
    on_checkpoint = _rec("checkpoint")
    on_train_end = _rec("train_end")


def test_hooks_fire_in_the_documented_order_with_their_metrics(tmp_path):
    rec = Recorder()
    # 200 samples, batch 32: 7 steps an epoch; log every 2nd step
    result = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                          cfg(tmp_path, train__epochs=2, log__every_steps=2), callbacks=[rec])
    names = [n for n, _ in rec.calls]
    epoch = ["step"] * 7 + ["eval", "epoch", "checkpoint"]
    assert names == ["train_start", *epoch, *epoch, "train_end"]
    steps = [m for n, m in rec.calls if n == "step"]
    assert [m["step"] for m in steps] == list(range(1, 15))
    assert "loss" in steps[1] and "loss" not in steps[0]  # the metrics row on log steps only
    evals = [m for n, m in rec.calls if n == "eval"]
    assert evals[0]["step"] == 7 and "val_loss" in evals[0] and "val_acc" in evals[0]
    epochs = [m for n, m in rec.calls if n == "epoch"]
    assert epochs[1]["epoch"] == 2 and epochs[1]["val_loss"] == evals[1]["val_loss"]
    saves = [m for n, m in rec.calls if n == "checkpoint"]  # the epoch ends' checkpoints
    assert [(m["step"], m["epoch"]) for m in saves] == [(7, 1), (14, 2)]
    assert all(set(m) == {"step", "epoch", "best"} for m in saves)
    assert rec.calls[0][1] == {"step": 0, "epoch": 0}
    (best,) = result.results["monitor"].values()  # the monitored metric's best
    assert rec.calls[-1][1] == {"step": 14, "epoch": 2, "best": best} and math.isfinite(best)


def test_a_callback_logs_its_own_scalars(tmp_path):
    class Custom(Callback):
        def on_eval_end(self, run, metrics):
            run.log_scalars({"double_val": 2 * metrics["val_loss"], "note": "text is fine"})

    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path, train__epochs=2),
                 callbacks=[Custom()])
    rows = read_jsonl(tmp_path / "run" / "scalars.jsonl")
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [r["step"] for r in rows] == [7, 14] and rows[0]["note"] == "text is fine"
    assert [r["double_val"] for r in rows] == [2 * e["val_loss"] for e in evals]
    # each row is stamped as the run's own logs are: the 1-based epoch and the wall time
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(isinstance(r["time"], float) for r in rows)


def test_scalars_logged_at_an_epoch_end_carry_the_epoch_that_ended(tmp_path):
    class AtEnds(Callback):
        def on_epoch_end(self, run, metrics):
            run.log_scalars({"hook": "epoch_end", "of": metrics["epoch"]})

        def on_checkpoint(self, run, metrics):
            run.log_scalars({"hook": "checkpoint", "of": metrics["epoch"]})

        def on_train_end(self, run, metrics):
            run.log_scalars({"hook": "train_end", "of": metrics["epoch"]})

    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path, train__epochs=2),
                 callbacks=[AtEnds()])
    rows = read_jsonl(tmp_path / "run" / "scalars.jsonl")
    assert [r["hook"] for r in rows] == ["epoch_end", "checkpoint"] * 2 + ["train_end"]
    # the epochs.jsonl row's epoch, not the next one (3 in a 2-epoch run)
    assert [r["epoch"] for r in rows] == [1, 1, 2, 2, 2]
    assert [r["epoch"] for r in rows[:4]] == [r["of"] for r in rows[:4]]


class StepCounter(Callback):
    """Stateful: counts the optimizer steps it saw, across a resume."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, run, metrics):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_callback_state_is_checkpointed_and_resumed(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=5, checkpoint__keep_last=10)
    full = StepCounter()
    ironloop.fit(tiny_mlp(), blobs(), None, conf, callbacks=[full])
    assert full.steps == 14
    resumed = StepCounter()
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "run.dir": str(tmp_path / "b")},
                 callbacks=[resumed],
                 resume=str(tmp_path / "run" / "checkpoints" / "step-00000005.pt"))
    assert resumed.steps == 14  # 5 restored from the checkpoint + 9 seen after it


class NumpyBest(Callback):
    """Keeps the best loss as a numpy scalar, as ``np.min(losses)`` returns it."""

    def __init__(self):
        self.best = {"loss": np.float64(1.5), "seen": [1, 2]}

    def on_step_end(self, run, metrics):
        pass

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state):
        self.best = state["best"]


def test_a_callback_state_a_checkpoint_cannot_load_fails_at_the_first_save_naming_it(
        tmp_path):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=5)
    with pytest.raises(CheckpointError, match=r"^callback 1:NumpyBest: its state_dict holds "
                                              r"np\.float64\(1\.5\) \(numpy\.float64\) at "
                                              r"\['best'\]\['loss'\], which a checkpoint "
                                              r"cannot load back .*\(float\(x\)"):
        ironloop.fit(tiny_mlp(), blobs(), None, conf, callbacks=[StepCounter(), NumpyBest()])
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*.pt"))


def test_an_object_with_no_hooks_is_refused(tmp_path):
    with pytest.raises(UserError, match="none of the hooks"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path), callbacks=[object()])


class StopAt(Callback):
    """Asks the run to stop from one hook, at one step or epoch."""

    def __init__(self, hook: str, at: int):
        self.hook, self.at = hook, at

    def on_step_end(self, run, metrics):
        if self.hook == "step" and run.step == self.at:
            run.stop()

    def on_epoch_end(self, run, metrics):
        if self.hook == "epoch" and run.epoch == self.at:
            run.stop()


def test_a_callback_stops_the_run_after_an_epoch_with_the_schedule_unchanged(tmp_path):
    # 200 samples, batch 32: 7 steps an epoch; a 3-epoch OneCycle stopped after epoch 1
    conf = cfg(tmp_path, train__epochs=3, schedule__name="onecycle", schedule__max_lr=0.01)
    stopped = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), conf,
                           callbacks=[StopAt("epoch", 1)])
    whole = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                         {**conf, "run.dir": str(tmp_path / "whole")})
    assert stopped.results["stopped_by_callback"] and not whole.results["stopped_by_callback"]
    assert stopped.results["steps"] == 7 and stopped.results["epochs"] == 1
    ran = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    full = read_jsonl(tmp_path / "whole" / "metrics.jsonl")[:7]
    # the same first epoch as the whole run: OneCycle still spans 3 epochs, not 1
    assert [r["lr"] for r in ran] == [r["lr"] for r in full]
    assert read_jsonl(tmp_path / "run" / "epochs.jsonl")[0]["val_acc"] == \
        read_jsonl(tmp_path / "whole" / "epochs.jsonl")[0]["val_acc"]


def test_a_callback_stops_the_run_mid_epoch_evaluated_and_checkpointed(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__keep_last=5)
    res = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), conf,
                       callbacks=[StopAt("step", 3)])
    assert res.results["steps"] == 3 and res.results["stopped_mid_epoch"]["epoch"] == 1
    assert read_jsonl(tmp_path / "run" / "evals.jsonl")[-1]["step"] == 3
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()
