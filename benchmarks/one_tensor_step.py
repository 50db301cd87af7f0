"""A one-tensor dataset's step (a diffusion model or a GAN trained on images alone) through
``fit()`` against a hand loop, on the same CPU in one process (issue 59, item 7).

Both train the same small denoiser (an MLP predicting the noise added to a 64-feature sample)
with AdamW, batch 64, on a ``TensorDataset`` of one tensor, clipping off (the hand loop does not
clip). A step's cost is the marginal one: the time of a long run minus a short one, over the
steps between, so that neither ``fit()``'s start (run directory, config, logs) nor the hand
loop's warm-up counts. The repetitions alternate the two loops. Each run is timed twice: wall
time, and the process's CPU time (one thread: what the step costs, without the waits a shared
machine's other processes add, which the wall time shows as noise).

    python benchmarks/one_tensor_step.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, size, summary

import ironloop

BATCH, FEATURES = 64, 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.SiLU(), nn.Linear(128, FEATURES))


def _step(model, batch):
    (x,) = batch
    noise = torch.randn_like(x)  # a diffusion step draws its noise every step
    return nn.functional.mse_loss(model(x + noise), noise), {}


def _hand(data: torch.Tensor, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds for ``steps`` steps of the loop a user would write."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    order, at = torch.randperm(len(data), generator=g), 0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        if at + BATCH > len(order):
            order, at = torch.randperm(len(data), generator=g), 0
        x = data.index_select(0, order[at:at + BATCH])
        at += BATCH
        opt.zero_grad(set_to_none=True)
        loss, _ = _step(model, (x,))
        loss.backward()
        opt.step()
    return time.perf_counter() - start, time.process_time() - cpu


def _ironloop(data: torch.Tensor, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds for a whole ``fit()`` of ``steps`` steps on the one-tensor
    TensorDataset."""
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu = time.perf_counter(), time.process_time()
        ironloop.fit(_model(), TensorDataset(data), None, {
            "run.dir": tmp, "run.device": "cpu", "train.batch_size": BATCH,
            "train.epochs": 10**6, "train.max_steps": steps, "clip.max_norm": 0,
            "checkpoint.enabled": False, "log.progress": "off", "data.val_fraction": 0,
            "optim.name": "adamw", "optim.lr": 1e-3, "optim.weight_decay": 0.01,
            "schedule.name": "constant"}, step_fn=_step)
        return time.perf_counter() - start, time.process_time() - cpu


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    data = torch.randn(size(4096, 4096, 256, quick), FEATURES,
                       generator=torch.Generator().manual_seed(1))
    short, long = size(100, 50, 2, quick), size(600, 300, 6, quick)
    reps = size(7, 3, 1, quick)
    per_step: dict[str, list[float]] = {"hand": [], "fit": [], "hand_cpu": [], "fit_cpu": []}
    for _ in range(reps):  # alternated, so a change in the machine's load hits both
        for name, loop in (("hand", _hand), ("fit", _ironloop)):
            (wall_l, cpu_l), (wall_s, cpu_s) = loop(data, long), loop(data, short)
            per_step[name].append(1000 * (wall_l - wall_s) / (long - short))
            per_step[f"{name}_cpu"].append(1000 * (cpu_l - cpu_s) / (long - short))
    ratios = [f / h for f, h in zip(per_step["fit"], per_step["hand"])]
    cpu_ratios = [f / h for f, h in zip(per_step["fit_cpu"], per_step["hand_cpu"])]
    rows = [summary("hand loop: ms per step (one-tensor TensorDataset, batch 64)",
                    per_step["hand"], unit="ms"),
            summary("fit(): ms per step (same data, model and optimizer)", per_step["fit"],
                    unit="ms"),
            summary("fit() / hand loop, per repetition", ratios, unit="x"),
            summary("hand loop: CPU ms per step", per_step["hand_cpu"], unit="ms"),
            summary("fit(): CPU ms per step", per_step["fit_cpu"], unit="ms"),
            summary("fit() / hand loop, CPU time, per repetition", cpu_ratios, unit="x")]
    ratio = statistics.median(ratios)
    return {"name": "one_tensor_step",
            "description": "a one-tensor dataset's step through fit() against a hand loop",
            "results": rows, "ratio": {"wall": ratio, "cpu": statistics.median(cpu_ratios)},
            "target": "fit() within 1.1x of the hand loop (wall time)",
            "met": None if TINY else ratio <= 1.1,
            "notes": "marginal step time (long run minus short run); clipping off in both"}


if __name__ == "__main__":
    from _common import main

    main(run)
