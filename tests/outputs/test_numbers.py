"""outputs/numbers.py: the one format the console and the report write numbers in (issue 44)."""

from __future__ import annotations

import pytest

from ironloop.outputs import console
from ironloop.outputs.numbers import number


@pytest.mark.parametrize(("value", "text"), [
    (0.1234, "0.1234"), (1.905, "1.905"), (490.1, "490.1"), (1234.4, "1234"),
    (0.25, "0.2500"),                        # trailing zeros kept: a column keeps its width
    (0.001234, "0.001234"), (-0.5, "-0.5000"),
    (9.99996, "10.00"),                      # four figures of the rounded value, not five
    (0.0, "0"), (3, "3"),
])
def test_four_significant_figures_in_fixed_notation(value, text):
    assert number(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (4e-5, "4.000e-05"),                     # an MSE that 4 decimals printed as 0.0000
    (46563683368141965899071488.0, "4.656e+25"),  # a divergence that printed 27 digits
    (1e5, "1.000e+05"), (99999.7, "1.000e+05"),   # rounds past 1e5: scientific
    (0.00099996, "0.001000"),                # rounds up to 1e-3: fixed
    (2.5e-4, "2.500e-04"), (-3e6, "-3.000e+06"), (123456, "1.235e+05"),
])
def test_scientific_past_1e5_and_under_1e_3(value, text):
    assert number(value) == text


def test_non_finite_and_non_numbers_are_written_as_they_are():
    assert [number(v) for v in (float("inf"), float("-inf"), float("nan"))] == \
        ["inf", "-inf", "nan"]
    assert number("n/a") == "n/a" and number(True) == "True"


def test_the_console_keeps_the_digits_of_small_and_huge_figures():
    row = {"epoch": 1, "step": 10, "train_loss": 4e-5, "val_loss": 3.2e-5, "val_acc": 0.5,
           "lr": 1e-3, "seconds": 1.0, "samples_per_s": 0.4}
    line = console.epoch_line(row, console.RunPlan(10, 10, 1, window=1), {})
    assert "train_loss 4.000e-05" in line and "val_loss 3.200e-05" in line
    assert "0.4000 samples/s" in line and "0.0000" not in line
    evals = console.eval_line({"step": 10, "epoch": 1, "val_loss": 4.656e25, "seconds": 0.1}, 10)
    assert "val_loss 4.656e+25" in evals


def test_the_progress_line_writes_the_loss_and_a_slow_rate_with_their_digits():
    from types import SimpleNamespace

    from ironloop.config import LogConfig

    at = SimpleNamespace(step=0, epoch=0, offset=0)
    prog = console.EpochProgress(LogConfig(progress="off"), at,
                                 console.RunPlan(100, 100, 1, window=1), main=False)
    prog.set_postfix(loss=4e-5, lr=3e-4)  # as the loop passes them: the logged floats
    line = console.progress_line(prog, step=1, now=prog.last_time + 20.0)  # 20 s a step
    prog.close()
    assert "loss 4.000e-05  lr 3.000e-04" in line and "0.05000 steps/s" in line
