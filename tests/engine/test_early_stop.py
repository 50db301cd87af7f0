"""BestTracker and check_monitor: pure decisions, no model."""

import pytest

from ironloop.engine.early_stop import BestTracker, check_monitor
from ironloop.errors import ConfigError


def test_min_mode_patience_and_min_delta():
    t = BestTracker("min", patience=2, min_delta=0.05)
    assert t.update(1.0, 0) and not t.should_stop
    assert not t.update(0.97, 1)  # within min_delta: not an improvement
    assert t.update(0.9, 2) and t.best == 0.9 and t.best_epoch == 2
    assert not t.update(0.95, 3) and not t.should_stop
    assert not t.update(0.91, 4) and t.should_stop


def test_max_mode_nan_and_disabled_patience():
    t = BestTracker("max", patience=0)
    assert t.update(0.5, 0) and not t.update(float("nan"), 1) and t.best == 0.5
    for e in range(2, 50):
        t.update(0.1, e)
    assert not t.should_stop  # patience 0 never stops


def test_state_dict_round_trip():
    t = BestTracker("max", patience=3)
    t.update(0.7, 0)
    t.update(0.6, 1)
    u = BestTracker("max", patience=3)
    u.load_state_dict(t.state_dict())
    assert u.state_dict() == t.state_dict() == {"best": 0.7, "best_epoch": 0, "bad_epochs": 1}


def test_a_tie_with_the_best_or_a_gain_of_exactly_min_delta_is_no_improvement():
    """A val_acc that sits at its best must run out of patience (and keep best_epoch where the
    best was first reached); a gain of exactly min_delta is not more than min_delta."""
    t = BestTracker("max", patience=2)
    assert t.update(0.75, 0)
    assert not t.update(0.75, 1) and not t.update(0.75, 2)  # ties
    assert t.should_stop and t.best_epoch == 0
    u = BestTracker("min", patience=3, min_delta=0.25)  # exact in binary: no rounding
    assert u.update(1.0, 0)
    assert not u.update(0.75, 1) and u.best == 1.0 and u.bad_epochs == 1
    assert u.update(0.5, 2) and u.best_epoch == 2  # a gain of 0.5 > 0.25


def test_a_first_epoch_that_is_no_improvement_counts_one_bad_epoch():
    t = BestTracker("min", patience=2)
    assert not t.update(float("nan"), 0) and t.bad_epochs == 1 and not t.should_stop
    assert not t.update(float("nan"), 1) and t.should_stop and t.best_epoch == -1  # no best
    with pytest.raises(ValueError, match="'min' or 'max', got 'low'"):
        BestTracker("low")


def test_an_lm_run_monitoring_val_acc_is_refused_before_training_naming_what_it_reports():
    check_monitor("val_ppl", "lm", perplexity=True, validates=True)
    with pytest.raises(ConfigError, match=r"early_stop.metric='val_acc'.*val_loss, val_ppl;"):
        check_monitor("val_acc", "lm", perplexity=True, validates=True)  # lm: no accuracy
    check_monitor("val_acc", "classification", perplexity=False, validates=True)
