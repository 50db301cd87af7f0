"""tools.lab.reference in process: the reference scripts and the examples they load, their order,
settings and line diff."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ironloop.tools.lab import reference as lab_reference, run


@pytest.fixture
def cpu_bf16(monkeypatch):
    """A machine with no CUDA whose CPU runs bf16 natively (fp16 is emulated): the plan's and the
    sentences' machine-dependent parts fixed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)


# -- reference.py ---------------------------------------------------------------------------------

def test_the_reference_scripts_see_ironlooops_own_shuffled_order():
    from ironloop.data.loader import EpochSampler

    for epoch in (0, 3):
        sampler = EpochSampler(50, 1, 7, shuffle=True)
        sampler.set_epoch(epoch)
        assert torch.equal(lab_reference.ironloop_order(50, 7, epoch), sampler.permutation())
    order = lab_reference.ironloop_order(50, 7, 0)
    assert sorted(order.tolist()) == list(range(50)) and order.tolist() != list(range(50))
    assert not torch.equal(order, lab_reference.ironloop_order(50, 7, 1))
    assert not torch.equal(order, lab_reference.ironloop_order(50, 8, 0))


def test_the_examples_load_as_modules_with_their_train_function():
    module = lab_reference._load(lab_reference.PLAIN)
    assert module.__name__ == "ironloop_lab_production_loop" and callable(module.train)
    assert Path(module.__file__) == lab_reference.EXAMPLES / "production_loop.py"


def test_the_line_diff_counts_only_added_and_removed_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(lab_reference, "EXAMPLES", tmp_path)
    assert not lab_reference.available()
    (tmp_path / "production_loop.py").write_text("a\nb\nc\n-x\n")
    (tmp_path / "production_loop_accelerate.py").write_text("a\nB\nc\n-x\nd\n")
    assert lab_reference.available()
    diff, changed = lab_reference.line_diff()
    assert diff.splitlines() == ["--- production_loop.py", "+++ production_loop_accelerate.py",
                                 "@@ -2 +2 @@", "-b", "+B", "@@ -4,0 +5 @@", "+d"]
    assert changed == 3


def test_the_reference_scripts_train_with_step_6s_settings(tmp_path, monkeypatch, cpu_bf16):
    """run_references hands each script step 6's config as keyword arguments, the same initial
    weights, ironloop's order, and its own output folder; without accelerate the twin is
    skipped (None)."""
    variants = run.steps_plan("digits")
    cfg = run._cfg({**variants[5].overrides, "optim.weight_decay": 0.05,
                    "loss.label_smoothing": 0.1, "run.seed": 3}, tmp_path / "ref", "data")
    calls = []

    def fake_load(name):
        def train(model, train_set, val_set, out, **kw):
            calls.append((name, model, train_set, val_set, out, kw))
            return {"val_acc": 0.5 if name == lab_reference.PLAIN else 0.25, "steps": 7,
                    "other": 1}
        return SimpleNamespace(train=train)

    monkeypatch.setattr(lab_reference, "_load", fake_load)
    import importlib.util

    real = importlib.util.find_spec
    with monkeypatch.context() as m:  # accelerate installed or not, as the test needs
        m.setattr(importlib.util, "find_spec",
                  lambda name, *a: object() if name == "accelerate" else real(name, *a))
        got = lab_reference.run_references(cfg, tmp_path / "ref")
    assert [c[0] for c in calls] == ["production_loop", "production_loop_accelerate"]
    assert [c[4] for c in calls] == [tmp_path / "ref" / "production_loop",
                                     tmp_path / "ref" / "production_loop_accelerate"]
    kw = calls[0][5]
    assert kw == dict(epochs=5, batch_size=32, accum=4, lr=1e-3, max_lr=3e-3, weight_decay=0.05,
                      schedule="onecycle", max_norm=1.0, label_smoothing=0.1, precision="bf16",
                      seed=3, order=lab_reference.ironloop_order, ckpt_every=100)
    assert calls[1][5] == kw
    first, second = calls[0][1], calls[1][1]
    assert first is not second and all(torch.equal(a, b) for a, b in
                                       zip(first.state_dict().values(),
                                           second.state_dict().values()))
    (x, y), (vx, vy) = calls[0][2], calls[0][3]
    assert len(x) == len(y) == 1438 and len(vx) == len(vy) == 359
    diff, changed = lab_reference.line_diff()
    assert got == {"plain": {"val_acc": 0.5, "steps": 7}, "accel": {"val_acc": 0.25, "steps": 7},
                   "diff": diff, "diff_lines": changed}

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    calls.clear()
    got = lab_reference.run_references(cfg, tmp_path / "ref")
    assert [c[0] for c in calls] == ["production_loop"] and got["accel"] is None
    assert got["plain"] == {"val_acc": 0.5, "steps": 7}
