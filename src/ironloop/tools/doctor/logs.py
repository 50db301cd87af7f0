"""After the run: what the logs say went wrong (``ironloop report`` prints these)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ironloop.outputs.averaged import last_compared
from ironloop.outputs.numbers import number
from ironloop.outputs.readers import continuous, get_dotted, load_mapping, num, read_jsonl
from ironloop.state.run_dir import RunDir
from ironloop.tools.doctor.findings import Finding, info

#: Thresholds, named so the docs (docs/how-to/doctor.md) and the findings quote the same numbers.
FLAT = 0.05            # train loss fell by less than 5% after epoch 1
RISE = 0.05            # val loss 5% above its minimum, two or more epochs later
HIGH_ACC = 0.95        # val accuracy at epoch 1
CLIP_SHARE = 0.5       # clipped steps in steady state (after the first 10% of steps)
#: Optimizers that divide each step by a running scale of the gradient (lower-case class
#: names): a uniform rescale of the gradient, which is all clipping by norm does, barely
#: changes their step (Lion's sign does not change at all).
ADAPTIVE = ("adam", "adamw", "adamax", "nadam", "radam", "sparseadam", "adagrad", "adadelta",
            "rmsprop", "adafactor", "lion", "lamb", "adan", "sophia")
ZERO_LR = 0.01         # an LR at or below 1% of the run's peak trains (almost) nothing
ZERO_LR_WINDOWS = 5    # ... over the last 5 log windows or more
SLOWDOWN = 0.7         # last quarter's samples/s below 70% of the first quarter's
AVERAGE_WORSE = 0.05   # the averaged weights' val loss 5% above the raw weights' at the end


def diagnose_logs(run_dir: Path | str) -> list[Finding]:
    """Every diagnosis that the run's metrics.jsonl, epochs.jsonl and evals.jsonl support."""
    rd = RunDir(run_dir)
    metrics = continuous(read_jsonl(rd.log("metrics")))
    epochs = continuous(read_jsonl(rd.log("epochs")), "epoch")
    evals = continuous(read_jsonl(rd.log("evals")))
    cfg = load_mapping(rd.config)[0]
    results = load_mapping(rd.results)[0]
    return [*non_finite_loss(metrics), *(zero_lr(metrics) or flat_loss(epochs, metrics)),
            *overfitting(epochs),
            *high_first_val_acc(epochs),
            *clipping(metrics, get_dotted(cfg, "clip.max_norm"), optimizer_name(cfg)),
            *throughput_drop(metrics, epochs, results), *average_worse(evals, cfg)]


def optimizer_name(cfg: dict) -> str | None:
    """The optimizer the run used: its class (config.yaml's ``used.optimizer``, a user's own
    included), else optim.name for runs recorded before that block existed."""
    used = cfg.get("used")
    name = used.get("optimizer") if isinstance(used, dict) else None
    return name or get_dotted(cfg, "optim.name")


def non_finite_loss(metrics: list[dict]) -> list[Finding]:
    for r in metrics:
        v = r.get("loss")
        if isinstance(v, float) and not math.isfinite(v):
            return [Finding("nan_loss", "error", f"the training loss is {v} at step {r['step']}",
                            "the LR is too high, or log(0)/division by zero in the loss",
                            "lower optim.lr, keep clip.max_norm on, and run `ironloop doctor`")]
    return []


def flat_loss(epochs: list[dict], metrics: list[dict]) -> list[Finding]:
    """The training loss barely moves after epoch 1 (or, within one epoch, after the first
    logged window)."""
    losses = [v for v in (num(r.get("train_loss")) for r in epochs) if v is not None]
    what = "epoch"
    if len(losses) < 2:
        losses = [v for v in (num(r.get("loss")) for r in metrics) if v is not None]
        what = "log window"
        if len(losses) < 5:
            return []
    first, best = losses[0], min(losses[1:])
    if first <= 0 or best < (1 - FLAT) * first:
        return []
    return [Finding("flat_loss", "warning",
                    f"the training loss is flat: {number(first)} in the first {what}, at best "
                    f"{number(best)} over the next {len(losses) - 1} (less than {FLAT:.0%} lower)",
                    "the LR is too low, parameters get no gradient, or the model outputs "
                    "probabilities to a loss that expects logits (a loss stuck at log(C))",
                    "run `ironloop doctor CONFIG --lr-find` (dead_parameters, probabilities "
                    "and the LR range test)")]


