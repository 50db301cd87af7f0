"""A markdown and HTML summary of one run directory, with its plots (``tools/plots.py``).

``render_report(run_dir)`` reads ``metrics.jsonl``, ``epochs.jsonl``, ``events.jsonl``,
``results.json`` and ``config.yaml`` and writes PNGs plus ``report.md`` to ``run_dir/report``.
Readers are tolerant: missing keys, nulls, NaNs and a partial line left by a crash are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ironloop.errors import UserError
from ironloop.outputs.averaged import last_compared
from ironloop.outputs.numbers import number
from ironloop.outputs.readers import continuous, get_dotted, load_mapping, num, read_jsonl
from ironloop.state.run_dir import REPORT, RunDir
from ironloop.tools.plots import (
    as_percent,
    averaged_pairs,
    clipped_fraction,
    crash_steps,
    plot_accuracy,
    plot_averaged,
    plot_grad_norm,
    plot_grad_norm_hist,
    plot_loss_curves,
    plot_lr,
    plot_resume_curve,
    plot_validation,
    values_of,
)


def _fmt(*candidates: Any, spec: str = "", pct: bool = False) -> str:
    """The first finite number among ``candidates``, formatted: with ``spec`` (counts and
    seconds), as a percentage, or else with ``number`` (outputs/numbers.py); "n/a" when there
    is none."""
    v = next((v for v in map(num, candidates) if v is not None), None)
    if v is None:
        return "n/a"
    if pct:
        return f"{as_percent([v])[0]:.2f}%"
    return format(v, spec) if spec else number(v)


def _span(times: list[float]) -> float | None:
    """Wall-clock seconds covered by the metrics rows (their "time" is a Unix timestamp)."""
    return max(times) - min(times) if len(times) > 1 else None


def _resumes(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(RunDir(run_dir).log("events")) if e.get("event") == "resume"]


def _used_rows(cfg: dict) -> list[tuple[str, Any]]:
    """data, model and optimizer as the run used them (config.yaml's ``used:`` block), falling
    back to the config's names for runs recorded before that block existed."""
    used = cfg.get("used")
    used = used if isinstance(used, dict) else {}
    model, data = used.get("model") or {}, used.get("data") or {}
    model_s = get_dotted(cfg, "model.name")
    if model.get("class"):
        model_s = f"{model_s} ({model['class']}, {model.get('parameters', 0):,} parameters)" \
            if used.get("source") == "config" else \
            f"{model['class']} ({model.get('parameters', 0):,} parameters)"
    data_s = get_dotted(cfg, "data.name")
    if data:
        cap = num(get_dotted(cfg, "eval.max_batches"))
        sizes = ", ".join(_split_size(k, v, int(cap or 0)) for k, v in data.items()
                          if isinstance(v, dict))
        kind = data_s if used.get("source") == "config" else \
            (data.get("train") or {}).get("type", data_s)
        data_s = f"{kind} ({sizes})"
    rows = [("data", data_s), ("model", model_s)]
    if used.get("optimizer"):
        rows.append(("optimizer", used["optimizer"] + (f" + {used['scheduler']}"
                                                        if used.get("scheduler") else "")))
    return rows


def _split_size(name: str, split: dict, max_batches: int) -> str:
    """``1,438 train``; a validation split under eval.max_batches is the fixed subset every
    evaluation reads (data/source.py's eval_subset), and says so: ``240 val evaluated
    (eval.max_batches=20)``, not the split's own size; a stream without a length, its name."""
    size = split.get("size")
    text = f"{size:,} {name}" if isinstance(size, int) else f"{name} (no length)"
    if name.startswith("val") and max_batches > 0:
        text += f" evaluated (eval.max_batches={max_batches})"
    return text


def _epochs_done(epochs: list[dict], metrics: list[dict]) -> str:
    """Epochs completed (epochs.jsonl's lines), and the epoch the run ended in when it ended
    inside one (a max_steps run), so a run of 2,000 steps in its first epoch does not read
    "epochs 0"."""
    done = len(epochs)
    last = int(max(values_of(metrics, "epoch"), default=0))
    return f"{done} complete; ended inside epoch {last}" if last > done else str(done)


def _averaged_words(evals: list[dict]) -> str | None:
    """The last evaluation that ran the averaged weights, in words (outputs/averaged.py)."""
    last = last_compared(evals)
    if last is None:
        return None
    row, found = last
    return f"{found.words()} at the last evaluation (step {row.get('step')})"


def summary(run_dir: Path | str) -> tuple[list[tuple[str, Any]], list[str]]:
    """(rows, notes): names, epochs, steps, accuracies, speed, clipping, resumes, time; and
    what could not be read."""
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    cfg, cfg_note = load_mapping(rd.config)
    res, res_note = load_mapping(rd.results)
    metrics = continuous(read_jsonl(rd.log("metrics")))
    epochs = continuous(read_jsonl(rd.log("epochs")), "epoch")
    evals = continuous(read_jsonl(rd.log("evals")))
    accs, speeds = values_of(epochs, "val_acc"), values_of(metrics, "samples_per_s")
    if not accs:  # a step-based run: its evaluations are in evals.jsonl only
        accs = values_of(evals, "val_acc")
    frac = clipped_fraction(metrics, get_dotted(cfg, "clip.max_norm"))
    tokens = values_of(metrics, "tokens_per_s")
    # A run that max_steps ends inside its first epoch has no epoch line: its time is the
    # training seconds plus the validation the time split counted.
    split = res.get("time_split")
    split = split if isinstance(split, dict) else {}
    seconds = res.get("seconds") or (num(res.get("train_seconds")) or 0) + \
        (num(split.get("validation")) or 0) or None
    table = [
        *_used_rows(cfg),
        ("schedule", get_dotted(cfg, "schedule.name")), ("epochs", _epochs_done(epochs, metrics)),
        ("evaluations", len(evals)),
        ("optimizer steps", _fmt(res.get("steps"), *values_of(metrics, "step")[-1:], spec=".0f")),
        ("best val acc", _fmt(res.get("best_val_acc"), max(accs, default=None), pct=True)),
        ("final val acc", _fmt(*accs[-1:], pct=True)),
        ("test acc", _fmt(res.get("test_acc"), pct=True)),
        ("test loss", _fmt(res.get("test_loss"))),
        ("final val loss", _fmt(*values_of(evals, "val_loss")[-1:])),
        ("final val ppl", _fmt(*values_of(evals, "val_ppl")[-1:])),
        ("averaged weights", _averaged_words(evals)),
        ("mean samples/s", _fmt(sum(speeds) / len(speeds) if speeds else None)),
        ("mean tokens/s", _fmt(sum(tokens) / len(tokens) if tokens else None)),
        ("clipped fraction", "n/a" if frac is None else f"{frac:.1%}"),
        ("resumes", len(_resumes(run_dir))),
        ("total seconds", _fmt(seconds, _span(values_of(metrics, "time")), spec=".1f")),
        ("training seconds", _fmt(res.get("train_seconds"), spec=".1f")),
    ]
    table += [(key.replace("_", " "), res[key]) for key in  # the guard's totals, when non-zero
              ("bad_steps", "rollbacks", "skipped_samples") if res.get(key)]
    optional = ("test", "final val", "mean tokens", "averaged")  # most runs do not have these
    rows = [(k, "n/a" if v is None else v) for k, v in table
            if not (k.startswith(optional) and v in (None, "n/a"))]
    notes = [n for n in (cfg_note, res_note and f"{res_note}: the run did not finish") if n]
    return rows, notes


def summarize(run_dir: Path | str) -> str:
    """A short markdown table: names, epochs, steps, accuracies, speed, clipping, resumes, time."""
    rows, notes = summary(run_dir)
    lines = [f"# Run report: {Path(run_dir).name}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines + [""] + [f"> note: {n}" for n in notes]).rstrip() + "\n"


def render_report(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write the PNGs and report.md for one run directory; return the written paths."""
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else rd / REPORT
    raw = read_jsonl(rd.log("metrics"))
    if not raw:
        raise UserError(f"{run_dir} has no metrics.jsonl: is it an ironloop run directory? "
                        "Pass the run.dir of a training run")
    epochs, resumes = read_jsonl(rd.log("epochs")), _resumes(run_dir)
    evals = continuous(read_jsonl(rd.log("evals")))
    cfg = load_mapping(rd.config)[0]
    max_norm = get_dotted(cfg, "clip.max_norm")
    metrics, name = continuous(raw), run_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_loss_curves({name: metrics}, out_dir / "loss.png", title=f"Training loss: {name}"),
        plot_accuracy(epochs, out_dir / "accuracy.png") if continuous(epochs, "epoch") or \
        not evals else plot_validation(evals, out_dir / "validation.png"),
        plot_lr({name: metrics}, out_dir / "lr.png"),
        plot_grad_norm(metrics, max_norm, out_dir / "grad_norm.png"),
        plot_grad_norm_hist(metrics, max_norm, out_dir / "grad_norm_hist.png"),
    ]
    if averaged_pairs(evals):  # average.kind: the raw and the averaged weights' curves
        paths.append(plot_averaged(evals, out_dir / "averaged.png"))
    if resumes:
        # The loop truncates the logs to the checkpoint on resume, but each resume event
        # records the last step the killed process logged; older logs show step resets.
        crashes = [e["last_logged_step"] for e in resumes
                   if (num(e.get("last_logged_step")) or 0) > (num(e.get("step")) or 0)]
        knob = num(get_dotted(cfg, "fault.crash_at_step")) or 0
        crashes = crashes or crash_steps(raw) or ([int(knob)] if knob > 0 else [])
        paths.append(plot_resume_curve(raw, epochs, out_dir / "resume.png", resumes, crashes))
    report = out_dir / "report.md"
    from ironloop.tools.doctor.logs import diagnose_logs, markdown

    found = diagnose_logs(run_dir)
    md = [summarize(run_dir), markdown(found)]
    md += [f"![{p.stem}]({p.name})\n" for p in paths]
    report.write_text("\n".join(md), encoding="utf-8")
    return [*paths, report, write_html(run_dir, found, paths, out_dir / "report.html")]


def write_html(run_dir: Path, found: list, images: list[Path], out: Path) -> Path:
    """report.html: report.md's content in one self-contained page (tools/html.py)."""
    from ironloop.tools.html import Page

    rows, notes = summary(run_dir)
    page = Page(f"Run report: {run_dir.name}").table(["", ""], [list(r) for r in rows])
    for n in notes:
        page.note(f"note: {n}")
    page.h2("Diagnosis")
    if not found:
        page.p("Nothing in the logs calls for attention.")
    page.items([(f"{f.severity} ({f.check}):", f"{f.measured}." +
                 (f" Likely cause: {f.cause}." if f.cause else "") +  # an info has neither
                 (f" Fix: {f.fix}." if f.fix else "")) for f in found])
    for path in images:
        page.image(path)
    return page.write(out)
