"""Device and mixed-precision decisions: which device, which autocast dtype, whether to scale."""

from __future__ import annotations

import contextlib

import torch

from ironloop.errors import ConfigError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device='cuda' but torch sees no CUDA device; use run.device=cpu "
                              "or auto, or install a CUDA build of torch")
        return torch.device("cuda", local_rank)
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise ConfigError("run.device='mps' but MPS is not available; use run.device=cpu or auto")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` is bf16 on a bf16-capable CUDA GPU and fp32 everywhere else."""
    if name == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return name


def autocast(precision: str, device: torch.device):
    """A context for the forward pass: autocast to fp16/bf16, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
