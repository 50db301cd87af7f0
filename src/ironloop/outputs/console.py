"""What a run shows on the terminal: the tqdm bar of an epoch and the line each epoch ends with."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(run):
    """The epoch's tqdm bar: on a terminal (log.progress=auto), on rank 0 only."""
    mode = run.cfg.log.progress
    show = run.world.is_main and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
    done = run.progress.offset // (run.sampler.global_batch * run.cfg.train.accumulation_steps)
    # The epoch's steps, or fewer when train.max_steps ends the run inside this epoch.
    left = max(0, min(run.steps_per_epoch - done, run.total_steps - run.progress.step))
    return tqdm(total=done + left, initial=done, disable=not show, leave=False,
                desc=f"epoch {run.progress.epoch + 1}/{run.cfg.train.epochs}", unit="step",
                dynamic_ncols=True)


def say(run, line: str) -> None:
    """One line on rank 0, printed above the bar rather than through it."""
    if run.world.is_main:
        tqdm.write(line)


def epoch_line(row: dict, epochs: int) -> str:
    """The plain line each epoch ends with (a log file gets only these)."""
    parts = [f"epoch {row['epoch']}/{epochs}", f"step {row['step']}",
             f"train_loss {row['train_loss']:.4f}"]
    if row.get("val_loss") is not None:
        parts.append(f"val_loss {row['val_loss']:.4f}")
    if row.get("val_acc") is not None:
        parts.append(f"val_acc {100 * row['val_acc']:.2f}%")
    if row.get("val_ppl") is not None:
        parts.append(f"val_ppl {row['val_ppl']:.2f}")
    parts += [f"lr {row['lr']:.2e}", f"{row['seconds']:.1f}s",
              f"{row['samples_per_s']:.0f} samples/s"]
    if row.get("clipped_frac"):
        parts.append(f"clipped {100 * row['clipped_frac']:.0f}%")
    if row.get("tokens_per_s"):
        parts.append(f"{row['tokens_per_s']:.0f} tokens/s")
    if row.get("skipped"):
        parts.append(f"fp16-skipped {row['skipped']}")
    for key in ("bad_steps", "rollbacks", "skipped_samples"):  # the guard's totals
        if row.get(key):
            parts.append(f"{key.replace('_', ' ')} {row[key]}")
    return "  ".join(parts)



def eval_line(row: dict, what: str = "evaluation") -> str:
    """One line for an evals.jsonl row: the step and every val_* metric."""
    parts = [f"{what} at step {row['step']}"]
    for key, value in row.items():
        if key.startswith("val_") and isinstance(value, (int, float)):
            parts.append(f"{key} {100 * value:.2f}%" if key == "val_acc" else
                         f"{key} {value:.4f}" if key != "val_ppl" else f"{key} {value:.2f}")
    return "  ".join(parts)
