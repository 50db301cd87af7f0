"""Per-token losses: a step's loss weight across accumulation windows and ranks, perplexity, and
model-FLOPs utilisation.

A step that returns ``(loss, metrics, weight)`` says its loss is a mean over ``weight`` units
(tokens, or the valid tokens under ignore_index). The optimizer step must then follow the mean
over every token of its window, on every rank, not the mean of the micro-batches' means::

    grad = sum over micro-batches m and ranks r of  w_mr * grad(loss_mr)  /  sum of w_mr

The window's total weight is known only once its last micro-batch has run (a ragged window, a
batch with more padding), so each micro-batch backpropagates its loss times its weight, and
before the optimizer step the gradients are multiplied by ``world / W`` (DDP and FSDP average
the gradients over ranks; ``W`` is all-reduced). No host sync: ``W`` stays on the device.

With one micro-batch per window on one process there is nothing to weigh: the micro-batch's
mean is the window's, and the loop backpropagates the loss as it is (bit for bit what a plain
loop does).
"""

from __future__ import annotations

import math

import torch

from ironloop.parallel.world import World, all_reduce_sum


class WindowWeight:
    """The loss weights of the current accumulation window, summed on the device."""

    def __init__(self):
        self.total = None

    def add(self, weight) -> None:
        self.total = weight if self.total is None else self.total + weight

    def normalise(self, params: list, world: World) -> None:
        """Gradients from sum(weight x loss) to the window's mean per unit, over all ranks."""
        if self.total is None:
            return
        device = _device_of(params)
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        total = torch.as_tensor(self.total, dtype=dtype, device=device)
        if world.size > 1:
            total = all_reduce_sum(total, world)  # the window's units over every rank
        factor = (world.size / total.clamp(min=1)).float()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)  # a device scalar: no host sync
        self.total = None


def _device_of(params: list) -> torch.device:
    return next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))


def perplexity(loss: float) -> float:
    """exp(the mean loss per token); inf where exp overflows a double."""
    return math.exp(loss) if loss < 709.0 else float("inf")


def mfu(parameters: int, tokens_per_s: float, peak_tflops: float) -> float:
    """Model-FLOPs utilisation: ``6 x N x tokens/s / peak``. 6N is the forward (2N: a multiply
    and an add per parameter per token) plus the backward (4N) of a dense model; attention's
    own FLOPs and recomputation are left out, as in the PaLM paper's definition."""
    return 6.0 * parameters * tokens_per_s / (peak_tflops * 1e12)
