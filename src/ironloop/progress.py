"""The loop's counters and running sums, each with state_dict/load_state_dict.

The running sums stay on the device and are read only at log steps and epoch ends, so the
loop makes no host sync per step. They are part of the checkpoint, so a resumed run logs the
same losses as an uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Progress:
    epoch: int = 0   # the epoch in progress, 0-based
    step: int = 0    # optimizer steps done
    offset: int = 0  # samples of this epoch consumed, counted over all ranks
    samples: int = 0  # samples consumed since the start of the run, over all ranks

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def _sum_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class _Sums:
    """Device-side sums of loss*samples, clipped and skipped steps, plus host-side counts."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        # [loss * samples, clipped steps, skipped steps]
        self.acc = torch.zeros(3, dtype=_sum_dtype(self.device), device=self.device)
        self.samples = 0
        self.steps = 0

    def state_dict(self) -> dict:
        return {"acc": self.acc.cpu().clone(), "samples": self.samples, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.acc = state["acc"].to(self.device, _sum_dtype(self.device))
        self.samples, self.steps = state["samples"], state["steps"]


class Meter:
    """What metrics.jsonl (per log window) and epochs.jsonl (per epoch) report.

    ``reduce`` sums a tensor over ranks (all_reduce) so that, under DDP, the logged loss and
    throughput cover every rank's samples. Clip and skip counts need no reduction: every rank
    sees the same all-reduced gradients.
    """

    def __init__(self, device: torch.device, reduce=None):
        self.reduce = reduce
        self.window, self.epoch = _Sums(device), _Sums(device)
        self.grad_norm = torch.zeros((), device=device)
        self.window_start = self.epoch_start = time.perf_counter()

    def start_epoch(self) -> None:
        """Training time of an epoch starts here, not when the previous one was flushed."""
        self.epoch_start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Keep time that was not training (validation, end-of-epoch checkpoints) out of the
        log window's samples/s."""
        self.window_start += seconds

    def add_micro(self, loss: torch.Tensor, n: int) -> None:
        contrib = loss.detach().to(self.window.acc.dtype) * n  # stays on the device: no sync
        for s in (self.window, self.epoch):
            s.acc[0] += contrib
            s.samples += n

    def add_step(self, grad_norm: torch.Tensor, clipped: torch.Tensor,
                 skipped: torch.Tensor | None) -> None:
        self.grad_norm = grad_norm.detach()
        dtype = self.window.acc.dtype
        skipped = torch.zeros((), device=clipped.device) if skipped is None else skipped
        flags = torch.stack([clipped.to(dtype), skipped.to(dtype)])
        for s in (self.window, self.epoch):
            s.acc[1:] += flags
            s.steps += 1

    def flush_window(self) -> dict:
        """Read and reset the log window. This is a host-device sync: call at log steps only."""
        w = self.window
        loss_sum, samples, clipped, skipped, grad_norm = torch.cat(
            [self._over_ranks(w), w.acc[1:], self.grad_norm.to(w.acc.dtype).reshape(1)]
        ).tolist()  # host sync
        now = time.perf_counter()
        row = {"loss": loss_sum / max(samples, 1), "grad_norm": grad_norm,
               "clipped": int(clipped), "steps": w.steps, "skipped": int(skipped),
               "samples_per_s": samples / max(now - self.window_start, 1e-9)}
        w.reset()
        self.window_start = now
        return row

    def flush_epoch(self) -> dict:
        """Read and reset the epoch sums. A host-device sync, once per epoch."""
        e = self.epoch
        loss_sum, samples, clipped, skipped = torch.cat(
            [self._over_ranks(e), e.acc[1:]]).tolist()  # host sync
        now = time.perf_counter()
        row = {"train_loss": loss_sum / max(samples, 1),
               "clipped_frac": clipped / max(e.steps, 1), "skipped": int(skipped),
               "train_seconds": now - self.epoch_start,
               "samples_per_s": samples / max(now - self.epoch_start, 1e-9)}
        e.reset()
        return row

    def _over_ranks(self, sums: _Sums) -> torch.Tensor:
        """[loss * samples, samples], summed over ranks when distributed."""
        t = torch.stack([sums.acc[0], sums.acc.new_tensor(float(sums.samples))])
        return self.reduce(t) if self.reduce is not None else t

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict(), "epoch": self.epoch.state_dict(),
                "grad_norm": self.grad_norm.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])
        self.epoch.load_state_dict(state["epoch"])
        self.grad_norm = state["grad_norm"].to(self.window.device)
