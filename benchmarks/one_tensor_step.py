"""A one-tensor dataset's step (a diffusion model or a GAN trained on images alone) through
``fit()`` against a hand loop, on the same CPU in one process (issue 59, item 7).

Both train the same small denoiser (an MLP predicting the noise added to a 64-feature sample)
with AdamW, batch 64, on a ``TensorDataset`` of one tensor, clipping off (the hand loop does not
clip). The two loops run **paired**: every call of ``fit()``'s step function also runs one step
of the hand loop (its own model, optimizer and order) and times it apart. A ``fit()`` step is
then the time from the end of one such embedded hand step to the start of the next call, which
holds everything ``fit()`` does per step (the optimizer step, the guard, the norm, logging,
epoch ends, its data path) and nothing of the hand loop. Both are sampled in the same
milliseconds, so the shared machine's changing speed (its other processes, frequency steps)
hits both alike; timing the two loops one after the other, as this benchmark first did,
gave per-repetition ratios spread over 0.9-1.8x on an idle machine, from that alone.

Three rows, each its own ``fit()`` run per repetition:
- **the same optimizer**: ``torch.optim.AdamW(model.parameters(), lr=1e-3)`` is one param
  group with weight decay 0.01 on every parameter; ``optim.decay_bias_and_norm=true`` builds
  exactly that (ironloop's kernel choice, fused AdamW, is part of what is measured);
- **ironloop's default optimizer**: two param groups (no decay on biases and norms), so the
  fused kernel and its found_inf bookkeeping run twice a step. A difference of configuration,
  not of loop, shown so that nobody mistakes the first row for the default;
- **a DDPM** the size of the workloads issue 59 measured (its DDPM took 7.1 ms a step by hand,
  its GAN 9.3): a 0.6M-parameter noise predictor on the noisy sample and its timestep, batch
  128, a timestep and noise drawn per sample every step, the hand loop's optimizer. The target
  (``met``) is this row's: the issue's complaint was such steps at 1.35-1.45x. The MLP rows'
  step is ten times smaller (under a millisecond), where ``fit()``'s fixed per-step work (the
  pre-clip norm, the guard's device verdict, the meter's sums, about 0.1 ms here) shows most.

    python benchmarks/one_tensor_step.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, size, summary

import ironloop

BATCH, FEATURES = 64, 64
WARM = 100  # steps of each loop left out at the start (first allocations, lazy state)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.SiLU(), nn.Linear(128, FEATURES))


def _step(model, batch):
    (x,) = batch
    noise = torch.randn_like(x)  # a diffusion step draws its noise every step
    return nn.functional.mse_loss(model(x + noise), noise), {}


T = 1000  # diffusion timesteps
ALPHA_BAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T), 0)


class Denoiser(nn.Module):
    """A DDPM's noise predictor (0.6M parameters): an MLP on the noisy sample and its
    timestep."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES + 1, 512), nn.SiLU(), nn.Linear(512, 512),
                                 nn.SiLU(), nn.Linear(512, 512), nn.SiLU(),
                                 nn.Linear(512, FEATURES))

    def forward(self, x, t):
        return self.net(torch.cat([x, (t.float() / T)[:, None]], 1))


def _ddpm_step(model, batch):
    """The DDPM training step: a timestep and noise per sample, drawn every step."""
    (x,) = batch
    t = torch.randint(0, T, (len(x),))
    noise = torch.randn_like(x)
    a = ALPHA_BAR[t][:, None]
    return nn.functional.mse_loss(model(a.sqrt() * x + (1 - a).sqrt() * noise, t), noise), {}


class HandLoop:
    """The loop a user would write, one step per ``step()`` call."""

    def __init__(self, data: torch.Tensor, model: nn.Module, step, batch: int):
        self.data, self.model, self.step_fn, self.batch = data, model, step, batch
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(0)
        self.order, self.at = torch.randperm(len(data), generator=self.gen), 0

    def step(self) -> None:
        if self.at + self.batch > len(self.order):
            self.order, self.at = torch.randperm(len(self.data), generator=self.gen), 0
        x = self.data.index_select(0, self.order[self.at:self.at + self.batch])
        self.at += self.batch
        self.opt.zero_grad(set_to_none=True)
        loss, _ = self.step_fn(self.model, (x,))
        loss.backward()
        self.opt.step()


