"""SIGKILL real `ironloop train` processes at seeded random points, resume them, and demand the
same bits as an uninterrupted run.

Kills are progress-driven rather than purely time-driven: the process is killed once it has
logged a randomly drawn step, after a random jitter, so the kill lands inside a step, during
validation or during a checkpoint write, and the run always moves forward between kills.
One test kills exactly while a checkpoint temp file exists, i.e. in the middle of a write.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, logged_step

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 45  # ceil(1438 / (16 * 2))
EPOCHS = 6
TOTAL = STEPS_PER_EPOCH * EPOCHS
ARGS = ["configs/digits.yaml", "model.name=mlp",
        "model.kwargs={hidden: [512, 512], dropout: 0.1}",  # dropout: the RNG must resume too
        f"train.epochs={EPOCHS}", "train.batch_size=16", "train.accumulation_steps=2",
        "checkpoint.every_steps=7", "checkpoint.keep_last=2", "log.every_steps=1",
        "log.progress=off", "schedule.name=onecycle", "early_stop.metric=val_acc"]
#: The SIGKILLs each test must land on its own; together at least the 20 the issue asks for.
#: Each test checks its own share, so the total holds whatever runs, alone or in any order.
MIN_KILLS = {"plain": 10, "workers+async": 5, "mid-write": 5}


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ironloop", "train", *ARGS, f"run.dir={run_dir}", *extra,
            "--resume"]


def temp_files(run_dir: Path) -> list[Path]:
    ckpt = run_dir / "checkpoints"
    return list(ckpt.glob(".*.tmp-*")) if ckpt.is_dir() else []


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def run_with_kills(run_dir: Path, targets: list[int], rng: random.Random, extra=()) -> int:
    """Resume repeatedly; attempt i is killed after it logs step >= targets[i] plus jitter."""
    kills = 0
    for target in targets:
        proc = subprocess.Popen(command(run_dir, *extra), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        while proc.poll() is None and logged_step(run_dir) < target:
            time.sleep(0.002)
        if proc.poll() is not None:  # finished before the target: nothing left to kill
            assert proc.returncode == 0, proc.stderr.read()
            return kills
        time.sleep(rng.uniform(0.0, 0.08))  # a random point inside what comes next
        if proc.poll() is None:
            kill(proc)
            kills += 1
    finish(subprocess.Popen(command(run_dir, *extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True))
    return kills


def load_last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def assert_same_tree(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"differs at {where}: {a!r} != {b!r}"


def curve(run_dir: Path, name: str, keys: tuple[str, ...]) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
    return [tuple(r[k] for k in keys) for r in rows]


def assert_bit_exact(reference: Path, resumed: Path) -> None:
    ref, got = load_last(reference), load_last(resumed)
    for part in ("model", "optimizer", "scheduler", "progress", "tracker"):
        assert_same_tree(ref[part], got[part], part)
    metric_keys = ("step", "epoch", "loss", "lr", "grad_norm", "clipped")
    assert curve(resumed, "metrics.jsonl", metric_keys) == curve(reference, "metrics.jsonl",
                                                                  metric_keys)
    epoch_keys = ("epoch", "step", "train_loss", "val_loss", "val_acc")
    assert curve(resumed, "epochs.jsonl", epoch_keys) == curve(reference, "epochs.jsonl",
                                                                epoch_keys)
    final_ref = (reference / "final.safetensors").read_bytes()
    assert (resumed / "final.safetensors").read_bytes() == final_ref


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fault") / "reference"
    res = subprocess.run(command(run_dir), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert len(curve(run_dir, "metrics.jsonl", ("step",))) == TOTAL
    return run_dir


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


def test_sigkill_with_loader_workers_and_async_checkpoints_is_bit_exact(reference, tmp_path):
    rng = random.Random(99)
    targets = sorted(rng.sample(range(3, TOTAL - 5), 7))
    kills = run_with_kills(tmp_path / "run", targets, rng,
                           extra=("data.num_workers=2", "checkpoint.async=true"))
    assert kills >= MIN_KILLS["workers+async"]
    assert_bit_exact(reference, tmp_path / "run")


def test_sigkill_in_the_middle_of_a_checkpoint_write(reference, tmp_path):
    """Kill the moment a temp file appears; the file it was writing must never be used."""
    run_dir = tmp_path / "run"
    kills = caught_mid_write = 0
    for floor in (20, 70, 120, 170, 220):
        proc = subprocess.Popen(command(run_dir), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        while proc.poll() is None and not (logged_step(run_dir) >= floor and temp_files(run_dir)):
            time.sleep(0.0005)
        if proc.poll() is None:
            kill(proc)
            kills += 1
            caught_mid_write += bool(temp_files(run_dir))  # still there: the write was cut
        else:
            assert proc.returncode == 0
    assert kills >= MIN_KILLS["mid-write"]
    assert caught_mid_write >= 3, "too few kills landed inside a checkpoint write"
    finish(subprocess.Popen(command(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True))
    assert not temp_files(run_dir), "temp files of killed writers must be cleaned up"
    assert_bit_exact(reference, run_dir)
