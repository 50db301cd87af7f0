"""Config drift on resume: refused trajectory changes, free keys, and extending a run."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch

import ironloop
from ironloop.errors import ConfigError
from ironloop.state import drift
from tests.conftest import blobs, cfg, tiny_mlp


def test_free_keys_pass_with_a_notice_and_trajectory_keys_are_refused():
    old = {"log": {"every_steps": 10}, "optim": {"lr": 1e-3}, "run": {"dir": "a", "seed": 0}}
    said = []
    drift.check(old, {**old, "log": {"every_steps": 1}, "run": {"dir": "b", "seed": 0}},
                allow=False, say=said.append)
    assert len(said) == 2 and all("cannot change the weights" in s for s in said)
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.001 -> 0\.01.*--allow-config-change"):
        drift.check(old, {**old, "optim": {"lr": 1e-2}}, allow=False)
    assert drift.check(old, {**old, "optim": {"lr": 1e-2}}, allow=True, say=said.append)


def test_a_new_section_is_a_trajectory_key_unless_listed_free():
    assert not drift.is_free("guard.max_bad_steps") and not drift.is_free("eval.every_steps")
    assert drift.is_free("log.wandb_project") and drift.is_free("checkpoint.keep_last")
    assert not drift.is_free("train.max_steps") and not drift.is_free("run.seed")
    # a key only one side has (an upgrade added a section) is not a change
    assert drift.changes({"train": {"epochs": 1}}, {"train": {"epochs": 1}, "guard": {"x": 1}}) \
        == []


def test_a_new_allocation_may_change_the_per_rank_batch_but_not_the_global_one():
    old = {"train": {"batch_size": 16, "accumulation_steps": 2}, "dist": {"strategy": "fsdp"}}
    said = []
    # 2 ranks x 16 x 2 = 64 samples per step, resumed on 1 rank as 64 x 1: the same trajectory
    drift.check(old, {"train": {"batch_size": 64, "accumulation_steps": 1},
                      "dist": {"strategy": "auto"}}, allow=False, say=said.append, worlds=(2, 1))
    assert len(said) == 3 and sum("the same 64 samples per optimizer step" in x for x in said) == 2
    # on the same allocation, 64 x 1 instead of 16 x 2 doubles the step: refused
    with pytest.raises(ConfigError, match=r"train\.batch_size: 16 -> 64"):
        drift.check(old, {"train": {"batch_size": 64, "accumulation_steps": 1}}, allow=False,
                    worlds=(2, 2))


def test_each_accepted_change_is_told_with_why_it_is_safe_or_what_it_does():
    old = {"train": {"epochs": 2, "batch_size": 8, "accumulation_steps": 1},
           "optim": {"lr": 0.1, "weight_decay": 0.0}, "schedule": {"name": "cosine"},
           "model": {"name": "mlp", "kwargs": {"hidden": 4}}, "log": {"every_steps": 5}}
    new = {"train": {"epochs": 3, "batch_size": 4, "accumulation_steps": 2},
           "optim": {"lr": 0.0, "weight_decay": 0.1}, "schedule": {"name": "cosine"},
           "model": {"name": "mlp", "kwargs": {"hidden": 8}}, "log": {"every_steps": 1}}
    said: list[str] = []
    bound = drift.check(old, new, allow=True, say=said.append)
    assert bound == [("train.epochs", 2, 3), ("optim.weight_decay", 0.0, 0.1),
                     ("model.kwargs", {"hidden": 4}, {"hidden": 8})]
    assert said == [
        "notice: resuming with train.batch_size: 8 -> 4 (the same 8 samples per optimizer step "
        "over 1 rank(s))",
        "notice: resuming with train.accumulation_steps: 1 -> 2 (the same 8 samples per "
        "optimizer step over 1 rank(s))",
        "notice: resuming with optim.lr: 0.1 -> 0.0 (every step from here runs at LR 0: the "
        "weights stay as they are)",
        "notice: resuming with log.every_steps: 5 -> 1 (cannot change the weights)",
        "notice: --allow-config-change: train.epochs: 2 -> 3 (the run's length; the LR schedule "
        "keeps the length it was built with)",
        "notice: --allow-config-change: optim.weight_decay: 0.0 -> 0.1 (values held in the "
        "optimizer or scheduler state keep the checkpoint's)",
        "notice: --allow-config-change: model.kwargs: {'hidden': 4} -> {'hidden': 8} (applies "
        "from the resumed step on)",
    ]


def test_a_dict_valued_key_is_one_value_and_a_key_only_one_side_has_is_no_change():
    tree = {"model": {"name": "mlp", "kwargs": {"hidden": {"width": 4}}}, "seed": 1}
    assert drift.flatten(tree) == {"model.name": "mlp", "model.kwargs": {"hidden": {"width": 4}},
                                   "seed": 1}
    assert drift.changes({"guard": {"on": True}, "seed": 1}, {"seed": 2}) == [("seed", 1, 2)]
    assert drift.global_window({"train": {"batch_size": 8}}, 2) is None
    assert drift.global_window({"train": {"accumulation_steps": 2}}, 2) is None
    assert drift.global_window({"train": {"batch_size": 8, "accumulation_steps": 3}}, 2) == 48


def test_a_per_rank_batch_change_without_a_recorded_window_is_refused():
    old, new = {"train": {"batch_size": 8}}, {"train": {"batch_size": 4}}
    with pytest.raises(ConfigError, match=r"train\.batch_size: 8 -> 4"):
        drift.check(old, new, allow=False)
    assert drift.check({"optim": {"lr": 0.1}}, {"optim": {"lr": 0.0}}, allow=False,
                       say=lambda _: None) == []  # LR 0 freezes the weights: free
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.0 -> 0\.1"):  # unfreezing is not
        drift.check({"optim": {"lr": 0.0}}, {"optim": {"lr": 0.1}}, allow=False)


def lrs(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["lr"] for r in rows]


def test_extending_max_steps_is_refused_then_continues_the_lr_curve(tmp_path):
    conf = cfg(tmp_path, train__epochs=4, schedule__name="cosine", schedule__eta_min=1e-4,
               optim__lr=1e-2, checkpoint__every_steps=3)
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 9})
    before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"train\.max_steps: 9 -> 20"):
        ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 20}, resume=True)
    assert (tmp_path / "run" / "config.yaml").read_text() == before  # refused before writing
    res = ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 20}, resume=True,
                       allow_config_change=True)
    assert res.results["steps"] == 20
    lr = lrs(tmp_path / "run")
    first = lr[:9]
    assert all(a > b for a, b in pairwise(first))  # the 9-step cosine, decaying
    # The schedule keeps its 9-step length: past it the LR holds where the cosine ends
    # (eta_min), with no jump and no climb back up.
    assert lr[9:] == pytest.approx([1e-4] * 11)
    biggest_step = max(abs(a - b) for a, b in pairwise(first))
    assert abs(lr[9] - lr[8]) <= biggest_step


@pytest.mark.parametrize("crash", [False, True])
def test_extending_a_onecycle_run_holds_the_lr_of_its_last_step(tmp_path, crash):
    conf = cfg(tmp_path, train__epochs=3, schedule__name="onecycle", checkpoint__every_steps=3,
               checkpoint__keep_last=5)
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 8})
    resume = str(tmp_path / "run" / "checkpoints" / "step-00000006.pt") if crash else True
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 14}, resume=resume,
                 allow_config_change=True)
    lr = lrs(tmp_path / "run")
    assert len(lr) == 14 and lr[7] < lr[6] < lr[5]  # onecycle's 8 steps, annealing
    assert lr[8:] == [lr[7]] * 6  # then held at its last step's LR, whichever the checkpoint


def test_max_steps_mid_epoch_then_a_longer_resume_continues_the_same_epoch(tmp_path):
    # 7 steps per epoch; max_steps=4 stops inside epoch 1.
    conf = cfg(tmp_path, train__epochs=2, train__max_steps=10)
    full = ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "run.dir": str(tmp_path / "full")})
    short = ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 4})
    assert not (tmp_path / "run" / "epochs.jsonl").read_text()  # epoch 1 is still open
    assert short.results["epochs"] == 1 and short.results["stopped_mid_epoch"]["epoch"] == 1
    model = tiny_mlp()
    ironloop.fit(model, blobs(), None, conf, resume=True, allow_config_change=True)
    for k, v in full.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k  # same epoch, same order
    epochs = [json.loads(x) for x in (tmp_path / "run" / "epochs.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["step"]) for e in epochs] == [(1, 7)]


def test_a_resume_with_other_threads_goes_on_with_a_notice(tmp_path, capsys):
    """run.threads is FREE: the same math split over other threads (CPU reductions may round
    differently in the last bits, as on another device), so a resume on a machine with other
    cores is not refused."""
    assert drift.is_free("run.threads")
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1, run__threads=1),
                 resume=True)
    assert "notice: resuming with run.threads: 0 -> 1 (cannot change the weights)" in \
        capsys.readouterr().out
