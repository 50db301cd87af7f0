"""The guard: a NaN or a loss spike costs a few steps, not the run, and no host sync per step.

Three parts, by job: ``GuardPolicy`` (decide.py) decides on host floats; ``DeviceVerdicts``
(verdict.py) judges each step on the device and is wired into the step part's one stepping
branch (``engine/train_module.py``), between measuring the pre-clip grad norm and clipping;
``GuardReporter`` (here) reads the verdicts at settle points and reports, rolls back or stops::

    bad = non-finite window loss | non-finite grad norm | (opt-in) a spike over recent good steps
    bad  -> skip: no optimizer update (params, Adam moments and step count untouched), the
            window's loss kept out of the logged means, not counted as an optimizer step, no
            scheduler step; one guard.jsonl line and a warning
    bad, and the window holds samples whose inputs are NaN or inf -> roll back at once, leaving
            out only those samples (the LR stays; not one of max_rollbacks)
    max_bad_steps bad in a row -> roll back: restore the newest checkpoint through the
            checkpointer, files or FSDP2's shards alike (or the in-memory snapshot), LR x
            lr_backoff for the rest of the run, the bad windows' samples join a skip list the
            sampler honours, carry on (raise RolledBack; loop.train restarts there)
    a trigger after max_rollbacks rollbacks -> stop with GuardStop (exit code 3)

fp16 overflow skips decided by GradScaler (finite loss, inf grads) stay GradScaler's: counted as
``skipped``, never guard events.

**Sync-free design.** A plain step (no log line, evaluation, checkpoint or epoch end) reads
nothing from the device:

1. ``DeviceVerdicts.check`` computes the verdict ``ok`` on the device (``isfinite(loss total +
   grad norm)``; under DDP on the sums over ranks, one small all-reduce; the spike test on
   device-resident statistics) and reverts the meter's running loss total with a ``where``
   when it is false.
2. The step part applies it without reading it: torch's fused optimizers (Adam, AdamW, SGD,
   Adagrad with ``fused=True``, ironloop's default where torch has the kernel) take an on-device
   ``found_inf`` and skip the whole update inside the kernel, as they do for GradScaler; under
   fp16 the guard's flag is merged into GradScaler's and the loss scale is left alone on a
   guard-bad step. An optimizer without ``found_inf`` cannot skip on the device: for it the
   verdict is read before ``step()``, one host sync per step (the old cost).
3. The host counts the step as good. At the next settle point ``GuardReporter.settle`` reads
   the pending verdicts at once (a lagged read), writes the bad steps' guard.jsonl lines with
   their exact step numbers, takes them out of the meter's counts, and rolls back or stops
   when due. When settles happen, what the lag changes, and how the engine takes the bad steps
   back from the step count and the schedule: ``engine/settle.py``, the one description.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TextIO

import torch
from torch import nn
from tqdm import tqdm

from ironloop.data.source import BatchSource
from ironloop.errors import UserError
from ironloop.guard.decide import GuardPolicy
from ironloop.guard.verdict import DeviceVerdicts
from ironloop.outputs.runlog import RunLog, truncate_jsonl
from ironloop.parallel.data_parallel import NO_CONTEXT
from ironloop.parallel.world import World, all_reduce_sum, barrier
from ironloop.state.checkpointer import Checkpointer
from ironloop.state.resume import Stateful
from ironloop.state.run_dir import RunDir
from ironloop.state.snapshot import copies_done, snapshot

EXIT_CODE = 3  # the CLI's exit code when the guard stops a run (2 is a user error)


class GuardStop(UserError):
    """Too many rollbacks: the run cannot make progress without a change by the user."""

    exit_code = EXIT_CODE


class RolledBack(Exception):
    """Raised after a rollback restored an earlier state; ``loop.train`` continues from it."""


class BadStep(NamedTuple):
    """A bad step as guard.jsonl and the warning report it."""

    step: int      # its number: the step it would have been
    epoch: int     # 1-based
    reason: str    # nonfinite_loss, nonfinite_grad_norm or spike (decide.py)
    loss: float    # the window's mean loss over all ranks
    norm: float    # the pre-clip grad norm


def lr_scaled(optimizer: torch.optim.Optimizer, factor: float) -> contextlib.AbstractContextManager:
    """Apply the guard's LR factor for the duration of ``optimizer.step`` only.

    The param groups hold the schedule's own LR before and after, so torch schedulers (several
    compute the next LR from the current one) never see the factor, it composes with any
    schedule as schedule(t) * factor, and the checkpoint keeps the two apart. A factor of 1
    (no rollback yet) is a plain null context: no generator to run at every step.
    """
    return NO_CONTEXT if factor == 1.0 else _scaled(optimizer, factor)


@contextlib.contextmanager
def _scaled(optimizer: torch.optim.Optimizer, factor: float):
    saved = [g["lr"] for g in optimizer.param_groups]
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


class GuardReporter:
    """The reporting side: at settle points reads the device verdicts (``settle``), writes
    guard.jsonl (rank 0), keeps bad steps out of the meter, rolls back, stops. It holds only its
    own parts; the run's parts come with each call that needs them, and ``owner`` (the run:
    ``state_dict``/``load_state_dict``) is what a snapshot takes and a rollback puts back."""

    def __init__(self, cfg, run_dir: Path, verdicts: DeviceVerdicts, from_files: bool,
                 accumulation: int, advice: str):
        self.cfg, self.verdicts, self.run_dir = cfg, verdicts, Path(run_dir)
        # what a stop suggests for bad steps nothing else explains (``advice``)
        self.advice = advice or "Try a lower optim.lr"
        # whether fault.nan_at_step's listed step fired (the run's Faults.injected, set where
        # the run is built; guard/faults.py)
        self.injected: Callable[[int], bool] = lambda listed: False
        self.policy: GuardPolicy = verdicts.policy
        # Roll back to the newest checkpoint file (checkpoints on, guard.rollback_to=checkpoint);
        # else to the in-memory snapshot.
        self.from_files, self.accumulation = from_files, accumulation
        self.snapshot: dict | None = None
        self.copied: Callable[[], None] = lambda: None  # waits for the snapshot's copies
        self.checkpoints: Checkpointer | None = None  # the run's: what a rollback restores
        self.file: TextIO | None = None
        self.log: RunLog | None = None
        self.is_main = True
        self.taken_back = 0  # bad steps settled in this process (not state: a count of work)

    # ---------------------------------------------------------------- set-up, state ---------
    @property
    def sharded(self) -> bool:
        """FSDP2, as the run's checkpointer found it (``Checkpointer.sharded``): no in-memory
        snapshot of the shards; a rollback goes to the checkpoints'."""
        return self.checkpoints is not None and self.checkpoints.sharded

    def start(self, owner: Stateful, meter, offset: int, log: RunLog | None, world: World,
              resume: tuple[bool, bool]) -> None:
        """After any restore, with ``checkpoints`` set: baseline the totals, open guard.jsonl,
        take the snapshot. ``resume``: (a checkpoint was restored, --resume was asked for)."""
        resumed, resume_requested = resume
        self.log, self.is_main = log, world.is_main
        self.verdicts.rebase(meter, offset)
        if world.is_main:
            path = RunDir(self.run_dir).guard_log
            if resume_requested:  # like metrics.jsonl: drop lines past the checkpoint
                truncate_jsonl(path, "n", self.policy.logged)
            self.file = open(path, "a")  # noqa: SIM115 - open for the run, closed by close()
        if not self.from_files or not resumed:
            self._take(owner)

    def saved(self, owner: Stateful) -> None:
        """After every save: the in-memory rollback point moves with the checkpoints."""
        if not self.from_files:
            self._take(owner)

    def _take(self, owner: Stateful) -> None:
        """The in-memory rollback point: copied into the last one's page-locked tensors, queued
        on the stream without a host sync (only a rollback, which reads it, waits). None under
        FSDP2, whose rollbacks go to the checkpoints' shards."""
        if self.sharded:
            return
        state = owner.state_dict()
        self.snapshot = snapshot(state, self.snapshot, pinned=True)
        self.copied = copies_done(state)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def state_dict(self) -> dict:
        """The pure GuardPolicy's state, with the spike statistics read from the device (a host
        read: checkpoints and rollbacks are settle points)."""
        state = self.policy.state_dict()
        if self.cfg.spike_factor > 0:
            state.update(self.verdicts.judge.state_dict())
        return state

    def load_state_dict(self, state: dict | None) -> None:
        self.policy.load_state_dict(state or {})
        self.verdicts.judge.load_state_dict(dict(state or {}))

    # ---------------------------------------------------------------- settling --------------
    def settle(self, meter, progress, data: BatchSource, model: nn.Module, world: World,
               owner: Stateful) -> tuple[int, list[int]]:
        """Read the verdicts of the steps since the last settle: ONE host read, at the settle
        points of ``engine/settle.py``, never on a plain step. Bad steps get their guard.jsonl
        lines with exact step numbers and leave the meter's counts; a rollback (of ``owner``,
        the run) or a stop happens here when due. Returns (steps since the last settle, indices
        of the bad ones); the engine corrects the step count and the schedule.

        ``meter`` and ``progress``: the run's (engine/progress.py); ``data``: its training
        BatchSource (data/source.py), read on the bad path only."""
        pending = self.verdicts.pending
        attempts = len(pending)
        if not attempts:
            return 0, []
        oks = torch.stack([v.ok for v in pending]).tolist()  # host sync: settle points only
        bad = [j for j, ok in enumerate(oks) if not ok]
        if bad:
            self._settle_bad(bad, meter, progress, data, model, world, owner)
        else:
            for _ in range(attempts):
                self.policy.record_good()  # ends any run of bad steps from an earlier settle
        self.verdicts.rebase(meter, progress.offset)
        return attempts, bad

    def _settle_bad(self, bad: list[int], meter, progress, data: BatchSource, model: nn.Module,
                    world: World, owner: Stateful) -> None:
        """Record, report and act on the bad steps among the pending ones, in order."""
        self.taken_back += len(bad)
        d = self.verdicts
        attempts = len(d.pending)
        rows = torch.stack([torch.stack([d.pending[j].total - d.pending[j].before,
                                         d.pending[j].norm.to(meter.loss_sum.dtype)])
                            for j in bad])
        if world.distributed:  # the windows' losses over all ranks, as the verdict saw them
            rows[:, 0] = all_reduce_sum(rows[:, 0].contiguous(), world)
        values = dict(zip(bad, rows.tolist()))  # host sync, bad path only
        meter.forget(sum(d.samples[j + 1] - d.samples[j] for j in bad), len(bad))
        step = progress.step - attempts  # the exact count at the last settle
        for j in range(attempts):
            if j not in values:
                step += 1
                self.policy.record_good()
                continue
            (loss_sum, norm), size = values[j], d.offsets[j + 1] - d.offsets[j]
            loss = loss_sum / max(size, 1)  # the window's mean loss over all ranks
            reason = self.policy.classify(loss, norm) or "spike"  # finite and bad: a spike
            window = self.window(data, d.offsets[j + 1])
            # every rank reads the same global indices, so every rank takes the same decision
            inputs = data.nonfinite_inputs(window)  # bad path only
            # fault.nan_at_step's k-th listed step in a row is the k-th bad attempt here
            listed = step + 1 + self.policy.consecutive
            cause = "inputs" if inputs else "injected" if self.injected(listed) else ""
            self.policy.record_bad(step + 1, reason, window, cause)
            bad_step = BadStep(step + 1, progress.epoch + 1, reason, loss, norm)
            self._report_bad(bad_step, inputs, model if j == attempts - 1 else None, world,
                             listed if cause == "injected" else None)
            if inputs:  # the inputs explain the step: leave them out, keep the LR
                self._roll_back(step + 1, meter, progress, data, world, owner, inputs)
            if self.policy.must_stop:
                self.stop(step + 1, world)
            if self.policy.must_roll_back:
                self._roll_back(step + 1, meter, progress, data, world, owner)

    def window(self, data: BatchSource, end: int) -> list[int]:
        """The global sample indices of the window that ended at epoch offset ``end`` (bad path
        only). Windows start at multiples of the window size within an epoch, resumed or not."""
        size = data.global_batch * self.accumulation
        return data.indices((end - 1) // size * size, end)

    # ---------------------------------------------------------------- the bad path ----------
    def _report_bad(self, bad: BadStep, bad_inputs: list[int], model: nn.Module | None,
                    world: World, listed: int | None = None) -> None:
        """One guard.jsonl line and a warning. ``model``: given when the step is the latest
        one, whose gradients are still those of the bad step (a verdict settled late: None).
        ``listed``: the step of fault.nan_at_step that made this bad attempt, if it did."""
        samples = self.policy.pending[-1]
        row = {"event": "bad_step", "step": bad.step, "epoch": bad.epoch,
               "reason": bad.reason, "loss": _num(bad.loss), "grad_norm": _num(bad.norm),
               "consecutive": self.policy.consecutive}
        if listed is not None:
            row["injected_at_step"] = listed  # fault.nan_at_step's own number for it
        if world.is_main:
            grads = [n for n, p in model.named_parameters()
                     if p.grad is not None and not bool(torch.isfinite(p.grad).all())] \
                if model is not None else None  # host sync, bad path only
            row.update(samples=samples, nonfinite_grads=grads,
                       inputs_nonfinite=bool(bad_inputs), nonfinite_input_samples=bad_inputs)
        self._write(row)
        # A bad attempt is no step: the next attempt is at the same step number, so a run of
        # bad ones is told apart by its attempt, not by a step that never happened.
        n = self.policy.consecutive
        attempt = f"step {bad.step}" if n == 1 else f"step {bad.step}, attempt {n},"
        why = bad.reason if listed is None else \
            f"{bad.reason} injected by fault.nan_at_step's step {listed}"
        self._say(f"{attempt} skipped ({why}: loss {_num(bad.loss)}, grad_norm "
                  f"{_num(bad.norm)}); {n} bad in a row, {len(samples)} samples listed in "
                  f"guard.jsonl")

    def _roll_back(self, step: int, meter, progress, data: BatchSource, world: World,
                   owner: Stateful, inputs: list[int] | None = None) -> None:
        """On every rank at the same step (the verdicts are the sums over ranks): the newest
        checkpoint back (a collective for FSDP2's shards), the guard's own state kept.
        ``inputs``: the non-finite input samples that explain the bad step (decide.py)."""
        self._wait()  # the newest checkpoint may still be being written
        barrier(world)
        state, source = self._target(step, world)
        keep = self.state_dict()  # the guard's knowledge outlives the rollback
        owner.load_state_dict(state)
        self.load_state_dict(keep)
        added = self.policy.roll_back(inputs, step)
        data.set_skip(self.policy.skip)
        if data.usable < data.global_batch:  # nothing left to train on
            self.stop(step, world, f"{len(self.policy.skip)} training samples are on the skip "
                                   f"list and fewer than one batch is left (the data itself is "
                                   f"bad: NaN or inf inputs or targets?)", data_bad=True)
        self.verdicts.rebase(meter, progress.offset)
        p = progress
        if self.log is not None:  # one timeline in the logs, as after a resume
            self.log.rewind(p.step, p.epoch)
        self._write({"event": "rollback", "step": step, "from_step": step,
                     "to_step": p.step, "epoch": p.epoch + 1, "source": source,
                     "cause": "nonfinite_inputs" if inputs else "bad_steps",
                     "lr_factor": self.policy.lr_factor, "samples_added": added,
                     "skipped_samples": len(self.policy.skip)})
        if inputs:
            self._say(f"rolled back from step {step} to step {p.step} ({source}) to leave out "
                      f"sample(s) {inputs}, whose inputs are NaN or inf; the LR is unchanged "
                      f"({len(self.policy.skip)} on the skip list in all)")
        else:
            self._say(f"rolled back from step {step} to step {p.step} ({source}); LR factor "
                      f"now {self.policy.lr_factor:g}, {len(added)} samples added to the skip "
                      f"list ({len(self.policy.skip)} in all)")
        raise RolledBack()

    def _target(self, step: int, world: World) -> tuple[dict, str]:
        """The state to roll back to: the newest valid checkpoint, found and loaded by the
        checkpointer as a resume does; else the in-memory snapshot."""
        ckpt = self.checkpoints
        if self.from_files and ckpt is not None:
            found = ckpt.latest(fetch=False, warn=(lambda msg: print(f"warning: {msg}"))
                                if self.is_main else (lambda msg: None))
            if found is not None:
                return ckpt.load(found), str(found.path.relative_to(self.run_dir))
        if self.snapshot is None:  # FSDP2 keeps no snapshot: its shards live on every rank
            self.stop(step, world, "no checkpoint to roll back to (under dist.strategy=fsdp "
                                   "the guard rolls back only to checkpoints: "
                                   "guard.rollback_to=checkpoint, and one written before the "
                                   "bad steps; lower checkpoint.every_steps), or resume with "
                                   "--resume and a lower optim.lr")
        # A fresh copy: optimizer.load_state_dict may keep the very tensors it is given. The
        # pinned copies must have landed first (a host sync: a rollback is a settle point).
        self.copied()
        return snapshot(self.snapshot), "memory snapshot"

    def stop(self, step: int, world: World, why: str = "", data_bad: bool = False) -> None:
        """End the run with GuardStop: too many rollbacks, or no way to roll back.
        ``data_bad``: the training data itself is the trouble (too much of it skipped)."""
        g = self.policy
        recent = ", ".join(f"step {e[0]} ({e[1]})" for e in g.events[-8:])
        why = why or (f"{g.max_bad_steps} bad step(s) in a row again after {g.rollbacks} "
                      f"rollback(s) (guard.max_rollbacks={g.max_rollbacks})")
        msg = (f"the guard stopped the run at step {step}: {why}"
               f"; recent bad steps: {recent}. {self.stop_advice(step, data_bad)}, and "
               f"inspect the samples listed in {self.run_dir / 'guard.jsonl'}; every checkpoint in "
               f"{self.run_dir / 'checkpoints'} is intact")
        self._write({"event": "stop", "step": step, "rollbacks": g.rollbacks,
                     "bad_steps": g.bad_steps, "message": msg})
        self._wait()
        raise GuardStop(msg)

    def stop_advice(self, step: int, data_bad: bool = False) -> str:
        """What a stop suggests, from what the guard found in the latest bad steps: a data fix
        for samples with NaN/inf inputs, the fault knob for steps it injected, and the run's
        LR and clipping advice only for bad steps neither explains."""
        causes, tips = self.policy.causes(), []
        if "inputs" in causes or (data_bad and self.policy.bad_inputs):
            tips.append(f"Fix or filter training sample(s) {_few(self.policy.bad_inputs)}, whose "
                        f"inputs are NaN or inf (guard.jsonl's nonfinite_input_samples)")
        if "injected" in causes:
            tips.append("The bad steps were injected by fault.nan_at_step (a test knob): drop it "
                        "to train without them, or raise guard.max_rollbacks")
        if data_bad and not tips:
            tips.append("Check the training data for NaN or inf inputs or targets")
        if "" in causes and not data_bad:
            rolled = self.policy.rolled_from
            if rolled and set(rolled) == {step}:
                # each rollback replayed the same step and it failed again: a stream reads
                # the same samples again (it has no skip list), so the data is the suspect
                tips.append(f"Step {step} failed again after every rollback: a bad "
                            f"sample there (NaN or inf inputs or targets, which a stream "
                            f"serves again) is the likely cause; check the data read at it")
            tips.append(self.advice)
        return ". ".join(tips)

    def _wait(self) -> None:
        """Every rank: the in-flight checkpoint write on disk (under FSDP2 a collective)."""
        if self.checkpoints is not None:
            self.checkpoints.wait()

    def _write(self, row: dict) -> None:
        self.policy.logged += 1  # on every rank: the count is part of the checkpoint
        if self.file is not None:
            self.file.write(json.dumps({"n": self.policy.logged, **row, "time": time.time()})
                            + "\n")
            self.file.flush()

    def _say(self, text: str) -> None:
        if self.is_main:
            tqdm.write(f"warning: guard: {text}")


def _few(samples: list[int], most: int = 10) -> str:
    """A list of sample indices, cut after ``most`` (guard.jsonl holds them all)."""
    shown = ", ".join(map(str, samples[:most]))
    return f"[{shown}, ... {len(samples)} in all]" if len(samples) > most else f"[{shown}]"


def _num(x: float):
    """A finite float as is; nan/inf as strings, so guard.jsonl stays strict JSON."""
    return x if math.isfinite(x) else str(x)


def advice(max_norm: float | None, precision: str) -> str:
    """What a guard stop suggests, for this run: clipping only when it is off (or loose), bf16
    only for an fp16 run."""
    tips = ["a lower optim.lr"]
    if not max_norm:
        tips.append("clip.max_norm=1.0")
    elif max_norm > 1.0:
        tips.append(f"a tighter clip.max_norm than {max_norm:g}")
    if precision == "fp16":
        tips.append("train.precision=bf16 instead of fp16")
    return "Try " + ", ".join(tips)
