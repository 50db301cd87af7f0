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


def _scripted(losses: list[float]):
    """A model with one weight, a one-tensor dataset whose row i is the loss step i logs (batch
    1, no shuffle), and a step that returns it: the logged losses are the script's, whatever
    the optimizer does (the weight's gradient is 0)."""
    model = nn.Linear(1, 1)
    data = torch.utils.data.TensorDataset(torch.tensor(losses).unsqueeze(1))

    def step(m, batch):
        (x,) = batch
        return x.mean() + 0.0 * m(x).sum(), {}

    return model, data, step


def _scripted_cfg(run_dir, **over) -> dict:
    return cfg(run_dir, train__batch_size=1, train__epochs=1, data__shuffle=False,
               data__val_fraction=0, checkpoint__every_steps=4, **over)


def test_a_resumed_run_late_in_training_with_a_lower_loss_does_not_warn(tmp_path, capsys):
    # The run starts at 100 and falls to 0.001; the resumed process's first logged loss is
    # 0.001 and it later logs 0.03 (30 x that, 0.0003 x the run's start): not a divergence.
    losses = [100.0, 50.0, 1.0, 1.0, 0.001, 0.001, 0.03, 0.03]
    model, data, step = _scripted(losses)
    ironloop.fit(model, data, None, _scripted_cfg(tmp_path, train__max_steps=4), step_fn=step)
    model, data, step = _scripted(losses)
    ironloop.fit(model, data, None, _scripted_cfg(tmp_path, train__max_steps=8), step_fn=step,
                 resume=True, allow_config_change=True)
    out = capsys.readouterr().out
    assert "the loss grew" not in out, out
    # the same baseline still judges: a resumed run whose loss does pass 10 x the run's start
    grows = [1.0, 1.0, 1.0, 1.0, 5.0, 12.0, 12.0, 12.0]
    model, data, step = _scripted(grows)
    ironloop.fit(model, data, None, _scripted_cfg(tmp_path / "b", train__max_steps=4),
                 step_fn=step)
    model, data, step = _scripted(grows)
    ironloop.fit(model, data, None, _scripted_cfg(tmp_path / "b", train__max_steps=8),
                 step_fn=step, resume=True, allow_config_change=True)
    out = capsys.readouterr().out
    assert "the loss grew to 12.00 at step 6, 12.00 x its first logged value 1.000" in out, out


def test_the_advice_with_clipping_on_names_it_and_does_not_say_set_clip_max_norm(tmp_path,
                                                                                 capsys):
    model, data, step = _scripted([1.0, 1.0, 30.0, 30.0])
    ironloop.fit(model, data, None, _scripted_cfg(tmp_path, clip__max_norm=1.0), step_fn=step)
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "the loss grew" in s)
    assert "set clip.max_norm" not in line, line
    assert line.endswith("the run is diverging with clip.max_norm=1 on; lower optim.lr or "
                         "turn on guard.spike_factor to skip such steps"), line


def test_the_advice_suggests_only_what_is_off():
    def advice(**knobs) -> str:
        g = LossGrowth(10.0, **knobs)
        g.check(1, 1.0)
        return g.check(2, 11.0).split("the run is diverging")[1]

    assert advice() == ("; lower optim.lr, set clip.max_norm, or turn on guard.spike_factor "
                        "to skip such steps")
    assert advice(max_norm=0.5, spike_factor=3.0) == (
        " with clip.max_norm=0.5 and guard.spike_factor=3 on; lower optim.lr")
    assert advice(spike_factor=3.0) == (" with guard.spike_factor=3 on; lower optim.lr or set "
                                        "clip.max_norm")


def test_the_baseline_is_kept_in_the_checkpoint_and_put_back():
    g = LossGrowth(10.0)
    assert g.state_dict() == {"start": None}
    g.check(1, 4.0)
    resumed = LossGrowth(10.0)
    resumed.load_state_dict(g.state_dict())
    assert resumed.check(2, 0.01) is None and resumed.start == 4.0  # not a new baseline
    assert resumed.check(3, 39.0) is None and resumed.check(4, 41.0) is not None
    old = LossGrowth(10.0)
    old.load_state_dict(None)  # a checkpoint from before the baseline was kept
    assert old.check(1, 2.0) is None and old.start == 2.0
