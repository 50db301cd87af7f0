"""The guard: a NaN or a loss spike costs a few steps, not the run.

``Guard`` decides (pure, host floats in, verdicts out, with a state_dict); ``GuardHook`` wires it
into the loop at one place, ``loop.optimizer_step``, between measuring the pre-clip grad norm and
clipping::

    bad = non-finite window loss | non-finite grad norm | (opt-in) a spike over recent good steps
    bad  -> skip: no clip, no optimizer.step (params, Adam moments and step count untouched), no
            scheduler step, not counted as an optimizer step; one guard.jsonl line and a warning
    max_bad_steps bad in a row -> roll back: restore the newest checkpoint (or the in-memory
            snapshot), LR x lr_backoff for the rest of the run, the bad windows' samples join a
            skip list the sampler honours, carry on (raise RolledBack; loop.train restarts there)
    a trigger after max_rollbacks rollbacks -> stop with GuardStop (exit code 3)

fp16 overflow skips decided by GradScaler (finite loss, inf grads) stay GradScaler's: counted as
``skipped``, never guard events.

Cost: ONE host read per optimizer step (``values.tolist()`` in ``GuardHook.check``): a few floats.
On CPU that is a memory read (~µs). On CUDA it is a device sync that waits for the step's
backward; with fp16 it costs nothing extra, because ``GradScaler.step`` syncs at the same point
anyway. Under DDP it adds one small all-reduce per step. ``guard.enabled=false`` removes it.
Everything else (parameter names, input checks, window indices) runs on the bad path only.
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

from ironloop.data.loader import TensorData
from ironloop.dist.world import all_reduce_sum, barrier
from ironloop.errors import UserError
from ironloop.guard.decide import Guard
from ironloop.outputs.runlog import truncate_jsonl
from ironloop.state.manager import latest_valid
from ironloop.state.resume import collect_state, restore_state
from ironloop.state.snapshot import snapshot

EXIT_CODE = 3  # the CLI's exit code when the guard stops a run (2 is a user error)


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
    """The wiring: reads the step's values from the device, keeps bad values out of the logged
    means, writes guard.jsonl (rank 0), rolls back, stops. ``run.guard`` in the loop."""

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
        self._prev = (0.0, 0, 0.0, 0.0)  # local loss total, local samples, global loss, samples
        self._zero: torch.Tensor | None = None

    # ---------------------------------------------------------------- set-up, state ---------
    def start(self, run, resumed: bool, resume_requested: bool, wait=None) -> None:
        """After any restore: baseline the totals, open guard.jsonl, take the snapshot."""
        self.wait = wait or self.wait
        self.rebase(run)
        if run.world.is_main:
            path = self.run_dir / "guard.jsonl"
            if resume_requested:  # like metrics.jsonl: drop lines past the checkpoint
                truncate_jsonl(path, "n", self.guard.logged)
            self.file = open(path, "a")
        if (not self.from_files or not resumed) and not _sharded(run):
            self.snapshot = snapshot(collect_state(run))

    def saved(self, run) -> None:
        """After every run.save: the in-memory rollback point moves with the checkpoints."""
        if not self.from_files:
            self.snapshot = snapshot(collect_state(run))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def state_dict(self) -> dict:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.guard.load_state_dict(state or {})

    def rebase(self, run) -> None:
        """Read the meter's totals as the baseline of the next window (a host sync; at start
        and after a rollback only)."""
        m = run.meter
        totals = torch.stack([m.loss_sum, m.loss_sum.new_tensor(float(m.samples))])
        local = totals.tolist()  # host sync, not per step
        shared = all_reduce_sum(totals.clone(), run.world).tolist() if run.world.distributed \
            else local
        self._prev = (local[0], m.samples, shared[0], shared[1])
        self._zero = torch.zeros((), dtype=m.loss_sum.dtype, device=m.loss_sum.device)

    # ---------------------------------------------------------------- the per-step check ----
    def check(self, run, grad_norm: torch.Tensor, skipped: torch.Tensor | None) -> bool:
        """True when this step is bad and must be skipped (called before clipping)."""
        m = run.meter
        dt = m.loss_sum.dtype
        vec = torch.stack([m.loss_sum, grad_norm.detach().to(dt),
                           self._zero if skipped is None else skipped.to(dt)])
        if run.world.distributed:
            # Every rank must reach the same verdict: decide on the sums over ranks.
            shared = all_reduce_sum(torch.cat([vec, vec.new_tensor([float(m.samples)])]),
                                    run.world)
            g_loss, norm_sum, found, g_samples, local_loss = \
                torch.cat([shared, vec[:1]]).tolist()  # THE per-step host sync (see above)
            norm = norm_sum / run.world.size
        else:
            local_loss, norm, found = vec.tolist()  # THE per-step host sync (see above)
            g_loss, g_samples = local_loss, m.samples
        p_local, p_samples, p_loss, p_count = self._prev
        loss = (g_loss - p_loss) / max(g_samples - p_count, 1)  # the window's mean loss
        if found > 0 and math.isfinite(loss):
            self._prev = (local_loss, m.samples, g_loss, g_samples)
            return False  # GradScaler's fp16 overflow skip: counted as skipped, not ours
        step = run.progress.step + 1
        reason = self.guard.observe(step, loss, norm, lambda: self.window(run))
        if reason is None:
            self._prev = (local_loss, m.samples, g_loss, g_samples)
            return False
        # Keep the bad window out of the meter's running sums (they are the logged means).
        m.loss_sum.fill_(p_local)
        m.samples = p_samples
        if run.scaler is not None:
            # unscale_ ran without step/update; forget it so the next window may unscale, and
            # leave the loss scale alone (a NaN loss says nothing about fp16 range). Private
            # (a defaultdict keyed by optimizer), like loop.py's use of _found_inf_per_device.
            run.scaler._per_optimizer_states.pop(id(run.optimizer), None)
        self._report_bad(run, step, reason, loss, norm)
        if self.guard.must_stop:
            self._stop(run, step)
        if self.guard.must_roll_back:
            if _sharded(run):  # a rollback restores file checkpoints; DCP is not wired here yet
                self._stop(run, step, "a rollback under dist.strategy=fsdp is not supported yet: "
                                      "resume from the newest .dcp checkpoint with --resume and "
                                      "a lower optim.lr")
            self._roll_back(run, step)
        return True

    def window(self, run) -> list[int]:
        """The global sample indices of the window that just ran (bad path only). Windows
        start at multiples of the window size within an epoch, resumed or not."""
        s, end = run.sampler, run.progress.offset
        size = s.global_batch * run.cfg.train.accumulation_steps
        return s.indices((end - 1) // size * size, end)

    # ---------------------------------------------------------------- the bad path ----------
    def _report_bad(self, run, step: int, reason: str, loss: float, norm: float) -> None:
        samples = self.guard.pending[-1]
        row = {"event": "bad_step", "step": step, "epoch": run.progress.epoch + 1,
               "reason": reason, "loss": _num(loss), "grad_norm": _num(norm),
               "consecutive": self.guard.consecutive}
        if run.world.is_main:
            grads = [n for n, p in run.raw_model.named_parameters()
                     if p.grad is not None and not bool(torch.isfinite(p.grad).all())]  # sync
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
        keep = self.guard.state_dict()  # the guard's knowledge outlives the rollback
        restore_state(run, state, source)
        self.guard.load_state_dict(keep)
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
