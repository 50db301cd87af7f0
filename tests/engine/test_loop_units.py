"""The loop's exact outputs, in process on a tiny model: what each step hands on_step_end,
the cadence of metrics.jsonl and evals.jsonl, the end of a max_steps run, a preemption's
events line, and the error a missing early_stop.metric gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import ironloop
from ironloop.callbacks import Callback
from ironloop.engine import loop
from ironloop.engine.preempt import Preempted
from ironloop.errors import ConfigError
from ironloop.outputs.readers import read_jsonl
from tests.conftest import blobs, cfg, tiny_mlp


class Rows(Callback):
    """Records what each hook gets."""

    def __init__(self):
        self.steps: list[dict] = []
        self.saves: list[dict] = []

    def on_step_end(self, run, metrics: dict) -> None:
        self.steps.append(dict(metrics))

    def on_checkpoint(self, run, metrics: dict) -> None:
        self.saves.append(dict(metrics))


def test_a_step_that_does_not_log_hands_on_step_end_only_its_step_and_1_based_epoch(tmp_path):
    rows = Rows()
    # 64 samples in batches of 16: 4 steps an epoch, 2 epochs; a log line every 3rd step
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__batch_size=16, log__every_steps=3), callbacks=[rows])
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in logged] == [(3, 1), (6, 2)]
    quiet = [r for r in rows.steps if r["step"] % 3]
    assert quiet == [{"step": 1, "epoch": 1}, {"step": 2, "epoch": 1},
                     {"step": 4, "epoch": 1}, {"step": 5, "epoch": 2},
                     {"step": 7, "epoch": 2}, {"step": 8, "epoch": 2}]
    # a log step hands on_step_end the metrics.jsonl line itself
    assert [r for r in rows.steps if r["step"] % 3 == 0] == logged


def test_a_log_line_holds_the_step_s_loss_lr_and_time(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__epochs=1, train__batch_size=32, optim__lr=0.02))
    first, second = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert (first["step"], first["epoch"], second["step"], second["epoch"]) == (1, 1, 2, 1)
    assert first["lr"] == second["lr"] == 0.02  # the default schedule is constant
    assert first["loss"] > 0 and isinstance(first["time"], float)
    assert first["time"] <= second["time"]


def test_a_max_steps_run_without_validation_saves_where_it_stopped(tmp_path):
    rows = Rows()
    ironloop.fit(tiny_mlp(), blobs(200), None, cfg(tmp_path, train__max_steps=3),
                 callbacks=[rows])
    assert [s["step"] for s in rows.saves] == [3]


def test_a_max_steps_run_that_just_saved_at_its_last_step_saves_it_once(tmp_path):
    rows = Rows()
    ironloop.fit(tiny_mlp(), blobs(200), None,
                 cfg(tmp_path, train__max_steps=4, checkpoint__every_steps=2), callbacks=[rows])
    assert [s["step"] for s in rows.saves] == [2, 4]


def test_a_max_steps_run_evaluates_its_final_weights_once_and_says_so(tmp_path, capsys):
    rows = Rows()
    ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1), cfg(tmp_path, train__max_steps=3),
                 callbacks=[rows])
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [(e["step"], e["epoch"]) for e in evals] == [(3, 1)]
    assert "final evaluation at step 3/3 (epoch 1): val_loss" in capsys.readouterr().out
    assert [s["step"] for s in rows.saves] == [3]


def test_a_max_steps_run_evaluated_at_its_last_step_is_not_evaluated_again(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1),
                 cfg(tmp_path, train__max_steps=4, eval__every_steps=2))
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [e["step"] for e in evals] == [2, 4]
    out = capsys.readouterr().out
    assert "eval at step 4/4 (epoch 1)" in out and "final evaluation" not in out


def test_a_monitored_metric_a_user_s_step_does_not_report_names_the_ones_it_does(tmp_path):
    def step(m, batch):  # a user's step: its metric names are known at its first evaluation
        loss = nn.functional.cross_entropy(m(batch[0]), batch[1])
        return loss, {"top1": loss.detach() * 0}

    with pytest.raises(ConfigError) as e:
        ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                     cfg(tmp_path, train__epochs=1, early_stop__metric="val_f1"), step_fn=step)
    assert str(e.value) == ("early_stop.metric='val_f1': this run reports val_loss, val_top1; "
                            "monitor one of those")


# --- a preemption, on a stand-in run ---------------------------------------------------------

def _preempting_run(enabled: bool, manager, saved_by_cadence: bool):
    """A run at step 5 of epoch index 1 that a signal stopped: what loop._preempted reads."""
    written, saves = [], []
    run = SimpleNamespace(
        hooks=SimpleNamespace(preempt=SimpleNamespace(
            saving=lambda: None,
            stopped=lambda step, saved: Preempted("SIGTERM", step, saved))),
        progress=SimpleNamespace(step=5, epoch=1),
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(enabled=enabled)),
        settle=lambda: False,
        cadence=SimpleNamespace(saves=lambda step: saved_by_cadence),
        save=saves.append,
        outputs=SimpleNamespace(checkpoints=manager,
                                write=lambda name, row: written.append((name, row))))
    return run, written, saves


class Manager:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


def test_a_preempted_step_is_saved_waited_for_and_recorded_in_events(monkeypatch):
    monkeypatch.setattr(loop.time, "time", lambda: 1234.5)
    manager = Manager()
    run, written, saves = _preempting_run(True, manager, saved_by_cadence=False)
    with pytest.raises(Preempted):
        loop._preempted(run)
    assert saves == [False] and manager.waited == 1
    assert written == [("events", {"event": "preempted", "signal": "SIGTERM", "step": 5,
                                   "epoch": 2, "saved": True, "time": 1234.5})]


def test_a_rank_without_a_checkpoint_manager_is_preempted_without_waiting_on_one():
    # under DDP only rank 0 writes checkpoints: the others have no manager
    run, written, saves = _preempting_run(True, None, saved_by_cadence=True)
    with pytest.raises(Preempted):
        loop._preempted(run)
    assert saves == [] and written[0][1]["saved"] is True


def test_a_run_without_checkpoints_is_preempted_unsaved():
    run, written, saves = _preempting_run(False, None, saved_by_cadence=False)
    with pytest.raises(Preempted):
        loop._preempted(run)
    assert saves == [] and written[0][1]["saved"] is False


# --- validation sets ---------------------------------------------------------------------

def _eval_batch_sizes(seen: list):
    """A step that records the size of every batch it evaluates."""
    def step(m, batch):
        if not m.training:
            seen.append(len(batch[1]))
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}
    return step


def test_a_validation_dataloader_keeps_its_own_batch_size_in_every_evaluation(tmp_path):
    seen: list[int] = []
    val = DataLoader(blobs(25, seed=1), batch_size=10)
    ironloop.fit(tiny_mlp(), blobs(64), val, cfg(tmp_path, train__epochs=1),
                 step_fn=_eval_batch_sizes(seen))
    assert seen == [10, 10, 5]  # not train.batch_size's 32


def test_named_validation_sets_are_each_batched_as_given(tmp_path):
    seen: list[int] = []
    val = {"a": DataLoader(blobs(25, seed=1), batch_size=10), "b": blobs(40, seed=2)}
    ironloop.fit(tiny_mlp(), blobs(64), val, cfg(tmp_path, train__epochs=1),
                 step_fn=_eval_batch_sizes(seen))
    assert seen == [10, 10, 5, 32, 8]
    row = read_jsonl(tmp_path / "run" / "evals.jsonl")[0]
    assert [k for k in row if k.startswith("val_")] == ["val_a_loss", "val_b_loss"]


def test_an_epoch_line_carries_the_guard_s_totals_once_a_step_was_bad(tmp_path):
    # 64 samples in batches of 16: steps 1-4 are epoch 1, 5-8 epoch 2; step 6's loss is NaN
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__batch_size=16, fault__nan_at_step=[6]))
    first, second = read_jsonl(tmp_path / "run" / "epochs.jsonl")
    assert "bad_steps" not in first  # no news yet
    assert (second["bad_steps"], second["rollbacks"]) == (1, 0)


def test_a_patience_of_1_stops_at_the_first_worse_evaluation_and_restores_the_best(tmp_path):
    train, val = blobs(128), blobs(64, seed=1)
    val = type(val)(val.x, (val.y + 1) % 3)  # val disagrees with train: val loss worsens
    model = tiny_mlp()
    result = ironloop.fit(model, train, val, cfg(tmp_path, train__epochs=20, optim__lr=0.01,
                                                 early_stop__patience=1))
    epochs = read_jsonl(tmp_path / "run" / "epochs.jsonl")
    assert result.results["stopped_early"] and result.results["restored_best"]
    assert epochs[-1]["val_loss"] > epochs[-2]["val_loss"]  # one worse evaluation ended it
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)["model"]
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())
