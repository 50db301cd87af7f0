"""``ironloop report`` on a run with weight averaging: averaged.png holds the raw and the
averaged curves, losses on the left, accuracies on the right."""

from __future__ import annotations

import json

import ironloop
from ironloop.tools import report
from tests.conftest import blobs, cfg, tiny_mlp
from tests.tools.test_report import assert_real_plot, colour_px


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


def _evals_run(run, raw: float, avg: float, kind: str = "ema", warmup: bool = True):
    """A finished run's files with one evaluation of both weights."""
    import yaml

    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"average": {"kind": kind, "decay": 0.999, "warmup": warmup}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n")
    (run / "evals.jsonl").write_text(json.dumps(
        {"step": 10, "epoch": 1, "val_loss": raw, "val_avg_loss": avg}) + "\n")
    return run


def test_the_summary_says_whether_the_average_beat_the_raw_weights(tmp_path):
    better = report.summarize(_evals_run(tmp_path / "a", raw=0.1636, avg=0.1081))
    assert ("| averaged weights | averaged weights better than raw (val_avg_loss 0.1081 < "
            "val_loss 0.1636) at the last evaluation (step 10) |") in better
    worse = report.summarize(_evals_run(tmp_path / "b", raw=0.06636, avg=1.304))
    assert "averaged weights worse than raw (val_avg_loss 1.304 > val_loss 0.06636)" in worse
    ironloop.fit(tiny_mlp(), blobs(100), blobs(30, seed=1), cfg(tmp_path, train__epochs=1))
    assert "averaged" not in report.summarize(tmp_path / "run")  # no average, no row


def test_the_diagnosis_warns_when_the_average_is_clearly_worse(tmp_path):
    from ironloop.tools.doctor.logs import diagnose_logs

    (f,) = diagnose_logs(_evals_run(tmp_path / "ema", raw=0.06636, avg=1.304, warmup=False))
    assert f.check == "average" and "step 10" in f.measured
    assert "average.warmup=false" in f.cause and "lower average.decay" in f.fix
    (f,) = diagnose_logs(_evals_run(tmp_path / "swa", raw=0.5, avg=0.6, kind="swa"))
    assert "average.start_step" in f.fix and "decay" not in f.fix


def test_the_diagnosis_stays_quiet_when_the_average_is_better_or_within_5_percent(tmp_path):
    from ironloop.tools.doctor.logs import diagnose_logs

    assert diagnose_logs(_evals_run(tmp_path / "a", raw=0.1636, avg=0.1081)) == []
    assert diagnose_logs(_evals_run(tmp_path / "b", raw=0.06636, avg=0.06650)) == []
    mixed = _evals_run(tmp_path / "c", raw=1.514, avg=1.672)  # its accuracy is better
    (mixed / "evals.jsonl").write_text(json.dumps({"step": 23, "epoch": 1, "val_loss": 1.514,
                                                   "val_acc": 0.6017, "val_avg_loss": 1.672,
                                                   "val_avg_acc": 0.7827}) + "\n")
    assert diagnose_logs(mixed) == []
