"""Device and mixed-precision decisions: which device, which autocast dtype, whether to scale."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from ironloop.errors import ConfigError
from ironloop.parallel.data_parallel import NO_CONTEXT


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


def resolve_precision(name: str, device: torch.device, is_main: bool = True) -> str:
    """``auto`` is bf16 on a bf16-capable CUDA GPU and fp32 everywhere else (a CPU included:
    most CPUs emulate bf16 and fp16 autocast). An explicit bf16 or fp16 on a CPU without native
    bf16 instructions is honoured, with one warning."""
    if name == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    # fp16 autocast is emulated on CPUs (seconds a step for the digits CNN); bf16 is too unless
    # the CPU has bf16 instructions.
    if device.type == "cpu" and is_main and \
            (name == "fp16" or (name == "bf16" and not cpu_has_native_bf16())):
        _warn_emulated(name)
    return name


#: CPU feature flags with native bf16 arithmetic: x86 AVX512-BF16 and AMX, Arm's BF16.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively: a flag in /proc/cpuinfo (Linux), else Apple
    silicon. torch's own capability string (``torch.backends.cpu.get_cpu_capability()``) says
    AVX512 or not, which does not tell AVX512-BF16 apart, hence the flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return sys.platform == "darwin" and "arm" in _machine()
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return any(f in flags for f in BF16_FLAGS)


def _machine() -> str:
    import platform

    return platform.machine().lower()


@functools.cache  # once per process and precision: a warning, not a log
def _warn_emulated(name: str) -> None:
    why = ("fp16 autocast is emulated on a CPU, many times slower than fp32 (seconds a step "
           "for the digits CNN)") if name == "fp16" else (
          "this CPU has no native bf16 (no avx512_bf16/amx flag): autocast emulates it, and a "
          "GPT-2-sized model trained 10-12x slower than in fp32 on such a CPU")
    print(f"warning: train.precision={name} on a CPU: {why}; use train.precision=fp32 (or "
          f"auto)", file=sys.stderr)


def autocast(precision: str, device: torch.device):
    """A context for the forward pass: autocast to fp16/bf16, or nothing for fp32."""
    if precision == "fp32":
        return NO_CONTEXT  # one null context for every step (data_parallel.NO_CONTEXT)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
