"""The gradient's global norm and clipping, on the device: the loop's unscale -> norm -> guard ->
clip order needs the norm before the clip, so the two halves of ``clip_grad_norm_`` are apart.
Under FSDP2 the gradients are shards (DTensors) and the global norm is a collective."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ironloop.parallel import data_parallel


def clip_gradients(params, max_norm: float, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip in place; return the PRE-clip global L2 norm and whether clipping acted.

    Both stay on the device. ``max_norm`` 0 disables clipping but still measures the norm.
    """
    params = [p for p in params if p.grad is not None]
    norm = grad_norm_of(params)
    return norm, clip_to_norm(params, norm, max_norm, mode)


def grad_norm_of(params: list) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` (those with a grad), on the device.
    Under FSDP2 the grads are shards: the norm of the whole is a collective (full_tensor)."""
    if not params:
        return torch.zeros(())
    grads = [p.grad for p in params]
    norm = _total_norm(grads)
    return data_parallel.full_tensor(norm) if data_parallel.is_sharded(grads[0]) else norm


def clip_to_norm(params: list, norm: torch.Tensor, max_norm: float, mode: str) -> torch.Tensor:
    """Clip in place given the pre-clip ``norm``; returns whether clipping acted (on device).
    Same arithmetic as ``clip_grad_norm_``, which is this norm + ``clip_grads_with_norm_``."""
    if not params:
        return torch.zeros((), dtype=torch.bool)
    if mode == "norm" and max_norm > 0:
        if hasattr(nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
            nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        else:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad.detach().mul_(coef.to(p.grad.device))
        return norm > max_norm
    if mode == "value" and max_norm > 0:
        grads = [p.grad for p in params]
        peak = torch.stack([data_parallel.full_tensor(g.detach().abs().max()) for g in grads])
        clipped = peak.max() > max_norm
        nn.utils.clip_grad_value_(params, max_norm)
        return clipped
    return _not_clipped(norm.device)


@functools.cache
def _not_clipped(device: torch.device) -> torch.Tensor:
    """Clipping off: one False per device, made once rather than per step (the meter only
    stacks these flags, never writes them)."""
    return torch.zeros((), dtype=torch.bool, device=device)


#: Devices whose plain tensors get_total_norm sends to torch._foreach_norm (its
#: ``_has_foreach_support``: CUDA, XPU and the CPU among others; another device takes it).
_FOREACH_NORM = frozenset({"cpu", "cuda", "xpu"})


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    first = grads[0]
    if type(first) is torch.Tensor and first.device.type in _FOREACH_NORM and all(
            type(g) is torch.Tensor and g.device == first.device and g.dtype == first.dtype
            and not g.requires_grad for g in grads):
        # One device and dtype, plain tensors outside any graph: get_total_norm's own foreach
        # branch, without its per-call grouping and support checks (half its cost on a small
        # model's step); the same kernels in the same order, so the same bits.
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if hasattr(nn.utils, "get_total_norm"):  # torch >= 2.6
        return nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
