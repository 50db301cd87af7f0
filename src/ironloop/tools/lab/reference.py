"""The lab's hand-written twins: examples/production_loop.py and its Accelerate version, run on
the lab's data with step 6's config, the same initial weights and ironloop's data order.

The examples live in the source tree, not in the installed package: without them this part of
the lab is skipped with a note.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import torch

from ironloop.config import Config
from ironloop.data import build_data
from ironloop.data.loader import EpochSampler
from ironloop.engine.precision import resolve_device
from ironloop.tools.models import model_for

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
PLAIN, ACCEL = "production_loop", "production_loop_accelerate"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"ironloop_lab_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None  # a .py file always has a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ironloop_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    sampler = EpochSampler(n, 1, seed, shuffle=True)
    sampler.set_epoch(epoch)
    return sampler.permutation()


def line_diff() -> tuple[str, int]:
    """The unified diff between the two scripts, and how many lines it adds or removes."""
    a = (EXAMPLES / f"{PLAIN}.py").read_text().splitlines()
    b = (EXAMPLES / f"{ACCEL}.py").read_text().splitlines()
    diff = list(difflib.unified_diff(a, b, f"{PLAIN}.py", f"{ACCEL}.py", n=0, lineterm=""))
    changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
    return "\n".join(diff), changed


def available() -> bool:
    return (EXAMPLES / f"{PLAIN}.py").is_file()


def run_references(cfg: Config, out: Path) -> dict:
    """Train both scripts as ironloop's ``cfg`` would; returns their results and the diff."""
    bundle = build_data(cfg.data)
    kw = dict(epochs=cfg.train.epochs, batch_size=cfg.train.batch_size,
              accum=cfg.train.accumulation_steps, lr=cfg.optim.lr,
              max_lr=cfg.schedule.max_lr, weight_decay=cfg.optim.weight_decay,
              schedule=cfg.schedule.name, max_norm=cfg.clip.max_norm,
              label_smoothing=cfg.loss.label_smoothing, precision=cfg.train.precision,
              seed=cfg.run.seed, order=ironloop_order, ckpt_every=cfg.checkpoint.every_steps)
    train_set = (bundle.train.x, bundle.train.y)
    assert bundle.val is not None  # the lab's datasets all have a validation split
    val_set = (bundle.val.x, bundle.val.y)
    results: dict[str, dict | None] = {}
    for name in (PLAIN, ACCEL):
        if name == ACCEL and importlib.util.find_spec("accelerate") is None:
            results[name] = None
            continue
        # as train_config does: the same initial weights
        model = model_for(cfg, bundle).to(resolve_device(cfg.run.device))
        res = _load(name).train(model, train_set, val_set, out / name, **kw)
        results[name] = {"val_acc": res["val_acc"], "steps": res["steps"]}
    diff, changed = line_diff()
    return {"plain": results[PLAIN], "accel": results[ACCEL], "diff": diff,
            "diff_lines": changed}
