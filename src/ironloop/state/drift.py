"""Config drift on resume: which keys may change between a checkpoint and its resume.

A resume compares the resolved config with the one stored in the checkpoint. Keys that cannot
change the weights (``FREE``) change with a notice. Every other key is a *trajectory* key, and
that includes every section added later (guard, eval, dist, ...) until it is listed here: a
difference there is refused unless the user passes ``--allow-config-change``
(``fit(..., allow_config_change=True)``).

Extending a run (``train.epochs`` / ``train.max_steps``) keeps the learning-rate schedule the
run was built with: its length and state come from the checkpoint, and past its end the LR
holds at the value of the schedule's last step. The LR curve is continuous, and the steps already
taken were trained under the schedule that is recorded. A cosine or onecycle ends near 0, so
the resume warns before its first step (engine/schedule_notes.py).
"""

from __future__ import annotations

from typing import Any

from ironloop.errors import ConfigError, option

#: Keys, or "section." prefixes, that cannot change the weights. Edit here and nowhere else.
FREE: tuple[str, ...] = (
    "run.dir",           # where outputs go (a moved run directory resumes)
    "run.device",        # device-like: same math, other hardware (bits may differ on CUDA)
    "run.threads",       # the same math split over other threads: CPU reductions may round
                         # differently in the last bits, as across devices; a resume on a
                         # machine with other cores must not be refused for it
    "log.",              # what gets written, how often, and where to
    "checkpoint.",       # when and how checkpoints are written, how many are kept
    "data.root",         # where the files are, not which files
    "data.download",
    "data.num_workers",  # the batch order is a function of (seed, epoch) only
    "data.pin_memory",
    "fault.",            # the lab's crash knob
    "profile.",          # timing and traces measure the run, they do not change it
    "doctor.",           # the preflight works on copies and restores the RNG state
    "eval.perplexity",   # one more column, exp(val_loss)
    "eval.metrics",      # more columns: whole-split metrics read the predictions only
    "train.compile",     # the same module, compiled or not (bits may differ, as across devices)
    "train.compile_mode",
    "train.cuda_graph",  # the same step, replayed from a graph or launched kernel by kernel
    "train.activation_checkpointing",  # recomputes the same forward in backward: same math
    "dist.",             # ddp or fsdp, how blocks are sharded, the timeout: the same math
)

#: Per-rank batch keys: free when the global window (their product times the number of ranks)
#: is unchanged, as when a run resumes on another allocation (2 x 32 on 2 ranks -> 64 on 1).
WINDOW: tuple[str, ...] = ("train.batch_size", "train.accumulation_steps",
                           "train.global_batch_size")

#: What a world-size change alone changes, named in the refusal.
GLOBAL = "global batch (batch_size x accumulation_steps x ranks)"

#: Trajectory keys that only set how long the run goes on.
LENGTH: tuple[str, ...] = ("train.epochs", "train.max_steps")

#: Schedules with an end; past their length the LR holds (see the module docstring).
FINITE_SCHEDULES = ("onecycle", "cosine", "warmup_cosine")


def is_free(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"epochs": 3}} -> {"train.epochs": 3}; a dict-valued key (model.kwargs) stays
    one value, so a changed kwarg shows as one change."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not prefix:
            out.update(flatten(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, new value) for every key both configs have and that differs.
    A key only one side has (a section added or removed by an upgrade) is not a change."""
    a, b = flatten(old), flatten(new)
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]]


def _fmt(change: tuple[str, Any, Any]) -> str:
    key, old, new = change
    return f"{key}: {old!r} -> {new!r}"


def global_window(config: dict, world_size: int) -> int | None:
    """Samples per optimizer step over all ranks: batch_size x accumulation_steps x ranks."""
    train = config.get("train") or {}
    if "batch_size" not in train or "accumulation_steps" not in train:
        return None
    return train["batch_size"] * train["accumulation_steps"] * world_size


def check(old: dict, new: dict, allow: bool, say=print,
          worlds: tuple[int, int] = (1, 1)) -> list[tuple[str, Any, Any]]:
    """Refuse (ConfigError) a trajectory change unless ``allow``; say what changed.
    ``worlds`` is (the checkpoint's number of ranks, this run's).

    Returns the accepted trajectory changes."""
    found = changes(old, new)
    window, new_window = global_window(old, worlds[0]), global_window(new, worlds[1])
    same_window = window is not None and window == new_window
    if None not in (window, new_window) and not same_window and \
            not any(c[0] in WINDOW for c in found):
        # the same keys on another number of ranks: the global batch changed all the same
        found.append((GLOBAL, window, new_window))

    def free_key(key: str) -> bool:
        return is_free(key) or (key in WINDOW and same_window) or frozen(key)

    def frozen(key: str) -> bool:  # optim.lr=0 freezes the weights from here: nothing changes
        return key == "optim.lr" and flatten(new).get(key) == 0

    free = [c for c in found if free_key(c[0])]
    bound = [c for c in found if not free_key(c[0])]
    if bound and not allow:
        raise ConfigError(
            "the resumed config differs from the checkpoint's in keys that change the training "
            f"trajectory: {'; '.join(map(_fmt, bound))}. Resume with the checkpoint's values, "
            f"or pass {option('allow_config_change')} to accept them")
    for c in free:
        why = (f"the same {window} samples per optimizer step over {worlds[1]} rank(s)"
               if c[0] in WINDOW else "every step from here runs at LR 0: the weights stay "
               "as they are" if frozen(c[0]) else "cannot change the weights")
        say(f"notice: resuming with {_fmt(c)} ({why})")
    for c in bound:
        if c[0] in LENGTH:
            what = "the run's length; the LR schedule keeps the length it was built with"
        elif c[0].startswith(("optim.", "schedule.")):
            what = "values held in the optimizer or scheduler state keep the checkpoint's"
        else:
            what = "applies from the resumed step on"
        say(f"notice: {option('allow_config_change')}: {_fmt(c)} ({what})")
    return bound
