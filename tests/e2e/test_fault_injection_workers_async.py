"""SIGKILL real `ironloop train` processes with 2 loader workers and asynchronous checkpoints at
seeded random points (5 kills at least), resume them, and demand the same bits as an
uninterrupted run (tests/fault_kills.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fault_kills import MIN_KILLS, TOTAL, assert_bit_exact, reference_run, run_with_kills

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory)


def test_sigkill_with_loader_workers_and_async_checkpoints_is_bit_exact(reference, tmp_path):
    rng = random.Random(99)
    targets = sorted(rng.sample(range(3, TOTAL - 5), 7))
    kills = run_with_kills(tmp_path / "run", targets, rng,
                           extra=("data.num_workers=2", "checkpoint.async=true"),
                           finish_here=True)
    assert kills >= MIN_KILLS["workers+async"]
    assert_bit_exact(reference, tmp_path / "run")