def zero_lr(metrics: list[dict]) -> list[Finding]:
    """The run ends with ZERO_LR_WINDOWS or more log windows at an LR of at most ZERO_LR of its
    peak while the loss stays flat: training that changed (almost) nothing. The usual cause is
    a run extended on resume past its finite schedule (engine/schedule_notes.py)."""
    rows = [(r["step"], lr, num(r.get("loss"))) for r in metrics
            if (lr := num(r.get("lr"))) is not None and isinstance(r.get("step"), int)]
    peak = max((lr for _, lr, _ in rows), default=0.0)
    tail: list[tuple] = []
    for row in reversed(rows):
        if row[1] > ZERO_LR * peak:
            break
        tail.insert(0, row)
    losses = [loss for *_, loss in tail if loss is not None]
    if peak <= 0 or len(tail) < ZERO_LR_WINDOWS or not losses or \
            min(losses) < (1 - FLAT) * losses[0]:
        return []
    return [Finding("flat_loss", "warning",
                    f"the training loss is flat ({number(losses[0])} -> {number(losses[-1])}) "
                    f"from step {tail[0][0]} to {tail[-1][0]}, where the LR is "
                    f"{number(tail[-1][1])} ({tail[-1][1] / peak:.0%} of its peak "
                    f"{number(peak)})",
                    "those steps trained at (almost) no LR: a finite schedule (cosine, "
                    "warmup_cosine, onecycle) ended before the run did, as when a resume "
                    "extends train.max_steps or train.epochs (the schedule keeps the length it "
                    "was built with), or optim.lr=0",
                    "start a fresh run with the length you want (its schedule is built for it), "
                    "or one with a schedule without an end (schedule.name=constant)")]


def overfitting(epochs: list[dict]) -> list[Finding]:
    """Validation loss rising for two or more epochs after its minimum while the training
    loss keeps falling."""
    rows = [(r["epoch"], train, val) for r in epochs
            if (train := num(r.get("train_loss"))) is not None
            and (val := num(r.get("val_loss"))) is not None]
    if len(rows) < 3:
        return []
    best = min(range(len(rows)), key=lambda i: rows[i][2])
    after = rows[best + 1:]
    if len(after) < 2 or after[-1][2] < (1 + RISE) * rows[best][2] or \
            after[-1][1] >= rows[best][1]:
        return []
    start = after[0][0]
    return [Finding("overfitting", "warning",
                    f"validation loss rises from epoch {start} ({number(rows[best][2])} at "
                    f"epoch {rows[best][0]} -> {number(after[-1][2])} at epoch {after[-1][0]}) "
                    f"while the training loss falls ({number(rows[best][1])} -> "
                    f"{number(after[-1][1])})",
                    f"the model memorises the training set from epoch {start} on",
                    f"early_stop.patience=2 (keeps the best weights), more weight decay or "
                    f"dropout, data augmentation, or train.epochs={rows[best][0]}")]


def high_first_val_acc(epochs: list[dict]) -> list[Finding]:
    acc = num(epochs[0].get("val_acc")) if epochs else None
    if acc is None or acc < HIGH_ACC:
        return []
    return [Finding("val_acc_epoch1", "warning",
                    f"validation accuracy is {100 * acc:.1f}% after one epoch",
                    "validation samples that also appear in training (leakage), labels that "
                    "leak into the inputs, or a task easier than expected",
                    "run `ironloop doctor CONFIG` (the leakage and initial_loss checks)")]


def clipping(metrics: list[dict], max_norm, optimizer: str | None = None) -> list[Finding]:
    """Share of clipped steps after the first 10% of steps (warm-up is allowed to clip). With
    SGD that is a hidden LR cut; with an adaptive optimizer (ADAPTIVE) it is not, and raising
    the threshold would change little, so it is only reported."""
    last = max((num(r.get("step")) or 0 for r in metrics), default=0)
    steady = [r for r in metrics if (num(r.get("step")) or 0) > 0.1 * last]
    clipped = sum(num(r.get("clipped")) or 0 for r in steady)
    steps = sum(num(r.get("steps")) or 0 for r in steady)
    if steps < 10 or clipped / steps <= CLIP_SHARE:
        return []
    norms = [v for v in (num(r.get("grad_norm")) for r in steady) if v is not None]
    median = statistics.median(norms) if norms else None
    hint = f"; median pre-clip norm {median:.3g}" if median is not None else ""
    raise_to = f" (about {1.5 * median:.2g})" if median is not None else ""
    measured = (f"{100 * clipped / steps:.0f}% of steady-state steps were clipped at "
                f"clip.max_norm={max_norm}{hint}")
    if str(optimizer).lower() in ADAPTIVE:
        return [info("clipping", f"{measured}. With {optimizer}, which divides each step by "
                     f"a running scale of the gradient, a uniform rescale of the gradient "
                     f"barely changes the step: this is no hidden LR cut, and raising "
                     f"clip.max_norm would change little")]
    return [Finding("clipping", "warning", measured,
                    "clipping on most steps rescales every update: it acts as a hidden LR "
                    "cut, and the LR schedule no longer means what it says",
                    f"raise clip.max_norm{raise_to} so it only catches spikes, or lower "
                    f"optim.lr")]


