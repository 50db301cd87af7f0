"""Models that break when deep-copied (issue 59, item 3): minGPT/makemore's ``Block`` calls its
MLP through ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))``, a closure over the original
module. The test split's best weights and the doctor's checks use the live model (its state put
back after); weight averaging, which must copy, refuses such a model before training."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ironloop
from ironloop.errors import UserError
from ironloop.state.io import load_verified
from tests.conftest import blobs, cfg


class ClosureNet(nn.Module):
    """minGPT's Block pattern: the MLP is reached only through a lambda attribute."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(8, 16), act=nn.ReLU(),
                                      c_proj=nn.Linear(16, 8)))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(x + self.mlpf(x))


def test_the_best_weights_test_loss_is_best_pts_and_the_preflight_sees_no_dead_layer(tmp_path):
    # mode=max: the first, worst epoch is the best, so the best and last weights differ. A deep
    # copy loaded with best.pt ran the head's best weights and the MLP's last ones: a hybrid.
    test = blobs(n=48, seed=2)
    model = ClosureNet()
    result = ironloop.fit(model, blobs(), blobs(n=64, seed=1),
                          cfg(tmp_path, train__epochs=3, early_stop__mode="max",
                              doctor__preflight=True), test_data=test)
    best = ClosureNet()
    best.load_state_dict(load_verified(tmp_path / "run/checkpoints/best.pt")["model"])
    with torch.no_grad():
        on_best = F.cross_entropy(best(test.x), test.y).item()
        on_last = F.cross_entropy(model(test.x), test.y).item()
    r = result.results
    assert r["test_weights"] == "best" and r["test_loss"] == pytest.approx(on_best, rel=1e-6)
    assert abs(on_best - on_last) > 1e-3  # the last weights (kept by the model) differ
    final = ClosureNet()  # final.safetensors and the live model: the last weights, put back
    from safetensors.torch import load_file
    final.load_state_dict(load_file(tmp_path / "run/final.safetensors"))
    for name, p in final.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name
    findings = json.loads((tmp_path / "run/doctor.json").read_text())
    dead = [f for f in findings["findings"] if f["check"] == "dead_parameters"]
    assert dead and all(f["severity"] != "warning" for f in dead), dead


def test_the_doctors_checks_leave_the_live_model_as_it_was_handed_over(tmp_path):
    from ironloop.tools.doctor.run import check, subject

    model = ClosureNet().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from ironloop.config import Config

    check(subject(model, blobs(), None, None, Config(), num_classes=3))
    assert not model.training and all(p.grad is None for p in model.parameters())
    for name, p in model.state_dict().items():
        assert torch.equal(p, before[name]), name


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_weight_averaging_refuses_a_forward_that_reaches_outside_its_copy(tmp_path, kind):
    with pytest.raises(UserError, match=rf"average.kind={kind} averages a deep copy of the "
                                        r"model, but its attribute mlpf is a function that "
                                        r"calls the original's mlp, .*make it a method"):
        ironloop.fit(ClosureNet(), blobs(), None, cfg(tmp_path, average__kind=kind))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
