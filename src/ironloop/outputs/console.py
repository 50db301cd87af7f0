"""What a person watching a run sees: the tqdm bar on a terminal, plain progress lines in a log
file (SLURM, CI, ``| tee``), and one line for each evaluation, epoch, resume and warning.

On rank 0 only. ``log.progress``: ``auto`` shows the bar when stderr is a terminal and prints
a compact progress line every ``log.progress_every_steps`` steps or ``log.progress_every_s``
seconds (whichever comes first) when stdout is not one; ``on`` forces the bar; ``off`` shows
neither. Evaluation, epoch and resume lines print in every mode.
"""

from __future__ import annotations

import math
import sys
import time
from typing import NamedTuple, Protocol

from tqdm import tqdm

from ironloop.config import LogConfig
from ironloop.outputs.averaged import compare
from ironloop.outputs.numbers import number


class Position(Protocol):
    """Where the run stands (engine/progress.py's Progress)."""

    epoch: int   # the epoch in progress, 0-based
    step: int    # optimizer steps done
    offset: int  # samples of this epoch consumed, over all ranks


class RunPlan(NamedTuple):
    """The run's length, as the console counts it."""

    total_steps: int
    steps_per_epoch: int
    epochs: int  # train.epochs
    window: int  # samples per optimizer step over all ranks (global batch x accumulation)
    # False for a stream without a length: steps_per_epoch is then only train.max_steps, and
    # an epoch ends when the stream does (data/stream.py)
    epoch_known: bool = True

    @property
    def planned_epochs(self) -> int | None:
        """The epoch the run ends in: train.epochs, or fewer when train.max_steps ends it
        sooner; None when that is unknown (a stream without a length, over several epochs)."""
        if not self.epoch_known:
            return 1 if self.epochs == 1 else None
        return max(1, min(self.epochs, math.ceil(self.total_steps / self.steps_per_epoch)))

    def epoch_of(self, epoch: int) -> str:
        """``epoch 3/7``, or ``epoch 3`` when the run's epoch count is unknown (1-based)."""
        planned = self.planned_epochs
        return f"epoch {epoch}" if planned is None else f"epoch {epoch}/{planned}"

    def steps_into(self, p: Position) -> int:
        """Optimizer steps taken in the epoch in progress; an epoch's ragged last window (a
        partial one) is a step too."""
        return -(-p.offset // max(1, self.window))


class EpochProgress:
    """One epoch's progress: the tqdm bar, plain lines, both or neither (see the module doc).
    The loop calls ``update``, ``set_postfix`` (on log steps) and ``close``, as on a tqdm bar."""

    def __init__(self, cfg: LogConfig, p: Position, plan: RunPlan, main: bool):
        mode = cfg.progress
        done = plan.steps_into(p)
        # The epoch's steps, or fewer when train.max_steps ends the run inside this epoch.
        left = max(0, min(plan.steps_per_epoch - done, plan.total_steps - p.step))
        self.progress, self.plan, self.main = p, plan, main
        self.postfix: dict[str, str] = {}
        self.desc = plan.epoch_of(p.epoch + 1)
        show = main and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
        self.bar = tqdm(total=done + left, initial=done, disable=not show, leave=False,
                        desc=self.desc, unit="step", dynamic_ncols=True)
        self.plain = main and mode != "off" and not sys.stdout.isatty()
        self.every, self.seconds = cfg.progress_every_steps, cfg.progress_every_s
        self.last_step, self.last_time = p.step, time.monotonic()

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        if not self.plain:
            return
        step, now = self.progress.step, time.monotonic()  # one clock read per step
        if (self.every and step - self.last_step >= self.every) or \
                (self.seconds and now - self.last_time >= self.seconds):
            say(self.main, progress_line(self, step, now))
            self.last_step, self.last_time = step, now

    def set_postfix(self, refresh: bool = False, **values) -> None:
        """The latest log step's figures (numbers written with ``number``)."""
        self.postfix.update({k: number(v) for k, v in values.items()})
        self.bar.set_postfix(self.postfix, refresh=refresh)

    def close(self) -> None:
        self.bar.close()


def progress_line(prog: EpochProgress, step: int, now: float) -> str:
    """``step 120/500  epoch 3/10  loss 0.1234  lr 0.001000  8.100 steps/s  eta 0:00:47``."""
    total = prog.plan.total_steps
    rate = (step - prog.last_step) / max(now - prog.last_time, 1e-9)
    parts = [f"step {step}/{total}", prog.desc]
    parts += [f"{k} {v}" for k, v in prog.postfix.items()]  # the latest log step's values
    parts.append(f"{number(rate)} steps/s")
    if rate > 0:
        parts.append(f"eta {_clock((total - step) / rate)}")
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def say(main: bool, line: str) -> None:
    """One line on rank 0 (``main``), printed above the bar rather than through it."""
    if main:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()  # a log file sees it now, not when the buffer fills


def eval_line(row: dict, total_steps: int, what: str = "eval") -> str:
    """One evaluation (eval.every_steps, or the final one of a max_steps run):
    ``eval at step 40/120 (epoch 1): val_loss ...  (0.4 s)``, then, with weight averaging,
    ``; averaged weights better than raw`` (or worse, or as good: outputs/averaged.py)."""
    vals = [f"{k} {_value(k, v)}" for k, v in row.items() if k.startswith("val_")]
    return (f"{what} at step {row['step']}/{total_steps} (epoch {row['epoch']}): "
            + "  ".join(vals) + f"  ({row['seconds']:.1f} s)" + _averaged(row))


def test_line(test: dict, weights: str) -> str:
    """The test split's result: ``test (best weights): test_loss 1.234  test_ppl 3.435``."""
    vals = [f"test_{k} {_value(f'test_{k}', v)}" for k, v in test.items()
            if isinstance(v, (int, float)) and k != "seconds"]
    return f"test ({weights} weights): " + "  ".join(vals)


def _averaged(row: dict) -> str:
    found = compare(row)
    return f"; {found.words(figures=False)}" if found is not None else ""


def _value(key: str, v) -> str:
    if not isinstance(v, (int, float)):
        return str(v)
    return f"{100 * v:.2f}%" if key.endswith("_acc") else number(v)


_PLAIN_VAL = ("val_loss", "val_acc", "val_ppl", "val_seconds")


def epoch_line(row: dict, plan: RunPlan, last_eval: dict) -> str:
    """The plain line each epoch ends with. Validation figures from an evaluation at an earlier
    step (eval.every_steps) say which step they come from: they are not this epoch's."""
    parts = [plan.epoch_of(row["epoch"]), f"step {row['step']}",
             f"train_loss {number(row['train_loss'])}"]
    dated = last_eval.get("step")
    dated = f" (step {dated})" if dated is not None and dated != row["step"] else ""
    if row.get("val_loss") is not None:
        parts.append(f"val_loss {number(row['val_loss'])}{dated}")
    if row.get("val_acc") is not None:
        parts.append(f"val_acc {100 * row['val_acc']:.2f}%{dated}")
    if row.get("val_ppl") is not None:
        parts.append(f"val_ppl {number(row['val_ppl'])}")
    parts += [f"{k} {_value(k, v)}{dated}" for k, v in row.items()  # named sets, averaged
              if k.startswith("val_") and k not in _PLAIN_VAL and v is not None]
    parts += [f"lr {number(row['lr'])}", f"{row['seconds']:.1f}s",
              f"{number(row['samples_per_s'])} samples/s"]
    if row.get("clipped_frac"):
        parts.append(f"clipped {100 * row['clipped_frac']:.0f}%")
    if row.get("tokens_per_s"):
        parts.append(f"{number(row['tokens_per_s'])} tokens/s")
    if row.get("skipped"):
        parts.append(f"fp16-skipped {row['skipped']}")
    for key in ("bad_steps", "rollbacks", "skipped_samples"):  # the guard's totals
        if row.get(key):
            parts.append(f"{key.replace('_', ' ')} {row[key]}")
    return "  ".join(parts) + _averaged(row)


def world_change(event: dict) -> str:
    """"; world size 2 -> 1: accumulation 1 -> 2, global batch 64 kept", or "" when the
    number of ranks is the one the checkpoint was written on."""
    before, now = event.get("world_size_before"), event.get("world_size")
    if before is None or before == now:
        return ""
    g0, g = event.get("global_batch_before"), event.get("global_batch")
    kept = f"global batch {g} kept" if g0 == g else f"global batch {g0} -> {g}"
    return (f"; world size {before} -> {now}: accumulation {event.get('accumulation_before')} "
            f"-> {event.get('accumulation_steps')}, {kept}")


def resume_line(event: dict, p: Position, plan: RunPlan, changed: list[tuple]) -> str:
    """The one line a resume prints: from where, what is redone, what changed."""
    complete = event["step"] >= plan.total_steps
    if p.offset == 0 and p.epoch > 0:  # at an epoch's end: the next one has not started
        where = f"epoch {p.epoch} finished" + \
            (", the run's last" if complete else f"; epoch {p.epoch + 1} next")
    else:  # a stream without a length: its epoch's steps are unknown until it ends
        of = f"/{plan.steps_per_epoch}" if plan.epoch_known else ""
        where = f"epoch {p.epoch + 1}, {plan.steps_into(p)}{of} steps into it"
    line = f"resumed from {event['from']} at step {event['step']}/{plan.total_steps} ({where})"
    if event.get("steps_redone"):
        a, b = event["step"] + 1, event["last_logged_step"]
        line += (f"; redoing step{f's {a}-{b}' if b > a else f' {a}'}, which the previous "
                 f"process had logged after this checkpoint")
    else:
        line += "; the previous process logged no step past it"
    line += world_change(event)
    line += "; config unchanged" if not changed else "; config changed: " + ", ".join(
        f"{k} {a!r} -> {b!r}" for k, a, b in changed)
    if complete:  # a finished run, or a shorter max_steps
        line += (f". Nothing to train: the run is already complete at step {event['step']} "
                 f"of {plan.total_steps}; raise train.max_steps or train.epochs to train "
                 f"further")
    return line
