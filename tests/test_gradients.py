"""The pre-clip norm and clipping, apart from the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ironloop.engine.gradients import clip_gradients


def test_clip_returns_pre_clip_norm_and_flags():
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm, clipped = clip_gradients([p], 1.0, "norm")
    assert float(norm) == pytest.approx(5.0) and bool(clipped)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.tensor([3.0, -4.0, 0.0, 0.0])
    norm, clipped = clip_gradients([p], 2.0, "value")
    assert float(norm) == pytest.approx(5.0) and bool(clipped)
    assert p.grad.tolist() == [2.0, -2.0, 0.0, 0.0]
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm, clipped = clip_gradients([p], 0.0, "norm")  # disabled: measured, untouched
    assert float(norm) == pytest.approx(5.0) and not bool(clipped)
    assert p.grad.tolist() == [3.0, 4.0, 0.0, 0.0]
