"""The guard: a NaN or a loss spike costs a few steps, not the run, and no host sync per step.

``Guard`` (decide.py) decides on host floats; ``Verdict`` (verdict.py) judges each step on the
device; ``GuardHook`` wires both into the loop at one place, ``loop.optimizer_step``, between
measuring the pre-clip grad norm and clipping::

    bad = non-finite window loss | non-finite grad norm | (opt-in) a spike over recent good steps
    bad  -> skip: no optimizer update (params, Adam moments and step count untouched), the
            window's loss kept out of the logged means, not counted as an optimizer step, no
            scheduler step; one guard.jsonl line and a warning
    max_bad_steps bad in a row -> roll back: restore the newest checkpoint (or the in-memory
            snapshot), LR x lr_backoff for the rest of the run, the bad windows' samples join a
            skip list the sampler honours, carry on (raise RolledBack; loop.train restarts there)
    a trigger after max_rollbacks rollbacks -> stop with GuardStop (exit code 3)

fp16 overflow skips decided by GradScaler (finite loss, inf grads) stay GradScaler's: counted as
``skipped``, never guard events.

**Sync-free design.** A plain step (no log line, evaluation, checkpoint or epoch end) reads
nothing from the device:

1. ``check`` computes the verdict ``ok`` on the device (``isfinite(loss total + grad norm)``;
   under DDP on the sums over ranks, one small all-reduce; the spike test on device-resident
   statistics) and reverts the meter's running loss total with a ``where`` when it is false.
2. ``step`` applies it without reading it: torch's fused optimizers (Adam, AdamW, SGD, Adagrad
   with ``fused=True``, ironloop's default where torch has the kernel) take an on-device
   ``found_inf`` and skip the whole update inside the kernel, as they do for GradScaler; under
   fp16 the guard's flag is merged into GradScaler's and the loss scale is left alone on a
   guard-bad step. An optimizer without ``found_inf`` cannot skip on the device: for it the
   verdict is read before ``step()``, one host sync per step (the old cost).
3. The host counts the step as good. At the next settle point (``engine/settle.py``: log
   steps, checkpoints, evaluations, the epoch end, the run's end) ``settle`` reads the pending
   verdicts at once (a lagged read), writes the bad steps' guard.jsonl lines with their exact
   step numbers, takes them out of the meter's counts, and rolls back or stops when due; the
   engine then takes the bad steps back from ``progress.step`` and replays the scheduler.

The largest lag is ``log.every_steps`` steps. For ``max_bad_steps`` it means: the rollback is
decided on the same consecutive bad steps as before, but happens at the settle, up to
``log.every_steps - 1`` steps after the bad step that triggered it; those steps are redone from
the restored checkpoint. Between a bad step and its settle, the LR runs one schedule position
ahead per bad step (see engine/settle.py). A callback with its own ``on_step_end`` or the
``fault.nan_at_step`` knob makes every step a settle point (exact numbers per step, one read
per step).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ironloop.callbacks import Callback
from ironloop.data.loader import TensorData
from ironloop.dist.world import all_reduce_sum, barrier
from ironloop.errors import UserError
from ironloop.guard.decide import Guard
from ironloop.guard.faults import PoisonLoss
from ironloop.guard.verdict import Verdict, masked_step, takes_found_inf
from ironloop.outputs.runlog import truncate_jsonl
from ironloop.state.manager import latest_valid
from ironloop.state.resume import collect_state, restore_state
from ironloop.state.snapshot import snapshot

EXIT_CODE = 3  # the CLI's exit code when the guard stops a run (2 is a user error)
MAX_PENDING = 4096  # steps between settles at most (log.every_steps is usually far fewer)


class GuardStop(UserError):
    """Too many rollbacks: the run cannot make progress without a change by the user."""

    exit_code = EXIT_CODE


class RolledBack(Exception):
    """Raised after a rollback restored an earlier state; ``loop.train`` continues from it."""


@contextlib.contextmanager
def lr_scaled(optimizer: torch.optim.Optimizer, hook: "GuardHook | None"):
    """Apply the guard's LR factor for the duration of ``optimizer.step`` only.

    The param groups hold the schedule's own LR before and after, so torch schedulers (several
    compute the next LR from the current one) never see the factor, it composes with any
    schedule as schedule(t) * factor, and the checkpoint keeps the two apart.
    """
    factor = 1.0 if hook is None else hook.guard.lr_factor
    if factor == 1.0:
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


class GuardHook:
    """The wiring: judges each step on the device (``check``), applies the verdict there
    (``step``), and at settle points reads it (``settle``): writes guard.jsonl (rank 0), keeps
    bad steps out of the meter, rolls back, stops. ``run.guard`` in the loop."""

    def __init__(self, cfg, run_dir: Path, checkpoints: bool):
        self.cfg = cfg
        self.guard = Guard(cfg.max_bad_steps, cfg.max_rollbacks, cfg.lr_backoff,
                           cfg.spike_factor, cfg.spike_window, cfg.spike_warmup)
        self.run_dir = Path(run_dir)
        # Roll back to the newest checkpoint file; without checkpoints, to the snapshot.
        self.from_files = checkpoints and cfg.rollback_to == "checkpoint"
        self.snapshot: dict | None = None
        self.wait: Callable[[], None] = lambda: None  # finishes an async checkpoint write
        self.file = None
        self.verdict: Verdict | None = None  # built in start(), on the run's device
        self.masks = False      # the optimizer skips a bad step itself (found_inf): no read
        self.always = False     # settle every step (a fault knob or an on_step_end callback)
        self.known_bad = False  # a verdict already read on the host says the last step was bad
        # Since the last settle, per step: (ok, meter loss total before revert, total before the
        # window, grad norm), device tensors never read until settle; and the host's offsets
        # and local sample counts after each step (index 0: at the last settle).
        self.pending: list[tuple] = []
        self.offsets: list[int] = [0]
        self.samples: list[int] = [0]
        self._before: torch.Tensor | None = None

    # ---------------------------------------------------------------- set-up, state ---------
    def start(self, run, resumed: bool, resume_requested: bool, wait=None) -> None:
        """After any restore: baseline the totals, open guard.jsonl, take the snapshot."""
        self.wait = wait or self.wait
        self.masks = takes_found_inf(run.optimizer)
        self.always = isinstance(run.step_fn, PoisonLoss) or any(
            getattr(type(cb), "on_step_end", Callback.on_step_end) is not Callback.on_step_end
            for cb in run.callbacks)
        self.prepare(run)
        self.rebase(run)
        if run.world.is_main:
            path = self.run_dir / "guard.jsonl"
            if resume_requested:  # like metrics.jsonl: drop lines past the checkpoint
                truncate_jsonl(path, "n", self.guard.logged)
            self.file = open(path, "a")
        if (not self.from_files or not resumed) and not _sharded(run):
            self.snapshot = snapshot(collect_state(run))

    def prepare(self, run) -> None:
        """Build the device half (the verdict and its spike statistics) on the run's device."""
        if self.verdict is None:
            c, m = self.cfg, run.meter
            self.verdict = Verdict(m.loss_sum.device, m.loss_sum.dtype, c.spike_factor,
                                   c.spike_window, c.spike_warmup)
            if self._spike_state is not None:
                self.verdict.load_state_dict(self._spike_state)

    def saved(self, run) -> None:
        """After every run.save: the in-memory rollback point moves with the checkpoints."""
        if not self.from_files:
            self.snapshot = snapshot(collect_state(run))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def state_dict(self) -> dict:
        """The pure Guard's state, with the spike statistics read from the device (a host read:
        checkpoints and rollbacks are settle points)."""
        state = self.guard.state_dict()
        if self.verdict is not None and self.cfg.spike_factor > 0:
            state.update(self.verdict.state_dict())
        return state

    def load_state_dict(self, state: dict | None) -> None:
        self.guard.load_state_dict(state or {})
        self._spike_state = dict(state or {})
        if self.verdict is not None:
            self.verdict.load_state_dict(self._spike_state)

    _spike_state: dict | None = None  # kept until start() builds the verdict on the device

    def rebase(self, run) -> None:
        """The meter's totals and the sampler's position become the baseline of the next
        window (at start and after a rollback); nothing is pending."""
        self._before = run.meter.loss_sum
        self._before_tokens = run.meter.tokens
        self.pending = []
        self.offsets, self.samples = [run.progress.offset], [run.meter.samples]
        self.known_bad = False

    # ---------------------------------------------------------------- the per-step check ----
    def check(self, run, grad_norm: torch.Tensor, skipped: torch.Tensor | None) -> torch.Tensor:
        """The step's verdict ``ok``, a device bool, before clipping: NO host read.

        A bad window's loss leaves the meter's running total on the device (a ``where``), so
        the logged means never see it; what else a bad step undoes waits for ``settle``.
        """
        m, norm = run.meter, grad_norm  # a norm of gradients: no autograd graph to detach
        total, before = m.loss_sum, self._before
        ok = self.verdict.judge(total, before, norm, run.progress.offset - self.offsets[-1],
                                skipped, run.world)
        m.loss_sum = self._before = torch.where(ok, total, before)
        if m.tokens is not self._before_tokens:  # the window's step reported tokens
            m.tokens = self._before_tokens = torch.where(ok, m.tokens, self._before_tokens)
        self.pending.append((ok, total, before, norm))
        self.offsets.append(run.progress.offset)
        self.samples.append(m.samples)
        return ok

    def step(self, run, ok: torch.Tensor) -> None:
        """``optimizer.step()`` (and the scaler's update) that changes nothing when ``ok`` is
        false. A fused optimizer skips inside its kernel (``found_inf``): no host read. Any
        other optimizer cannot, so its verdict is read here: one host sync per step, as
        ``GradScaler.step`` does for such an optimizer (``settle`` then follows at once)."""
        opt, scaler = run.optimizer, run.scaler
        if self.masks:
            masked_step(opt, scaler, ok, self.verdict.found_inf(ok))
        elif bool(ok):  # host sync per step: this optimizer takes no found_inf (see above)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        else:
            self.known_bad = True
            if scaler is not None:
                # unscale_ ran without step/update; forget it so the next window may unscale,
                # and leave the loss scale alone (a NaN loss says nothing about fp16 range).
                scaler._per_optimizer_states.pop(id(opt), None)  # private, like found_inf

    @property
    def eager(self) -> bool:
        """Whether the loop must settle after this step whatever its number."""
        return self.always or self.known_bad or len(self.pending) >= MAX_PENDING

    # ---------------------------------------------------------------- settling --------------
    def settle(self, run) -> tuple[int, list[int]]:
        """Read the verdicts of the steps since the last settle: ONE host read, at log steps
        and the other settle points (``engine/settle.py``), never on a plain step. Bad steps
        get their guard.jsonl lines with exact step numbers and leave the meter's counts; a
        rollback or a stop happens here when due. Returns (steps since the last settle, indices
        of the bad ones); the engine corrects the step count and the schedule."""
        attempts = len(self.pending)
        if not attempts:
            return 0, []
        oks = torch.stack([p[0] for p in self.pending]).tolist()  # host sync: settle points only
        bad = [j for j, ok in enumerate(oks) if not ok]
        if bad:
            self._settle_bad(run, bad)
        else:
            for _ in range(attempts):
                self.guard.record_good()  # ends any run of bad steps from an earlier settle
        self.pending = []
        self.offsets, self.samples = [run.progress.offset], [run.meter.samples]
        self.known_bad = False
        return attempts, bad

    def _settle_bad(self, run, bad: list[int]) -> None:
        """Record, report and act on the bad steps among the pending ones, in order."""
        m, attempts = run.meter, len(self.pending)
        rows = torch.stack([torch.stack([self.pending[j][1] - self.pending[j][2],
                                         self.pending[j][3].to(m.loss_sum.dtype)]) for j in bad])
        if run.world.distributed:  # the windows' losses over all ranks, as the verdict saw them
            rows[:, 0] = all_reduce_sum(rows[:, 0].contiguous(), run.world)
        values = dict(zip(bad, rows.tolist()))  # host sync, bad path only
        m.forget(sum(self.samples[j + 1] - self.samples[j] for j in bad), len(bad))
        step = run.progress.step - attempts  # the exact count at the last settle
        for j in range(attempts):
            if j not in values:
                step += 1
                self.guard.record_good()
                continue
            (loss_sum, norm), size = values[j], self.offsets[j + 1] - self.offsets[j]
            loss = loss_sum / max(size, 1)  # the window's mean loss over all ranks
            reason = self.guard.classify(loss, norm) or "spike"  # finite and bad: a spike
            self.guard.record_bad(step + 1, reason, self.window(run, self.offsets[j + 1]))
            self._report_bad(run, step + 1, reason, loss, norm, latest=j == attempts - 1)
            if self.guard.must_stop:
                self._stop(run, step + 1)
            if self.guard.must_roll_back:
                if _sharded(run):  # a rollback restores file checkpoints; DCP is not wired yet
                    self._stop(run, step + 1, "a rollback under dist.strategy=fsdp is not "
                                              "supported yet: resume from the newest .dcp "
                                              "checkpoint with --resume and a lower optim.lr")
                self._roll_back(run, step + 1)

    def window(self, run, end: int) -> list[int]:
        """The global sample indices of the window that ended at epoch offset ``end`` (bad path
        only). Windows start at multiples of the window size within an epoch, resumed or not."""
        s = run.sampler
        size = s.global_batch * run.cfg.train.accumulation_steps
        return s.indices((end - 1) // size * size, end)

    # ---------------------------------------------------------------- the bad path ----------
    def _report_bad(self, run, step: int, reason: str, loss: float, norm: float,
                    latest: bool) -> None:
        samples = self.guard.pending[-1]
        row = {"event": "bad_step", "step": step, "epoch": run.progress.epoch + 1,
               "reason": reason, "loss": _num(loss), "grad_norm": _num(norm),
               "consecutive": self.guard.consecutive}
        if run.world.is_main:
            # The gradients are still those of the bad step only when it is the latest one
            # (a verdict settled late); otherwise null.
            grads = [n for n, p in run.raw_model.named_parameters()
                     if p.grad is not None and not bool(torch.isfinite(p.grad).all())] \
                if latest else None  # host sync, bad path only
            bad_inputs = nonfinite_inputs(run.train_data, samples)
            row.update(samples=samples, nonfinite_grads=grads,
                       inputs_nonfinite=bool(bad_inputs), nonfinite_input_samples=bad_inputs)
        self._write(run, row)
        self._say(run, f"step {step} skipped ({reason}: loss {_num(loss)}, grad_norm "
                       f"{_num(norm)}); {self.guard.consecutive} bad in a row, "
                       f"{len(samples)} samples listed in guard.jsonl")

    def _roll_back(self, run, step: int) -> None:
        if run.world.is_main:
            self.wait()  # the newest checkpoint may still be being written
        barrier(run.world)
        state, source = self._target(run)
        keep = self.state_dict()  # the guard's knowledge outlives the rollback
        restore_state(run, state, source)
        self.load_state_dict(keep)
        added = self.guard.roll_back()
        run.sampler.set_skip(self.guard.skip)
        self.rebase(run)
        if run.log is not None:  # one timeline in the logs, as after a resume
            run.log.rewind(run.progress.step, run.progress.epoch)
        self._write(run, {"event": "rollback", "step": step, "from_step": step,
                          "to_step": run.progress.step, "epoch": run.progress.epoch + 1,
                          "source": source, "lr_factor": self.guard.lr_factor,
                          "samples_added": added, "skipped_samples": len(self.guard.skip)})
        self._say(run, f"rolled back from step {step} to step {run.progress.step} ({source}); "
                       f"LR factor now {self.guard.lr_factor:g}, {len(added)} samples added to "
                       f"the skip list ({len(self.guard.skip)} in all)")
        raise RolledBack()

    def _target(self, run) -> tuple[dict, str]:
        """The state to roll back to: the newest valid checkpoint, else the snapshot."""
        if self.from_files:
            warn = (lambda msg: print(f"warning: {msg}")) if run.world.is_main else (lambda m: 0)
            found = latest_valid(self.run_dir / "checkpoints", warn)
            if found is not None:
                return found[1], str(Path(found[0]).relative_to(self.run_dir))
        # A fresh copy: optimizer.load_state_dict may keep the very tensors it is given.
        return snapshot(self.snapshot), "memory snapshot"

    def _stop(self, run, step: int, why: str = "") -> None:
        g = self.guard
        recent = ", ".join(f"step {s} ({r})" for s, r in g.events[-8:])
        why = why or (f"{g.max_bad_steps} bad step(s) in a row again after {g.rollbacks} "
                      f"rollback(s) (guard.max_rollbacks={g.max_rollbacks})")
        msg = (f"the guard stopped the run at step {step}: {why}"
               f"; recent bad steps: {recent}. Try a lower optim.lr, clip.max_norm=1.0, "
               f"train.precision=bf16 instead of fp16, and inspect the samples listed in "
               f"{self.run_dir / 'guard.jsonl'}; every checkpoint in "
               f"{self.run_dir / 'checkpoints'} is intact")
        self._write(run, {"event": "stop", "step": step, "rollbacks": g.rollbacks,
                          "bad_steps": g.bad_steps, "message": msg})
        if run.world.is_main:
            self.wait()
        raise GuardStop(msg)

    def _write(self, run, row: dict) -> None:
        self.guard.logged += 1  # on every rank: the count is part of the checkpoint
        if self.file is not None:
            self.file.write(json.dumps({"n": self.guard.logged, **row, "time": time.time()})
                            + "\n")
            self.file.flush()

    def _say(self, run, text: str) -> None:
        if run.world.is_main:
            tqdm.write(f"warning: guard: {text}")


def _sharded(run) -> bool:
    """Whether the model is sharded by FSDP2 (its parameters are DTensors)."""
    from ironloop.dist.parallel import is_sharded

    return any(is_sharded(p) for p in run.raw_model.parameters())


def _num(x: float):
    """A finite float as is; nan/inf as strings, so guard.jsonl stays strict JSON."""
    return x if math.isfinite(x) else str(x)


def nonfinite_inputs(dataset, indices: list[int]) -> list[int]:
    """The indices among ``indices`` whose inputs hold a NaN or inf (bad path only: reads the
    samples again from the dataset)."""
    if isinstance(dataset, TensorData):
        x = dataset.x[torch.as_tensor(indices, dtype=torch.long)]
        if not x.is_floating_point():
            return []
        bad = ~torch.isfinite(x.reshape(len(x), -1)).all(1)
        return [indices[i] for i in bad.nonzero().flatten().tolist()]
    return [i for i in indices if _has_nonfinite(_inputs_of(dataset[i]))]


def _inputs_of(sample):
    if isinstance(sample, (tuple, list)) and len(sample) > 1:
        return sample[0]  # (inputs, targets)
    return sample


def _has_nonfinite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return any(_has_nonfinite(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_has_nonfinite(v) for v in obj)
    return False
