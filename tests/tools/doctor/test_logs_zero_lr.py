"""tools.doctor.logs: a flat loss at a (near-)zero LR is diagnosed with its cause (a schedule that
ended before the run did), and no finding prints an empty cause or fix (report.md, report.html)."""

from __future__ import annotations

import json

from ironloop.tools import report
from ironloop.tools.doctor import logs
from ironloop.tools.doctor.findings import info


def rows(lrs, losses):
    return [{"step": 10 * (i + 1), "lr": lr, "loss": loss, "steps": 10, "clipped": 0}
            for i, (lr, loss) in enumerate(zip(lrs, losses))]


def extended_run():
    """Two windows of a finished cosine schedule, then an extension at its last LR: 0."""
    return rows([9e-4, 1.9e-3, *[0.0] * 6], [2.27, 2.08, 1.55, 1.51, 1.54, 1.52, 1.53, 1.52])


def test_a_flat_loss_at_a_zero_lr_names_the_schedule_that_ended():
    (f,) = logs.zero_lr(extended_run())
    assert f.check == "flat_loss" and "from step 30 to 80" in f.measured
    assert "schedule" in f.cause and "resume extends train.max_steps" in f.cause
    assert "fresh run" in f.fix


def test_a_low_lr_that_still_trains_or_a_short_tail_is_not_named():
    falling = rows([1e-3] + [0.0] * 6, [2.0, 1.9, 1.7, 1.5, 1.3, 1.1, 0.9])
    assert logs.zero_lr(falling) == []  # the loss falls: not flat
    short = rows([1e-3, 1e-3, 1e-3, 0.0, 0.0], [2.0, 1.9, 1.8, 1.8, 1.8])
    assert logs.zero_lr(short) == []  # two windows: not enough to call it
    assert logs.zero_lr(rows([1e-3] * 8, [1.5] * 8)) == []  # flat at a real LR: flat_loss's


def test_the_run_diagnosis_reads_the_zero_lr_tail(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                    for r in extended_run()))
    found = logs.diagnose_logs(tmp_path)
    assert [f.check for f in found] == ["flat_loss"] and "LR is 0" in found[0].measured


def test_an_info_finding_prints_no_empty_cause_or_fix(tmp_path):
    found = [info("clipping", "99% of steady-state steps were clipped")]
    md = logs.markdown(found)
    assert "Likely cause" not in md and "Fix" not in md and "clipped." in md
    html = report.write_html(tmp_path, found, [], tmp_path / "report.html").read_text()
    assert "Likely cause" not in html and "Fix:" not in html and "clipped." in html
