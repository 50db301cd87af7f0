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

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def _sum_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class Meter:
    """What metrics.jsonl (per log window) and epochs.jsonl (per epoch) report.

    It keeps running totals since the start of the run, on the device, so a micro-batch costs
    one in-place add and an optimizer step none (the clip flags are summed when read, the fp16
    skip flag is one add); a log window or an epoch is the difference between the totals now
    and a mark taken where it began.

    Training time is a running total too (``train_seconds``), kept in the checkpoint: a resumed
    epoch's time is the first process's training time up to the checkpoint plus the resumed
    process's, matching its samples. Time lost to a crash (steps done after the checkpoint, then
    redone) is counted once, for the steps that were kept; events.jsonl records the redone steps.

    ``reduce`` sums a tensor over ranks (all_reduce) so that, under DDP, the logged loss and
    throughput cover every rank's samples. Clip and skip counts need no reduction: every rank
    sees the same all-reduced gradients.
    """

    def __init__(self, device: torch.device, reduce=None):
        self.reduce = reduce
        dtype = _sum_dtype(device)
        self.loss_sum = torch.zeros((), dtype=dtype, device=device)  # sum of loss * samples
        self.clipped = torch.zeros((), dtype=dtype, device=device)   # steps clipped
        self.skipped = torch.zeros((), dtype=dtype, device=device)   # fp16 steps skipped
        self.tokens = torch.zeros((), dtype=dtype, device=device)    # the steps' loss weights
        self.grad_norm = torch.zeros((), device=device)              # of the last step
        self.samples = self.steps = 0                                # host-side counts
        self.elapsed = 0.0                        # training seconds before clock_start
        self.clock_start = time.perf_counter()
        self._clip_flags: list[torch.Tensor] = []  # this window's per-step flags, not yet summed
        self._oks: list[torch.Tensor] = []         # the guard's verdicts for those steps
        self.window_mark = self.epoch_mark = self._mark()
        # Every rank's state_dict at the last checkpoint (gathered by Run.save, engine/run.py):
        # rank 0 writes the checkpoint, and the logged sums are over all ranks' samples.
        self.ranks: list[dict] = []

    def _totals(self) -> torch.Tensor:
        if self._clip_flags:  # one sum per read instead of one add per step
            flags = torch.stack(self._clip_flags)
            if self._oks:
                flags = flags & torch.stack(self._oks)
            self.clipped.add_(flags.sum())
            self._clip_flags.clear()
            self._oks.clear()
        return torch.stack([self.loss_sum, self.clipped, self.skipped, self.tokens])

    def train_seconds(self) -> float:
        """Training seconds over the whole run, every process of it."""
        return self.elapsed + time.perf_counter() - self.clock_start

    def _mark(self) -> dict:
        return {"totals": self._totals(), "samples": self.samples, "steps": self.steps,
                "train_seconds": self.train_seconds()}

    def start_clock(self) -> None:
        """Training time runs from here (the loop's start), not from the meter's creation."""
        self.clock_start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Keep time that was not training (validation, end-of-epoch checkpoints) out of the
        training time and the samples/s."""
        self.elapsed -= seconds

    def add_micro(self, loss: torch.Tensor, n: int, weight=None) -> None:
        """A micro-batch of ``n`` samples; a step that weights its loss (tokens) gives
        ``weight``, and the logged loss is then the mean per token."""
        # Out of place, on the device (no sync): the guard keeps the totals from before a
        # window by reference and puts them back when the window turns out bad.
        if weight is None:
            self.loss_sum = self.loss_sum.add(loss.detach(), alpha=n)
        else:
            self.loss_sum = self.loss_sum.add(loss.detach() * weight)
            self.tokens = self.tokens.add(weight)
        self.samples += n

    def add_step(self, grad_norm: torch.Tensor, clipped: torch.Tensor,
                 skipped: torch.Tensor | None, ok: torch.Tensor | None = None) -> None:
        """One optimizer step. ``ok``: the guard's device verdict; a bad step's clip and
        fp16-skip flags are masked on the device, its counts taken back by ``forget``."""
        # A norm of gradients carries no graph (unless backward built one: create_graph).
        self.grad_norm = grad_norm.detach() if grad_norm.requires_grad else grad_norm
        self._clip_flags.append(clipped)  # summed when the totals are next read
        if ok is not None:
            self._oks.append(ok)  # a bad step's flag is masked then, not per step
        if skipped is not None:
            self.skipped.add_(skipped if ok is None else skipped * ok)
        self.steps += 1

    def forget(self, samples: int, steps: int) -> None:
        """Take back the counts of steps the guard found bad after the fact."""
        self.samples -= samples
        self.steps -= steps

    def _since(self, mark: dict) -> tuple[list[float], int]:
        """(loss_sum, samples and tokens over all ranks, clipped, skipped, grad_norm), since
        ``mark``. This is a host-device sync."""
        delta = self._totals() - mark["totals"]
        samples = self.samples - mark["samples"]
        shared = torch.stack([delta[0], delta.new_tensor(float(samples)), delta[3]])
        if self.reduce is not None:
            shared = self.reduce(shared)
        values = torch.cat([shared, delta[1:3], self.grad_norm.to(delta.dtype).reshape(1)])
        return values.tolist(), self.steps - mark["steps"]  # host sync

    @staticmethod
    def _per_unit(loss_sum: float, samples: float, tokens: float, seconds: float) -> dict:
        """The mean loss per token when the step weights its loss, else per sample; and the
        throughput in both."""
        out = {"loss": loss_sum / max(tokens if tokens else samples, 1),
               "samples_per_s": samples / max(seconds, 1e-9)}
        if tokens:
            out["tokens_per_s"] = tokens / max(seconds, 1e-9)
        return out

    def flush_window(self) -> dict:
        """Read the log window and start a new one. A host sync: call at log steps only."""
        (loss_sum, samples, tokens, clipped, skipped, grad_norm), steps = \
            self._since(self.window_mark)
        seconds = self.train_seconds() - self.window_mark.get("train_seconds", 0.0)
        per = self._per_unit(loss_sum, samples, tokens, seconds)
        row = {"loss": per.pop("loss"), "grad_norm": grad_norm, "clipped": int(clipped),
               "steps": steps, "skipped": int(skipped), **per}
        self.window_mark = self._mark()
        return row

    def flush_epoch(self) -> dict:
        """Read the epoch and start a new one. A host sync, once per epoch."""
        (loss_sum, samples, tokens, clipped, skipped, _), steps = self._since(self.epoch_mark)
        seconds = self.train_seconds() - self.epoch_mark.get("train_seconds", 0.0)
        per = self._per_unit(loss_sum, samples, tokens, seconds)
        row = {"train_loss": per.pop("loss"), "clipped_frac": clipped / max(steps, 1),
               "skipped": int(skipped), "train_seconds": seconds, **per}
        self.epoch_mark = self._mark()
        return row

    def state_dict(self) -> dict:
        def cpu(mark: dict) -> dict:
            return {**mark, "totals": mark["totals"].cpu().clone()}

        state = {"totals": self._totals().cpu().clone(),  # host sync: at checkpoints only
                 "grad_norm": self.grad_norm.cpu().clone(),
                 "samples": self.samples, "steps": self.steps,
                 "train_seconds": self.train_seconds(),
                 "window_mark": cpu(self.window_mark), "epoch_mark": cpu(self.epoch_mark)}
        if self.ranks:  # under DDP/FSDP: every rank's own sums, gathered by the save
            state["ranks"] = self.ranks
        return state

    def load_state_dict(self, state: dict) -> None:
        device, dtype = self.loss_sum.device, self.loss_sum.dtype
        totals = _four(state["totals"]).to(device, dtype)
        self.loss_sum, self.clipped, self.skipped, self.tokens = (t.clone() for t in totals)
        self.grad_norm = state["grad_norm"].to(device)
        self.samples, self.steps = state["samples"], state["steps"]
        # A checkpoint from before training time was kept: its marks carry no time either.
        self.elapsed, self.clock_start = state.get("train_seconds", 0.0), time.perf_counter()
        self._clip_flags, self._oks = [], []
        for name in ("window_mark", "epoch_mark"):
            mark = state[name]
            setattr(self, name, {**mark, "totals": _four(mark["totals"]).to(device, dtype)})


def _four(totals: torch.Tensor) -> torch.Tensor:
    """(loss_sum, clipped, skipped, tokens): checkpoints from before tokens lack the last."""
    return totals if len(totals) == 4 else torch.cat([totals, totals.new_zeros(1)])
