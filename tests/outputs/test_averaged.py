"""The words for the averaged weights against the raw ones (outputs/averaged.py): which metrics
are judged, in which direction, and how the figures read."""

from __future__ import annotations

import math

from ironloop.outputs.averaged import Comparison, MetricPair, compare, last_compared


def test_a_lower_averaged_loss_is_better_and_reads_with_its_figures():
    found = compare({"step": 4, "val_loss": 0.1636, "val_avg_loss": 0.1081})
    assert found is not None
    assert found.outcome == "better"
    assert found.words() == ("averaged weights better than raw "
                             "(val_avg_loss 0.1081 < val_loss 0.1636)")
    assert found.words(figures=False) == "averaged weights better than raw"


def test_a_higher_averaged_accuracy_is_better_and_shows_in_percent():
    found = compare({"val_loss": 0.5, "val_avg_loss": 0.4, "val_acc": 0.5, "val_avg_acc": 0.625})
    assert found is not None
    assert [(p.raw_key, p.avg_key, p.lower_is_better) for p in found.pairs] == [
        ("val_loss", "val_avg_loss", True), ("val_acc", "val_avg_acc", False)]
    assert found.outcome == "better"
    assert found.words() == ("averaged weights better than raw (val_avg_loss 0.4000 < val_loss "
                             "0.5000; val_avg_acc 62.50% > val_acc 50.00%)")


def test_worse_on_both_reads_worse_than_raw():
    found = compare({"val_loss": 0.2, "val_avg_loss": 0.3, "val_acc": 0.9, "val_avg_acc": 0.8})
    assert found is not None and found.outcome == "worse"
    assert found.words() == ("averaged weights worse than raw (val_avg_loss 0.3000 > val_loss "
                             "0.2000; val_avg_acc 80.00% < val_acc 90.00%)")


def test_loss_and_accuracy_that_disagree_say_which_is_which():
    found = compare({"val_loss": 0.2, "val_avg_loss": 0.3, "val_acc": 0.8, "val_avg_acc": 0.9})
    assert found is not None and found.outcome == "mixed"
    assert found.words(figures=False) == "averaged weights worse on val_loss, better on val_acc"


def test_figures_equal_to_the_four_shown_are_as_good_as_each_other():
    pair = MetricPair("val_loss", "val_avg_loss", 0.12341, 0.12344, True)
    assert pair.outcome == "as good"
    assert pair.figures() == "val_avg_loss 0.1234 = val_loss 0.1234"
    assert Comparison([pair]).words() == ("averaged weights as good as raw "
                                          "(val_avg_loss 0.1234 = val_loss 0.1234)")
    # one digit more apart is a difference, in either direction
    assert MetricPair("val_loss", "val_avg_loss", 0.1235, 0.1234, True).outcome == "better"
    assert MetricPair("val_acc", "val_avg_acc", 0.1235, 0.1234, False).outcome == "worse"


def test_a_named_set_is_judged_on_the_first_set_with_an_averaged_loss():
    row = {"val_clean_loss": 1.0, "val_avg_clean_loss": 0.5, "val_clean_acc": 0.5,
           "val_noisy_loss": 1.0, "val_avg_noisy_loss": 2.0}
    found = compare(row)
    assert found is not None
    assert [(p.raw_key, p.avg_key) for p in found.pairs] == \
        [("val_clean_loss", "val_avg_clean_loss")]
    assert found.pairs[0].figures() == "val_avg_clean_loss 0.5000 < val_clean_loss 1.000"


def test_a_row_without_a_finite_averaged_figure_is_not_compared():
    assert compare({"val_loss": 0.5, "val_acc": 0.5}) is None  # no average
    assert compare({"val_loss": 0.5, "val_avg_loss": math.nan}) is None
    assert compare({"val_avg_loss": 0.5}) is None  # the raw one is missing
    assert compare({"val_avg_acc": 0.5, "val_acc": 0.4}) is None  # an accuracy alone: no set
    # an averaged loss that is not finite, with a finite accuracy: judged on the accuracy only
    found = compare({"val_loss": 0.5, "val_avg_loss": math.inf, "val_acc": 0.5,
                     "val_avg_acc": 0.6})
    assert found is not None and [p.raw_key for p in found.pairs] == ["val_acc"]


def test_the_last_row_that_ran_the_averaged_weights_is_the_one_compared():
    rows = [{"step": 1, "val_loss": 1.0, "val_avg_loss": 0.9},
            {"step": 2, "val_loss": 0.8, "val_avg_loss": 0.9},
            {"step": 3, "val_loss": 0.7}]
    found = last_compared(rows)
    assert found is not None
    row, comparison = found
    assert row["step"] == 2 and comparison.outcome == "worse"
    assert last_compared([{"step": 3, "val_loss": 0.7}]) is None
    assert last_compared([]) is None
