"""Bad inputs end in one line and exit 2, with no traceback and nothing overwritten: a
non-finite LR, an empty training split, a model output that does not fit the loss, a disk that
fills up while metrics.jsonl is written (a real process under RLIMIT_FSIZE)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import ironloop
from ironloop.cli import main
from ironloop.errors import DataError, UserError
from tests.conftest import REPO, blobs, tiny_mlp
from tests.test_preempt import ARGS, ENV, TIMEOUT


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "clip.max_norm", "optim.weight_decay"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_floats_are_refused(key, value, capsys, tmp_path):
    assert main(["train", "configs/digits.yaml", f"{key}={value}",
                 f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "finite" in err[0], err
    assert not (tmp_path / "run").exists()


def conf(tmp_path) -> dict:
    return {"run.dir": str(tmp_path / "run"), "log.progress": "off", "train.epochs": 1}


def test_an_empty_training_split_is_one_line(tmp_path):
    empty = (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(DataError, match="training split is empty"):
        ironloop.fit(tiny_mlp(), empty, blobs(n=16), conf(tmp_path))
    assert not (tmp_path / "run").exists()  # refused: nothing written, not even the lock


def test_an_output_that_does_not_fit_the_loss_names_both_shapes(tmp_path):
    model = nn.Sequential(nn.Linear(8, 6), nn.Unflatten(1, (2, 3)))  # [batch, 2, 3]
    with pytest.raises(UserError, match=r"output Tensor\[32, 2, 3\].*targets Tensor\[32\]"):
        ironloop.fit(model, blobs(n=64), None, {**conf(tmp_path), "train.batch_size": 32})


def limited(limit: int):
    """In the child: files may grow to ``limit`` bytes; past it a write fails with EFBIG
    instead of killing the process with SIGXFSZ (what a full disk or a quota looks like)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_while_logging_stops_with_the_last_complete_line(tmp_path):
    run_dir, limit = tmp_path / "run", 9000
    proc = subprocess.run(
        [sys.executable, "-m", "ironloop", "train", *ARGS, "train.epochs=3",
         "checkpoint.enabled=false", f"run.dir={run_dir}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
        preexec_fn=limited(limit))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl" in err[0] and "File too large" in err[0], err
    assert "Traceback" not in proc.stderr
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and os.path.getsize(run_dir / "metrics.jsonl") <= limit
    steps = [json.loads(line)["step"] for line in text.splitlines()]  # every line complete
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 10


def test_the_preflight_doctor_names_samples_with_non_finite_inputs():
    from ironloop.tools.doctor.run import check, subject

    train = blobs(n=64)
    train.x[7, 2] = float("nan")
    train.x[40, 0] = float("inf")
    findings = check(subject(tiny_mlp(), train, blobs(n=16, seed=1), num_classes=3))
    bad = [f for f in findings if f.check == "finite_inputs"]
    assert len(bad) == 1 and bad[0].severity == "error", findings
    assert "train: 2 sample(s)" in bad[0].render() and "[7, 40]" in bad[0].render()
    clean = check(subject(tiny_mlp(), blobs(n=64), blobs(n=16, seed=1), num_classes=3))
    assert not [f for f in clean if f.check == "finite_inputs"]
