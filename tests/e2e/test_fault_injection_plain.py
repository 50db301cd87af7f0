"""SIGKILL real `ironloop train` processes at seeded random points (10 kills at least), resume
them, and demand the same bits as an uninterrupted run (tests/fault_kills.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.fault_kills import (
    MIN_KILLS,
    STEPS_PER_EPOCH,
    TOTAL,
    assert_bit_exact,
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
    rows = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    events = [(r["event"], r["step"], r["last_logged_step"]) for r in rows
              if r["event"] != "start"]  # every process's start is recorded too (#55)
    assert events and all(e == "resume" for e, _, _ in events)
    assert all(s % 7 == 0 or s % STEPS_PER_EPOCH == 0 for _, s, _ in events)
    assert all(last >= s for _, s, last in events)
