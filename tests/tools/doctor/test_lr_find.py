"""tools.doctor.lr_find: the sweep, its suggestion, its finding and its plot."""

from __future__ import annotations

import math

import pytest

from ironloop.tools.doctor import lr_find
from ironloop.tools.doctor.findings import Finding
from ironloop.tools.doctor.subject import DoctorSubject
from tests.conftest import blobs
from tests.tools.doctor.helpers import Scripted, make

# -- the LR range test ----------------------------------------------------------------------------

def test_the_sweep_grows_the_lr_geometrically_and_stops_when_the_loss_diverges():
    step = Scripted(1.0, 2.0, 4.0, 4.0, 4.0, 4.0)
    lrs, losses = lr_find.sweep(make(step=step), start=1.0, end=16.0, steps=5, beta=0.0)
    assert lrs == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0]) and losses == [1, 2, 4, 4, 4]
    step = Scripted(1.0, 2.0, 4.000001, 1.0)
    lrs, losses = lr_find.sweep(make(step=step), start=1.0, end=16.0, steps=5, beta=0.0)
    assert lrs == [1.0, 2.0] and step.calls == 3
    step = Scripted(1.0, math.nan, 1.0)
    assert lr_find.sweep(make(step=step), 1.0, 16.0, 5, 0.0) == ([1.0], [1.0])


def test_the_sweep_smooths_the_loss_with_a_bias_corrected_average():
    lrs, losses = lr_find.sweep(make(step=Scripted(2.0, 2.0, 5.0)), 1e-3, 1e-1, 3, beta=0.5)
    # avg: 1, 1.5, 3.25; corrected by 1 - 0.5^(i+1): 2, 2, 3.714...
    assert losses == pytest.approx([2.0, 2.0, 3.25 / 0.875])
    assert lrs == pytest.approx([1e-3, 1e-2, 1e-1])
    assert lr_find.sweep(make(step=Scripted(1.0)), 0.5, 10.0, 1)[0] == [0.5]


def test_the_sweep_sets_each_lr_cycles_the_loader_and_trains_with_clipping(monkeypatch):
    seen_lr, clipped = [], []
    real_copy = DoctorSubject.copy

    def copy(self):
        model, opt = real_copy(self)
        step = opt.step

        def recorded(*a, **k):
            seen_lr.append(opt.param_groups[0]["lr"])
            return step(*a, **k)
        opt.step = recorded
        return model, opt

    monkeypatch.setattr(DoctorSubject, "copy", copy)
    monkeypatch.setattr(lr_find, "clip_gradients", lambda params, max_norm, mode: clipped.append(
        (max_norm, mode)))
    s = make(train=blobs(8), clip__max_norm=3.0)  # two batches of 4
    lrs, _ = lr_find.sweep(s, start=1e-4, end=1e-1, steps=4, beta=0.0)
    assert lrs == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1]) and seen_lr == pytest.approx(lrs)
    assert clipped == [(3.0, "norm")] * 4


def test_the_suggestion_needs_five_points_and_falls_back_to_the_first_lr():
    assert lr_find.suggest([1, 2, 4, 8], [4, 3, 2, 1]) is None
    assert lr_find.suggest([1, 2, 4, 8, 16], [1, 2, 3, 4, 5]) == 1
    assert lr_find.suggest([1, 2, 4, 8, 16, 32], [5, 4, 2, 1.5, 1, 3]) == 2
    assert lr_find.suggest([1, 2, 4, 8, 16, 32], [5, 4, 3, 1.5, 1, 3]) == 4


def lr_findings(monkeypatch, tmp_path, lrs, losses, lr, steps=100) -> tuple[Finding, list]:
    calls = []
    monkeypatch.setattr(lr_find, "sweep", lambda s, steps: calls.append(steps) or (lrs, losses))
    monkeypatch.setattr(lr_find, "plot", lambda *a: calls.append(a))
    (f,) = lr_find.check_lr_find(make(optim__lr=lr), tmp_path / "lr.png", steps=steps)
    return f, calls


def test_the_lr_finding_compares_optim_lr_with_the_suggestion_and_the_minimum(
        monkeypatch, tmp_path):
    lrs, losses = [0.1, 1.0, 3.0, 10.0, 30.0, 100.0], [5, 4, 1, 0.5, 0.4, 9]  # best 1, min 30
    out = tmp_path / "lr.png"
    f, calls = lr_findings(monkeypatch, tmp_path, lrs, losses, 30.0, steps=7)
    assert calls == [7, (lrs, losses, 1.0, 30.0, out)]
    assert f == Finding("lr_find", "info", f"suggested LR 1.00e+00 ({lr_find.METHOD}); lowest "
                                           f"loss at 3.00e+01; optim.lr=30; plot in {out}", "", "")
    f, _ = lr_findings(monkeypatch, tmp_path, lrs, losses, 30.5)
    assert f.severity == "warning" and "past the loss minimum" in f.cause
    assert f.fix == "lower optim.lr to about 1.0e+00"
    assert lr_findings(monkeypatch, tmp_path, lrs, losses, 1 / 30)[0].severity == "info"
    f, _ = lr_findings(monkeypatch, tmp_path, lrs, losses, 0.033)
    assert f.severity == "warning" and "far below" in f.cause
    assert f.fix == "raise optim.lr to about 1.0e+00"


def test_a_sweep_too_short_to_suggest_an_lr_is_a_warning(monkeypatch, tmp_path):
    f, calls = lr_findings(monkeypatch, tmp_path, [1e-7, 1e-6], [1.0, 9.0], 0.1)
    assert f == Finding("lr_find", "warning", "the loss diverged within 2 steps of the sweep "
                                              "(from 1e-7)", "the model is unstable at any LR",
                        "check the initial_loss and probabilities findings first")
    assert calls[1][2] is None


def test_the_lr_plot_shows_the_curve_the_suggestion_and_the_configured_lr(monkeypatch, tmp_path):
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, out: figures.append((self, out)))
    out = tmp_path / "sub" / "lr.png"
    assert lr_find.plot([1e-3, 1e-2], [2.0, 1.0], 5e-3, 1e-2, out) == out
    ((fig, saved),) = figures
    assert saved == out and out.parent.is_dir()
    (ax,) = fig.axes
    assert tuple(fig.get_size_inches()) == (7.0, 4.0) and fig.dpi == 120
    assert ax.get_xscale() == "log" and ax.get_title() == "LR range test"
    assert ax.get_xlabel() == "learning rate" and ax.get_ylabel() == "loss (smoothed)"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["smoothed loss", f"suggested 5.00e-03 ({lr_find.METHOD})",
                      "optim.lr = 1.00e-02"]
    curve, best, configured = ax.get_lines()
    assert list(curve.get_xdata()) == [1e-3, 1e-2] and list(curve.get_ydata()) == [2.0, 1.0]
    assert list(best.get_xdata()) == [5e-3, 5e-3] and list(configured.get_xdata()) == [1e-2] * 2
    lr_find.plot([1e-3, 1e-2], [2.0, 1.0], None, 1e-2, out)
    assert [t.get_text() for t in figures[1][0].axes[0].get_legend().get_texts()] == [
        "smoothed loss", "optim.lr = 1.00e-02"]
