"""examples/production_loop.py, the plain-PyTorch loop the lab builds, and ironloop.fit give the
same weights from the same data, order, init and config."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

import ironloop
from ironloop.data.loader import EpochSampler
from tests.conftest import REPO, blobs, cfg, tiny_mlp


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _load("production_loop")


def ironloop_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """ironloop's data order (EpochSampler), handed to the reference loop."""
    sampler = EpochSampler(n, 1, seed, shuffle=True)
    sampler.set_epoch(epoch)
    return sampler.permutation()


_ALL = blobs(263, seed=1)
TRAIN = type(_ALL)(_ALL.x[:203], _ALL.y[:203])  # 203: ragged windows and micro-batches
VAL = type(_ALL)(_ALL.x[203:], _ALL.y[203:])


def both(tmp_path, *, batch, accum, schedule="onecycle", max_norm=1.0, ref_batch=None,
         ref_accum=None, epochs=3, precision="fp32"):
    """Train the same initial model with ironloop and with the reference; return both."""
    model = tiny_mlp(seed=0)
    mine = copy.deepcopy(model)
    ironloop.fit(model, TRAIN, VAL, cfg(tmp_path, train__epochs=epochs, train__batch_size=batch,
                                        train__accumulation_steps=accum,
                                        train__precision=precision, optim__lr=2e-3,
                                        optim__weight_decay=0.05, schedule__name=schedule,
                                        schedule__max_lr=1e-2, schedule__warmup_steps=3,
                                        clip__max_norm=max_norm, checkpoint__enabled=False))
    out = ref.train(mine, (TRAIN.x, TRAIN.y), (VAL.x, VAL.y), tmp_path / "ref", epochs=epochs,
                    batch_size=ref_batch or batch, accum=ref_accum or accum, lr=2e-3,
                    max_lr=1e-2, weight_decay=0.05, schedule=schedule, warmup=3,
                    max_norm=max_norm, precision=precision, order=ironloop_order, ckpt_every=0)
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return model, mine, logged, [r for r in out["rows"] if "grad_norm" in r]


def _weights(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_bit_identical_weights_lrs_and_norms_without_accumulation(tmp_path):
    # clip at 1.2: about half the steps are clipped, so clipping acts and is also skipped.
    model, mine, logged, rows = both(tmp_path, batch=32, accum=1, max_norm=1.2)
    a, b = _weights(model), _weights(mine)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["lr"] for m in logged] == [r["lr"] for r in rows]
    assert [m["grad_norm"] for m in logged] == [r["grad_norm"] for r in rows]
    assert 0 < sum(r["clipped"] for r in rows) < len(rows)
    assert sum(m["clipped"] for m in logged) == sum(r["clipped"] for r in rows)


@pytest.mark.parametrize("schedule", ["onecycle", "warmup_cosine"])
def test_same_weights_with_accumulation_ragged_windows_and_clipping(tmp_path, schedule):
    # 203 = 3 windows of 20 x 3, then 20 + 3: a ragged window with a ragged micro-batch.
    model, mine, logged, rows = both(tmp_path, batch=20, accum=3, schedule=schedule)
    a, b = _weights(model), _weights(mine)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same ops in the same order
    assert len(logged) == len(rows) == 3 * 4


def test_accumulation_equals_the_big_batch_to_fp32_rounding(tmp_path):
    # ironloop's 20 x 3 against the reference's single batch of 60: different summation
    # orders, so equal to rounding, not to the bit.
    model, mine, _, _ = both(tmp_path, batch=20, accum=3, ref_batch=60, ref_accum=1)
    a, b = _weights(model), _weights(mine)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)
    start = _weights(tiny_mlp(seed=0))
    assert any(not torch.allclose(a[k], start[k], atol=1e-3) for k in a)  # it did train


def test_bf16_autocast_same_weights(tmp_path):
    model, mine, _, _ = both(tmp_path, batch=20, accum=3, precision="bf16", epochs=1)
    a, b = _weights(model), _weights(mine)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_reference_script_crash_and_resume_is_exact(tmp_path):
    """A real process dies with os._exit(1) mid-epoch; --resume ends on the weights of an
    uninterrupted run."""
    args = ["--epochs", "2", "--ckpt-every", "5", "--precision", "fp32"]
    whole = ref.main([*args, "--out", str(tmp_path / "whole")])
    cmd = [sys.executable, str(REPO / "examples" / "production_loop.py"), *args,
           "--out", str(tmp_path / "crash")]
    first = subprocess.run([*cmd, "--crash-at-step", "18"], capture_output=True, text=True)
    assert first.returncode == 1, first.stderr
    last = torch.load(tmp_path / "crash" / "last.pt", weights_only=False)
    assert last["step"] == 15  # the last checkpoint before the crash, mid-epoch 2
    second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True)
    assert second.returncode == 0 and "resumed from step 15" in second.stdout, second.stderr
    a = torch.load(tmp_path / "whole" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "crash" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == whole["steps"] == 24
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    logged = [json.loads(x) for x in (tmp_path / "crash" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "grad_norm" in r] == list(range(1, 25))


def test_accelerate_version_gives_the_plain_scripts_weights(tmp_path):
    # fp32: accelerate allows one mixed_precision per process, and the lab runs bf16 in its own.
    accel = _load("production_loop_accelerate")
    model = tiny_mlp(seed=0)
    mine = copy.deepcopy(model)
    kw = dict(epochs=2, batch_size=20, accum=3, lr=2e-3, max_lr=1e-2, max_norm=1.0,
              ckpt_every=0, precision="fp32")
    a = ref.train(model, (TRAIN.x, TRAIN.y), (VAL.x, VAL.y), tmp_path / "plain", **kw)
    b = accel.train(mine, (TRAIN.x, TRAIN.y), (VAL.x, VAL.y), tmp_path / "accel", **kw)
    wa, wb = _weights(model), _weights(mine)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r.get("grad_norm") for r in a["rows"]] == [r.get("grad_norm") for r in b["rows"]]
    assert (tmp_path / "accel" / "last.pt").exists() and (tmp_path / "accel" / "best.pt").exists()