class Paired:
    """``fit()``'s step function: runs one hand-loop step first, timed apart, and records the
    time ``fit()`` spent since the previous call's hand step ended."""

    def __init__(self, hand: HandLoop, warm: int, step):
        self.hand, self.warm, self.calls, self.step_fn = hand, warm, 0, step
        self.fit: list[float] = []
        self.hand_s: list[float] = []
        self.since: float | None = None

    def __call__(self, model, batch):
        start = time.perf_counter()
        self.calls += 1
        if self.since is not None:
            self.fit.append(start - self.since)
        if self.calls > self.warm:
            self.hand.step()
            end = time.perf_counter()
            self.hand_s.append(end - start)
            self.since = end
        else:
            self.since = None if self.calls < self.warm else time.perf_counter()
        return self.step_fn(model, batch)


def _paired_run(data: torch.Tensor, steps: int, warm: int, row: Row) -> tuple[float, float]:
    """(fit, hand) mean ms per step over one paired ``fit()`` run of ``steps`` steps."""
    paired = Paired(HandLoop(data, row.model(), row.step, row.batch), warm, row.step)
    with tempfile.TemporaryDirectory() as tmp:
        ironloop.fit(row.model(), TensorDataset(data), None, {
            "run.dir": tmp, "run.device": "cpu",
            "train.epochs": 10**6, "train.max_steps": steps, "clip.max_norm": 0,
            "train.batch_size": row.batch,
            "checkpoint.enabled": False, "log.progress": "off", "data.val_fraction": 0,
            "optim.name": "adamw", "optim.lr": 1e-3, "optim.weight_decay": 0.01,
            "schedule.name": "constant", **row.overrides}, step_fn=paired)
    # The last hand step has no fit() interval after it: pair the equal-length prefixes.
    n = len(paired.fit)
    return 1000 * sum(paired.fit) / n, 1000 * sum(paired.hand_s[:n]) / n


class Row(NamedTuple):
    """One row of the table: its workload and the config overrides of its ``fit()`` run."""

    label: str
    model: Callable[[], nn.Module]
    step: Callable
    batch: int
    overrides: dict
    fewer: int  # a run of this row takes 1/fewer of the steps (a larger step)


SAME = {"optim.decay_bias_and_norm": True}  # AdamW(model.parameters()): one param group
ROWS = {"same": Row("MLP denoiser, the hand loop's optimizer: one param group", _model, _step,
                    BATCH, SAME, 1),
        "default": Row("MLP denoiser, ironloop's default optimizer: two param groups", _model,
                       _step, BATCH, {}, 1),
        "ddpm": Row("DDPM denoiser, 0.6M parameters, the hand loop's optimizer", Denoiser,
                    _ddpm_step, 128, SAME, 4)}


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    data = torch.randn(size(4096, 4096, 256, quick), FEATURES,
                       generator=torch.Generator().manual_seed(1))
    steps, warm = size(2100, 600, 6, quick), size(WARM, WARM, 2, quick)
    reps = size(5, 2, 1, quick)
    got: dict[str, dict[str, list[float]]] = {k: {"fit": [], "hand": [], "ratio": []}
                                              for k in ROWS}
    for _ in range(reps):  # the rows alternate, so a change in the machine's load hits both
        for key, row in ROWS.items():
            fit_ms, hand_ms = _paired_run(data, max(steps // row.fewer, warm + 4), warm, row)
            got[key]["fit"].append(fit_ms)
            got[key]["hand"].append(hand_ms)
            got[key]["ratio"].append(fit_ms / hand_ms)
    rows = []
    for key, (label, *_) in ROWS.items():
        rows += [summary(f"hand loop: ms per step (paired with fit(), {label})",
                         got[key]["hand"], unit="ms"),
                 summary(f"fit(): ms per step ({label})", got[key]["fit"], unit="ms"),
                 summary(f"fit() / hand loop, per run ({label})", got[key]["ratio"],
                         unit="x")]
    ratio = statistics.median(got["ddpm"]["ratio"])
    return {"name": "one_tensor_step",
            "description": "a one-tensor dataset's step through fit() against a hand loop, "
                           "paired step by step in one process",
            "results": rows,
            "ratio": {"same_optimizer": statistics.median(got["same"]["ratio"]),
                      "default_optimizer": statistics.median(got["default"]["ratio"]),
                      "ddpm": ratio},
            "target": "fit() within 1.1x of the hand loop at a DDPM's step, with the hand "
                      "loop's optimizer (the sub-millisecond MLP rows are reported beside it)",
            "met": None if TINY else ratio <= 1.1,
            "notes": f"{steps} steps a run, the first {warm} left out; clipping off in both"}


if __name__ == "__main__":
    from _common import main

    main(run)
