"""The default step for ``(inputs, targets)`` batches and Hugging Face-style outputs, and the
host-side label check that runs before a bad label can become a CUDA assert."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ironloop.errors import DataError, UserError

StepFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]

def classification_step(loss_fn) -> StepFn:
    """The default step for ``(inputs, targets)`` batches: loss, and accuracy when evaluating."""

    def step(model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(batch, dict):  # Hugging Face style: keyword inputs, the model's own loss
            return output_loss(model(**batch)), {}
        x, y = batch[0], batch[1]
        out = model(x)
        if not isinstance(out, torch.Tensor):
            return output_loss(out), {}
        try:
            loss = loss_fn(out, y)
        except (RuntimeError, ValueError) as e:
            if not _is_shape_error(e):
                raise
            raise misfit(out, y, e) from None
        if model.training or y.is_floating_point() or out.ndim != 2:
            return loss, {}
        return loss, {"acc": (out.argmax(-1) == y).float().mean()}

    return step


def _is_shape_error(e: Exception) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("size", "shape", "dimension", "expected input",
                                   "expected target"))


def misfit(out: torch.Tensor, y: torch.Tensor, e: Exception) -> UserError:
    """The one-line error for a model output whose shape does not fit the loss."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return UserError(f"the model's output {describe(out)} does not fit the loss for targets "
                     f"{describe(y)} ({first}); make the model's last layer output what the loss "
                     f"takes (cross_entropy: [batch, classes] scores for [batch] class indices), "
                     f"or set loss.name / pass a loss_fn or step_fn")


def output_loss(out) -> torch.Tensor:
    """The loss an HF-style output carries (``out.loss`` or ``out["loss"]``), or a one-line
    error saying what the model returned and what the default step needs instead."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise UserError(f"the model returned {describe(out)}; the default step needs a tensor of "
                    f"outputs, or an output carrying its loss (.loss or ['loss']). Pass a "
                    f"step_fn (train.step_fn=module:function) that computes the loss, or a "
                    f"loss_fn (loss.name=module:function) for the model's output")


def describe(obj, depth: int = 0) -> str:
    """Shapes and dtypes of a (nested) batch or output, for error messages."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if depth < 2 and isinstance(obj, dict):
        return "{" + ", ".join(f"{k}: {describe(v, depth + 1)}" for k, v in obj.items()) + "}"
    if depth < 2 and isinstance(obj, (list, tuple)):
        inner = ", ".join(describe(v, depth + 1) for v in obj)
        return f"a {type(obj).__name__} ({inner})"
    return "None" if obj is None else f"a {type(obj).__name__}"


def label_checker(num_classes: int) -> Callable[[Any], None]:
    """Reject class labels outside [0, C) on the host, with a message instead of a CUDA assert."""

    def check(batch) -> None:
        y = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.device.type != "cpu":
            return
        lo, hi = int(y.min()), int(y.max())  # host tensors: no device sync
        if lo < 0 or hi >= num_classes:
            raise DataError(f"labels must be class indices in [0, {num_classes}), found a batch "
                            f"with labels in [{lo}, {hi}]; fix the targets or the number of "
                            f"classes (the model's output size)")

    return check
