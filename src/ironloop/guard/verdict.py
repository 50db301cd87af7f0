"""The guard's per-step verdict, computed on the device and applied without reading it.

``StepJudge.verdict`` turns the step's running loss total and grad norm into ``ok``, a 0-dim bool
tensor on the device, in a handful of kernels and no host read:

    ok = finite(loss total + grad norm)               # non-finite loss or norm (one add, one test)
         [& not GradScaler's own overflow skip]       # fp16: finite loss, inf grads stay its skip
         [& not a spike]                              # opt-in: robust z-score, statistics here

``masked_step`` applies it: an optimizer that takes ``found_inf`` (torch's fused Adam, AdamW,
SGD, Adagrad) skips the update inside its own kernel when ``found_inf`` is 1, step count and
moments untouched, exactly as GradScaler skips an fp16 overflow. Any other optimizer cannot skip
on the device, so for it the verdict is read before ``step()`` (one marked host sync per step).

The spike test keeps its running statistics here as device tensors (a ring of the last
``spike_window`` good steps' window losses and grad norms) and computes the same
``median + factor * max(1.4826 * MAD, 1% of the median, 1e-12)`` as the pure ``GuardPolicy``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ironloop.guard.decide import GuardPolicy
from ironloop.parallel.world import all_reduce_sum


def finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(x)`` for a floating tensor, in two kernels: ``x - x`` is 0 for every
    finite value and NaN for an infinity or a NaN. ``isfinite`` is four on a CPU (``x == x``,
    ``abs``, ``!= inf`` and their product), each a fresh tensor; a small model's step felt them."""
    return (x - x) == 0


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours an on-device ``found_inf`` (torch's fused kernels).
    The param groups decide, not ``defaults``: a resumed optimizer takes its groups' ``fused``
    from the checkpoint (a run begun non-fused stays non-fused, and exact)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)
                and all(g.get("fused") for g in optimizer.param_groups))


