"""SIGKILL real `ironloop train` processes at seeded random points (10 kills at least), resume
them, and demand the same bits as an uninterrupted run (tests/fault_kills.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fault_kills import (
    MIN_KILLS,
    STEPS_PER_EPOCH,
    TOTAL,
    assert_bit_exact,
    curve,
    reference_run,
    run_with_kills,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory)


def test_sigkill_at_random_points_then_resume_is_bit_exact(reference, tmp_path):
    rng = random.Random(1234)
    targets = sorted(rng.sample(range(3, TOTAL - 5), 12))
    kills = run_with_kills(tmp_path / "run", targets, rng)
    assert kills >= MIN_KILLS["plain"]
    assert_bit_exact(reference, tmp_path / "run")
    # every resume from a checkpoint left a note, at a checkpoint step (every 7, or an epoch end)
    events = curve(tmp_path / "run", "events.jsonl", ("event", "step", "last_logged_step"))
    assert events and all(e == "resume" for e, _, _ in events)
    assert all(s % 7 == 0 or s % STEPS_PER_EPOCH == 0 for _, s, _ in events)
    assert all(last >= s for _, s, last in events)