def throughput_drop(metrics: list[dict], epochs: list[dict],
                    results: dict | None = None) -> list[Finding]:
    """samples/s of the last quarter of the logged windows against the first quarter (the very
    first window, which pays warm-up, is left out). The fix points to the file that holds a
    time split to compare (``_where_to_look``)."""
    speeds = [v for v in (num(r.get("samples_per_s")) for r in metrics[1:]) if v is not None]
    if len(speeds) < 8:
        return []
    q = len(speeds) // 4
    early, late = statistics.median(speeds[:q]), statistics.median(speeds[-q:])
    if late >= SLOWDOWN * early:
        return []
    grew = _part_that_grew(epochs)
    return [Finding("throughput", "warning",
                    f"throughput fell from {number(early)} to {number(late)} samples/s "
                    f"({100 * (1 - late / early):.0f}% lower) between the first and the last "
                    f"quarter of the run{grew}",
                    "a growing Python structure (e.g. keeping loss tensors with their graphs), "
                    "a data source that slows down, memory pressure, or other jobs on the "
                    "machine", f"{_where_to_look(epochs, results or {})}, and keep only "
                    ".item() values of what you store")]


def _where_to_look(epochs: list[dict], results: dict) -> str:
    """The file that shows where the time went: epochs.jsonl when two or more epochs have a
    time split (a max_steps run inside one epoch has none), else results.json's split of the
    whole run, else metrics.jsonl's samples_per_s (a run that did not finish)."""
    if sum(isinstance(r.get("time_split"), dict) for r in epochs) >= 2:
        return "compare the time split per epoch in epochs.jsonl to see which part grew"
    if isinstance(results.get("time_split"), dict):
        return ("see which part takes the time in results.json's time_split (the whole run; "
                "no two epochs ended to compare) and from which step samples_per_s falls in "
                "metrics.jsonl")
    return "see from which step samples_per_s falls in metrics.jsonl"


def _part_that_grew(epochs: list[dict]) -> str:
    split = [(r["time_split"], num(r.get("step"))) for r in epochs
             if isinstance(r.get("time_split"), dict)]
    if len(split) < 2:
        return ""
    (first, _), (last, _) = split[0], split[-1]
    growth = {k: (last.get(k) or 0) - (first.get(k) or 0) for k in first}
    part = max(growth, key=lambda k: growth[k])
    if growth[part] <= 0:
        return ""
    return (f"; the time split says {part} grew most ({first[part]:.2f} s in the first epoch, "
            f"{last[part]:.2f} s in the last)")


def average_worse(evals: list[dict], cfg: dict) -> list[Finding]:
    """The averaged weights (average.kind) lose to the raw ones at the last evaluation that
    ran both: their loss more than AVERAGE_WORSE higher, and no judged metric better
    (outputs/averaged.py). final_avg.safetensors is then the worse of the two files."""
    last = last_compared(evals)
    if last is None:
        return []
    row, found = last
    if any(p.outcome == "better" for p in found.pairs) or \
            not any(p.lower_is_better and p.avg > (1 + AVERAGE_WORSE) * p.raw
                    for p in found.pairs):
        return []
    if get_dotted(cfg, "average.kind") == "swa":
        cause = "SWA's equal average gives the early weights as much say as the last ones"
        fix = "start it later with average.start_step (e.g. the last quarter of the steps)"
    else:
        decay = get_dotted(cfg, "average.decay")
        cause = (f"the average still holds early weights: average.decay={decay} keeps "
                 f"decay^t of the weights from t updates back")
        if get_dotted(cfg, "average.warmup") is False:
            cause += ", and average.warmup=false gives the first weights that share too"
        fix = ("average.warmup=true (the default), a lower average.decay (about 1 - 10 / the "
               "run's updates) or a later average.start_step")
    return [Finding("average", "warning",
                    f"{found.words()} at the last evaluation (step {row.get('step')})", cause,
                    f"{fix}; final.safetensors holds the raw weights")]


def markdown(findings: list[Finding]) -> str:
    """A "Diagnosis" section for report.md."""
    if not findings:
        return "## Diagnosis\n\nNothing in the logs calls for attention.\n"
    lines = ["## Diagnosis", ""]
    for f in findings:
        cause = f" *Likely cause:* {f.cause}." if f.cause else ""  # an info has neither
        fix = f" *Fix:* {f.fix}." if f.fix else ""
        lines.append(f"- **{f.severity}** ({f.check}): {f.measured}.{cause}{fix}")
    return "\n".join(lines) + "\n"