class StepJudge:
    """The device half of the guard: judges each step and keeps the spike statistics."""

    def __init__(self, device: torch.device, dtype: torch.dtype, spike_factor: float = 0.0,
                 spike_window: int = 100, spike_warmup: int = 100):
        self.factor, self.window, self.warmup = spike_factor, spike_window, spike_warmup
        self.device, self.dtype = device, dtype
        # Spike statistics: ring[0] losses, ring[1] norms; filled = entries written so far.
        self.ring = torch.zeros(2, spike_window, dtype=dtype, device=device)
        self.filled = torch.zeros((), dtype=torch.long, device=device)
        self.good = torch.zeros((), dtype=torch.long, device=device)  # good steps seen
        # found_inf's two values, made once: torch.where(ok, 0.0, 1.0) would make both per step
        self.flags = (torch.tensor(0.0, dtype=torch.float32, device=device),
                      torch.tensor(1.0, dtype=torch.float32, device=device))

    def found_inf(self, ok: torch.Tensor) -> torch.Tensor:
        """The float32 flag a fused optimizer skips on: 1.0 where ``ok`` is false."""
        return torch.where(ok, *self.flags)

    def verdict(self, total: torch.Tensor, before: torch.Tensor, norm: torch.Tensor,
              samples: int, found: torch.Tensor | None, world) -> torch.Tensor:
        """``ok`` for one step (device bool, no host read). ``total``: the meter's running loss
        total after this window; ``before``: it before the window; ``samples``: the window's
        samples over all ranks; ``found``: GradScaler's overflow flag (fp16) or None."""
        if self.factor == 0 and found is None and not world.distributed:
            return finite(total + norm)  # the default: one add, one test
        window_sum = total - before
        if world.distributed:  # every rank must reach the same verdict: judge the sums
            window_sum = all_reduce_sum(window_sum, world)
        loss_ok = finite(window_sum)
        norm_ok = finite(norm)
        if found is not None:  # finite loss, inf grads: GradScaler's skip, not ours
            norm_ok = norm_ok | (found > 0)
        ok = loss_ok & norm_ok
        if self.factor > 0:
            ok = ok & ~self._spike(window_sum / max(samples, 1), norm, ok)
        return ok

    def _spike(self, loss: torch.Tensor, norm: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """Whether (loss, norm) spikes over the ring; records them when the step is good."""
        values = torch.stack([loss, norm.to(self.dtype)])
        n = self.window
        lo, hi = (n - 1) // 2, n // 2  # statistics.median: the mean of the middle two
        med = self.ring.sort(dim=1).values
        med = (med[:, lo] + med[:, hi]) / 2
        dev = (self.ring - med[:, None]).abs().sort(dim=1).values
        sigma = torch.maximum(1.4826 * ((dev[:, lo] + dev[:, hi]) / 2), 0.01 * med.abs())
        sigma = sigma.clamp(min=1e-12)
        spike = (self.filled >= n) & (values > med + self.factor * sigma).any()
        good = ok & ~spike
        self.good = self.good + good
        take = good & (self.good > self.warmup)  # warm-up steps stay out of the statistic
        slot = self.filled % n
        current = self.ring.index_select(1, slot.reshape(1)).squeeze(1)
        self.ring.index_copy_(1, slot.reshape(1), torch.where(take, values, current)[:, None])
        self.filled = self.filled + take
        return spike

    # ---------------------------------------------------------------- state (host reads) ----
    def state_dict(self) -> dict:
        """The spike statistics as the pure GuardPolicy keeps them: ``good`` and the window, oldest
        first (a host read: called at checkpoints and rollbacks only)."""
        filled, good = (int(v) for v in torch.stack([self.filled, self.good]).tolist())  # sync
        n = min(filled, self.window)
        order = torch.roll(self.ring, -(filled % self.window), dims=1) if filled >= self.window \
            else self.ring
        losses, norms = order[:, -n:].tolist() if filled >= self.window \
            else order[:, :n].tolist()  # host sync, not per step
        return {"good": good, "losses": losses, "norms": norms}

    def load_state_dict(self, state: dict) -> None:
        # The newest spike_window entries, oldest first, as the pure GuardPolicy keeps them.
        losses = state.get("losses", [])[-self.window:]
        norms = state.get("norms", [])[-self.window:]
        n = len(losses)
        self.ring.zero_()
        if n:
            self.ring[:, :n] = torch.tensor([losses, norms], dtype=self.dtype)
        self.filled = torch.tensor(n, dtype=torch.long, device=self.device)
        self.good = torch.tensor(state.get("good", 0), dtype=torch.long, device=self.device)


def masked_step(optimizer: torch.optim.Optimizer, scaler, ok: torch.Tensor,
                bad: torch.Tensor) -> None:
    """``optimizer.step()`` (and ``scaler.update()``) that changes nothing when ``ok`` is false,
    decided in the optimizer's kernel: no host read. Needs ``takes_found_inf(optimizer)``.

    fp16: GradScaler's own overflow flag and the guard's verdict are merged into the one
    ``found_inf`` the fused kernel reads; the loss scale is then updated from GradScaler's flag
    alone, and left as it was on a guard-bad step (a NaN loss says nothing about fp16 range),
    which is what skipping ``scaler.update()`` did before. ``bad`` is ``StepJudge.found_inf(ok)``.
    """
    # found_inf and grad_scale: the attributes torch's fused kernels read, as GradScaler sets
    opt: Any = optimizer
    if scaler is None:
        opt.found_inf = bad
        try:
            opt.step()
        finally:
            del opt.found_inf
        return
    found = scaler._found_inf_per_device(optimizer)  # private, stable since torch 1.x
    overflow = torch.stack([f.to(bad.device) for f in found.values()]).sum().clamp(max=1)
    opt.grad_scale = None  # unscale_ already ran: the grads are true gradients
    opt.found_inf = torch.maximum(bad, overflow)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf
    # GradScaler's private scale and growth tracker: keep them on a guard-bad step.
    scale, tracker = scaler._scale.clone(), scaler._growth_tracker.clone()
    scaler.update()
    scaler._scale.copy_(torch.where(ok, scaler._scale, scale))
    scaler._growth_tracker.copy_(torch.where(ok, scaler._growth_tracker, tracker))


def device_verdicts(cfg, device: torch.device, dtype: torch.dtype) -> DeviceVerdicts:
    """The guard's decision (``GuardPolicy``) and its device half, for ``guard.*`` config
    ``cfg``."""
    policy = GuardPolicy(cfg.max_bad_steps, cfg.max_rollbacks, cfg.lr_backoff, cfg.spike_factor,
                   cfg.spike_window, cfg.spike_warmup)
    return DeviceVerdicts(cfg, policy, device, dtype)


class Pending(NamedTuple):
    """One step's verdict and what its settle needs, all on the device, never read before."""

    ok: torch.Tensor      # the verdict (bool)
    total: torch.Tensor   # the meter's running loss total after the window, before any revert
    before: torch.Tensor  # the total before the window
    norm: torch.Tensor    # the pre-clip grad norm


class DeviceVerdicts:
    """The guard's device half, wired into the step part (``engine/train_module.py``): judges each
    step (``check``) and says how the one stepping branch applies the verdict, keeping what the
    steps since the last settle left on the device (``pending``) for ``GuardReporter.settle``.

    ``masks``: the optimizer skips a bad step itself (``found_inf``), so nothing is read;
    otherwise ``allows`` reads the verdict before ``step()``, one host sync per step."""

    def __init__(self, cfg, policy: GuardPolicy, device: torch.device, dtype: torch.dtype):
        self.policy = policy    # the pure GuardPolicy (decide.py): its LR factor, its streak
        self.judge = StepJudge(device, dtype, cfg.spike_factor, cfg.spike_window,
                               cfg.spike_warmup)
        self.masks = False      # set by start(): the optimizer takes found_inf
        self.always = False     # settle every step (a fault knob or an on_step_end callback)
        self.known_bad = False  # a verdict already read on the host says the last step was bad
        # Since the last settle, per step: its Pending verdict; and the host's offsets and local
        # sample counts after each step (index 0: at the last settle).
        self.pending: list[Pending] = []
        self.offsets: list[int] = [0]
        self.samples: list[int] = [0]
        # The meter's totals before the current window (rebase sets them from the meter).
        self._before = self._before_tokens = torch.zeros((), dtype=dtype, device=device)

    def start(self, optimizer: torch.optim.Optimizer, always: bool) -> None:
        """After any restore: a resumed optimizer takes ``fused`` from its checkpoint."""
        self.masks, self.always = takes_found_inf(optimizer), always

    def rebase(self, meter, offset: int) -> None:
        """The meter's totals and the epoch offset become the baseline of the next window (at
        the start, at every settle and after a rollback); nothing is pending."""
        self._before, self._before_tokens = meter.loss_sum, meter.tokens
        self.pending = []
        self.offsets, self.samples = [offset], [meter.samples]
        self.known_bad = False

    def check(self, meter, grad_norm: torch.Tensor, offset: int, skipped: torch.Tensor | None,
              world) -> torch.Tensor:
        """The step's verdict ``ok``, a device bool, before clipping: NO host read.

        A bad window's loss leaves the meter's running total on the device (a ``where``), so
        the logged means never see it; what else a bad step undoes waits for the settle.
        """
        total, before = meter.loss_sum, self._before
        ok = self.judge.verdict(total, before, grad_norm, offset - self.offsets[-1], skipped,
                                world)
        meter.loss_sum = self._before = torch.where(ok, total, before)
        if meter.tokens is not self._before_tokens:  # the window's step reported tokens
            meter.tokens = self._before_tokens = torch.where(ok, meter.tokens,
                                                             self._before_tokens)
        self.pending.append(Pending(ok, total, before, grad_norm))
        self.offsets.append(offset)
        self.samples.append(meter.samples)
        return ok

    def allows(self, ok: torch.Tensor) -> bool:
        """For an optimizer without ``found_inf``: read the verdict before ``step()`` (host sync
        per step, as ``GradScaler.step`` does for such an optimizer; the settle follows)."""
        if bool(ok):  # host sync per step: this optimizer takes no found_inf (see above)
            return True
        self.known_bad = True
        return False

    @property
    def eager(self) -> bool:
        """Whether the loop must settle after this step whatever its number."""
        return self.always or self.known_bad or len(self.pending) >= MAX_PENDING


#: Steps between settles at most (log.every_steps is usually far fewer).
MAX_PENDING = 4096


def forget_unscale(optimizer: torch.optim.Optimizer, scaler) -> None:
    """A bad step read on the host: unscale_ ran without step/update. Forget it so the next
    window may unscale, and leave the loss scale alone (a NaN loss says nothing about fp16
    range)."""
    if scaler is not None:
        scaler._per_optimizer_states.pop(id(optimizer), None)  # private, like found_inf
