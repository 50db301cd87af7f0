"""A finite divergence is reported by default (issue 44: a loss of 1e30 raised no warning
anywhere, since it is finite and the spike check is opt-in), from the loss the log step already
read, once."""

from __future__ import annotations

import torch
from torch import nn

import ironloop
from ironloop.data.loader import TensorData
from ironloop.engine.divergence import LossGrowth
from tests.conftest import cfg


def test_loss_growth_warns_once_past_the_factor_and_only_where_it_applies():
    g = LossGrowth(10.0)
    assert [g.check(s, v) for s, v in ((10, 2.0), (20, 19.0), (30, 1.0))] == [None] * 3
    line = g.check(40, 46563683368141965899071488.0)
    assert line.startswith("warning: the loss grew to 4.656e+25 at step 40, 2.328e+25 x its "
                           "first logged value 2.000 (log.loss_growth=10)")
    assert g.check(50, 1e30) is None  # once
    assert LossGrowth(0.0).check(1, 1.0) is None and LossGrowth(0.0).check(2, 1e9) is None
    negative = LossGrowth(10.0)  # a loss that starts at or below 0 has no relative bound
    assert negative.check(1, -3.0) is None and negative.check(2, 100.0) is None
    finite = LossGrowth(10.0)  # inf/NaN are the guard's to report
    assert finite.check(1, 1.0) is None and finite.check(2, float("inf")) is None


def regression(n: int = 64) -> TensorData:
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(n, 8, generator=g)
    return TensorData(x, x.sum(1, keepdim=True))


def test_fit_warns_by_default_when_the_loss_diverges_and_not_when_it_learns(tmp_path, capsys):
    # lr past SGD's stability bound on unnormalised inputs, unclipped: the loss grows
    # geometrically and stays finite for these steps
    torch.manual_seed(0)
    over = {"loss.name": "mse", "clip.max_norm": 0.0, "optim.name": "sgd",
            "optim.momentum": 0.0, "train.max_steps": 12, "train.batch_size": 64}
    ironloop.fit(nn.Linear(8, 1), regression(), None, cfg(tmp_path / "a", **{
        **over, "optim.lr": 0.2}))
    out = capsys.readouterr().out
    assert out.count("warning: the loss grew to ") == 1, out
    ironloop.fit(nn.Linear(8, 1), regression(), None, cfg(tmp_path / "b", **{
        **over, "optim.lr": 0.005}))
    assert "the loss grew" not in capsys.readouterr().out


def test_loss_growth_judges_strictly_past_the_factor_from_the_first_finite_loss():
    g = LossGrowth(10.0)
    assert g.check(1, float("nan")) is None and g.start is None  # not a start
    assert g.check(2, 2.0) is None and g.start == 2.0
    assert g.check(3, 20.0) is None  # exactly 10 x: not past it
    line = g.check(4, 20.5)
    assert line is not None and line.startswith("warning: the loss grew to 20.50 at step 4, "
                                                "10.25 x its first logged value 2.000 "
                                                "(log.loss_growth=10): the run is diverging")
    zero = LossGrowth(2.0)
    assert zero.check(1, 0.0) is None and zero.check(2, 5.0) is None  # no bound from 0
