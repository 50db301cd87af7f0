"""Bring your own optimizer, scheduler, data, step and loss: from fit() and from the CLI."""

from __future__ import annotations

import pytest
import torch

import ironloop
from ironloop.checkpoint import load_verified
from ironloop.config import Config
from ironloop.errors import ConfigError, UserError
from ironloop.report import read_jsonl
from tests.conftest import blobs, cfg, tiny_mlp


def _saved_optimizer(tmp_path, name="run"):
    return load_verified(tmp_path / name / "checkpoints" / "last.pt")["optimizer"]


# --- optimizer and scheduler --------------------------------------------------------------

def test_optim_betas_eps_and_kernels_from_config_reach_adamw(tmp_path):
    conf = cfg(tmp_path, train__epochs=1, optim__betas=[0.9, 0.95], optim__eps=1e-6,
               optim__foreach=False)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    groups = _saved_optimizer(tmp_path)["param_groups"]
    assert len(groups) == 2  # the built-in grouping (no decay for ndim < 2) stays the default
    assert all(tuple(g["betas"]) == (0.9, 0.95) and g["eps"] == 1e-6 and g["foreach"] is False
               for g in groups)


def test_optim_defaults_keep_torchs_adamw_and_validate():
    c = Config()
    assert c.optim.betas == [0.9, 0.999] and c.optim.eps == 1e-8
    assert c.optim.fused is None and c.optim.foreach is None
    assert Config().with_overrides(["optim.fused=true"]).optim.fused is True
    assert Config().with_overrides(["optim.fused=null"]).optim.fused is None
    with pytest.raises(ConfigError, match=r"optim.betas=.*two numbers in \[0, 1\)"):
        Config().with_overrides(["optim.betas=[0.9, 1.5]"])
    with pytest.raises(ConfigError, match="optim.fused"):
        Config().with_overrides(["optim.fused=yes please"])


def test_user_optimizer_object_is_used_as_is(tmp_path):
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ironloop.fit(model, blobs(), None, cfg(tmp_path, train__epochs=1), optimizer=opt)
    groups = _saved_optimizer(tmp_path)["param_groups"]
    assert len(groups) == 1 and tuple(groups[0]["betas"]) == (0.9, 0.95)
    assert groups[0]["weight_decay"] == 0.1 and opt.state  # it took steps


def test_user_optimizer_of_another_model_is_refused(tmp_path):
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    with pytest.raises(UserError, match="none of the model's parameters"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path), optimizer=opt)


def test_scheduler_object_bound_to_another_optimizer_is_refused(tmp_path):
    other = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 5)
    with pytest.raises(UserError, match="another optimizer"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path), scheduler=sched)


def _factories():
    opt = lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95))  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)  # noqa: E731
    return opt, sched


def test_user_optimizer_and_scheduler_factories_resume_bit_exact(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=5, checkpoint__keep_last=10,
               log__every_steps=1)
    opt, sched = _factories()
    full = ironloop.fit(tiny_mlp(), blobs(), None, conf, optimizer=opt, scheduler=sched)
    lrs = [r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert lrs[:7] == [1e-2] * 3 + [5e-3] * 3 + [2.5e-3]  # StepLR stepped once per step
    model = tiny_mlp()
    opt, sched = _factories()
    step5 = tmp_path / "run" / "checkpoints" / "step-00000005.pt"
    ironloop.fit(model, blobs(), None, {**conf, "run.dir": str(tmp_path / "b")},
                 optimizer=opt, scheduler=sched, resume=str(step5))
    for k, v in full.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    a, b = _saved_optimizer(tmp_path), _saved_optimizer(tmp_path, "b")
    assert a["param_groups"][0]["lr"] == b["param_groups"][0]["lr"]
    for i, st in a["state"].items():
        assert torch.equal(st["exp_avg_sq"], b["state"][i]["exp_avg_sq"])


def test_user_plateau_scheduler_steps_per_evaluation_with_the_metric(tmp_path):
    seen = []

    class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics):  # noqa: D102 - records what the loop passes
            seen.append(metrics)
            super().step(metrics)

    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path, train__epochs=3),
                 scheduler=lambda o: Plateau(o, patience=0))
    vals = [r["val_loss"] for r in read_jsonl(tmp_path / "run" / "epochs.jsonl")]
    assert seen == vals  # once per evaluation (here: per epoch), with val_loss
