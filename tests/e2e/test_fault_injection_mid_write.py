"""SIGKILL real `ironloop train` processes the moment a checkpoint temp file exists (5 kills at
least, 3 of them inside the write), resume them, and demand the same bits as an uninterrupted
run (tests/fault_kills.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import logged_step, piped_stderr, wait_running
from tests.fault_kills import (
    MIN_KILLS,
    assert_bit_exact,
    finish,
    kill,
    reference_run,
    start,
    temp_files,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory)


def test_sigkill_in_the_middle_of_a_checkpoint_write(reference, tmp_path):
    """Kill the moment a temp file appears; the file it was writing must never be used."""
    run_dir = tmp_path / "run"
    kills = caught_mid_write = 0
    for floor in (20, 70, 120, 170, 220):
        proc = start(run_dir)
        wait_running(proc, lambda f=floor: logged_step(run_dir) >= f and bool(temp_files(run_dir)),
                     f"checkpoint write past step {floor}", piped_stderr(proc), every=0.0005)
        if proc.poll() is None:
            kill(proc)
            kills += 1
            caught_mid_write += bool(temp_files(run_dir))  # still there: the write was cut
        else:
            assert proc.returncode == 0
    assert kills >= MIN_KILLS["mid-write"]
    assert caught_mid_write >= 3, "too few kills landed inside a checkpoint write"
    finish(start(run_dir))
    assert not temp_files(run_dir), "temp files of killed writers must be cleaned up"
    assert_bit_exact(reference, run_dir)
