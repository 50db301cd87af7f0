"""Fabricated measurements, subjects and a fake clock that the tune tests share."""

from __future__ import annotations

import torch
from torch import nn

from ironloop.config import Config
from ironloop.tools.tune.trials import Measure, Subject


class FakeClock:
    """time.perf_counter for a module under test: it moves only when the test moves it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def mk(sps: float, extra_s: float = 0.0, seconds: float = 1.0, peak_mb: float | None = None,
       spread: tuple[float, float] | None = None, step_ms: float = 10.0) -> Measure:
    lo, hi = spread or (sps, sps)
    return Measure(samples_per_s=sps, spread=(lo, hi), windows=[lo, sps, hi], step_ms=step_ms,
                   extra_s=extra_s, seconds=seconds, peak_mb=peak_mb)


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.zeros(n, dtype=torch.long)


def subject(cfg: dict | None = None, train=None, **fit_kwargs) -> Subject:
    return Subject(Config.from_dict(cfg or {}), lambda: nn.Linear(4, 2),
                   data() if train is None else train, fit_kwargs)


class Reads(torch.utils.data.Dataset):
    """A dataset read item by item (not in-memory tensors): workers may help it."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        return torch.zeros(4), 0


class Bar:
    def __init__(self):
        self.descriptions: list[str] = []
        self.updates = 0

    def set_description(self, text: str) -> None:
        self.descriptions.append(text)

    def update(self, n: int) -> None:
        self.updates += n
