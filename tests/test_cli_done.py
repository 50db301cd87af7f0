"""`ironloop train`'s last line is readable text, not raw JSON (issue 57, item 8)."""

from __future__ import annotations

from ironloop.cli import done_line


def test_the_done_line_is_text_with_rounded_figures():
    line = done_line({"best_val_acc": 0.9012345678901234, "test_acc": None, "steps": 30,
                      "train_seconds": 0.9618940499985911}, "runs/x")
    assert line == "done: best_val_acc 0.9012  30 steps  train 1.0 s  outputs in runs/x"
