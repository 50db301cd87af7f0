"""``ironloop report`` on a run with weight averaging: averaged.png holds the raw and the
averaged curves, losses on the left, accuracies on the right."""

from __future__ import annotations

import ironloop
from ironloop.tools import report
from tests.conftest import blobs, cfg, tiny_mlp
from tests.test_report import assert_real_plot, colour_px


def test_report_plots_the_raw_and_averaged_curves(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(200), blobs(60, seed=1),
                 cfg(tmp_path, train__epochs=3, average__kind="ema", average__decay=0.5))
    run = tmp_path / "run"
    paths = report.render_report(run)
    averaged = run / "report" / "averaged.png"
    assert averaged in paths and "![averaged](averaged.png)" in (run / "report" /
                                                                 "report.md").read_text()
    assert_real_plot(averaged)
    left, right = slice(None, 540), slice(540, None)  # 9 in x 120 dpi = 1080 px wide
    assert colour_px(averaged, "C0", cols=left) > 100  # val_loss, solid
    assert colour_px(averaged, "C1", cols=left) > 100  # val_avg_loss, dashed
    assert colour_px(averaged, "C2", cols=right) > 100  # val_acc
    assert colour_px(averaged, "C3", cols=right) > 100  # val_avg_acc


def test_no_averaged_plot_without_averaging(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(100), blobs(30, seed=1), cfg(tmp_path, train__epochs=2))
    paths = report.render_report(tmp_path / "run")
    assert not any(p.name == "averaged.png" for p in paths)
