"""``ironloop lab``: the toy script turned into a production loop, one measured step at a time.

The steps are cumulative, as in the original lab: each one keeps everything before it and adds
one thing, with the same seed and data, so each row of the report shows what that one thing did.
Step 7 runs as real processes, because its crash is a real ``os._exit(1)``.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from ironloop.config import Config, load_config
from ironloop.errors import UserError
from ironloop.outputs.readers import read_jsonl
from ironloop.state.checkpointer import Checkpointer
from ironloop.state.run_dir import RunDir
from ironloop.tools.html import Page
from ironloop.tools.lab import reference as lab_reference, verdicts as judge
from ironloop.tools.lab.clock import Clock
from ironloop.tools.plots import (
    clipped_fraction,
    coinciding,
    plot_grad_norm_hist,
    plot_loss_curves,
    plot_lr,
    plot_resume_curve,
)
from ironloop.tools.recipe import train_config

MODEL = {"digits": "small_cnn", "fashion-mnist": "small_cnn", "mnist1d": "cnn1d",
         "synthetic": "mlp"}
#: Fashion-MNIST on 2 CPU cores: 4/8 channels train an epoch (48,000 samples) in 4.1 s in fp32
#: here, against 6.3 s for 8/16 (~3,350 samples/s for the default 32/64). With 8/16 the whole
#: lab took 594 s of its 600 s budget on a quiet machine; 4/8 leaves room.
MODEL_KWARGS = {"fashion-mnist": {"channels": [4, 8]}}
#: Steps of the stretch precision a CPU only emulates (fp16): enough to measure its speed.
EMULATED_STEPS = 4
#: Every lab dataset has 10 classes (chance is 10%).
NUM_CLASSES = 10


@dataclass
class Variant:
    name: str
    title: str
    overrides: dict
    run_dir: Path = Path()
    notes: dict = field(default_factory=dict)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def epochs(self) -> list[dict]:
        return read_jsonl(self.run_dir / "epochs.jsonl")

    def results(self) -> dict:
        return json.loads((self.run_dir / "results.json").read_text())


def amp_precision() -> str:
    """bf16 where the hardware supports it (any CPU, Ampere+ GPUs), else fp16 + GradScaler."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"


def steps_plan(data: str) -> list[Variant]:
    """The seven cumulative steps, then the two stretch comparisons."""
    base = {"data.name": data, "model.name": MODEL.get(data, "mlp"),
            "model.kwargs": MODEL_KWARGS.get(data, {}), "train.epochs": 5,
            "train.batch_size": 64, "optim.name": "adamw", "optim.lr": 1e-3,
            "schedule.name": "constant", "clip.max_norm": 0.0, "checkpoint.enabled": False,
            "early_stop.metric": "val_acc", "log.every_steps": 1, "log.progress": "off",
            "doctor.preflight": False}
    steps: list[tuple[str, str, dict]] = [
             ("1-baseline", "Baseline: AdamW, lr 1e-3, 5 epochs", {}),
             ("2-onecycle", "Scheduler: OneCycleLR, max_lr 3e-3",
              {"schedule.name": "onecycle", "schedule.max_lr": 3e-3}),
             ("3-clip", "Clipping at 1.0, pre-clip norm logged every step",
              {"clip.max_norm": 1.0}),
             ("4-accum", "Accumulation: physical batch 32 x 4",
              {"train.batch_size": 32, "train.accumulation_steps": 4}),
             ("5-amp", f"AMP: {amp_precision()} autocast", {"train.precision": amp_precision()}),
             ("6-checkpoint", "Checkpointing: last every 100 steps, best on val acc",
              {"checkpoint.enabled": True, "checkpoint.every_steps": 100}),
             ("7-crash-resume", "Crash in epoch 3, then --resume", {})]
    variants, acc = [], dict(base)
    for name, title, extra in steps:
        acc = {**acc, **extra}
        variants.append(Variant(name, title, dict(acc)))
    # The preflight checks the model and data, which every step shares: it runs once, in step 1.
    variants[0].overrides["doctor.preflight"] = True
    if emulated(amp_precision()):
        # A CPU without native bf16 (no AVX512-BF16 or AMX) emulates it, at several times fp32's
        # cost: step 5 measures that, and the steps after it keep fp32 (their criteria do not
        # depend on the precision) so the lab stays in its budget. The report says so.
        for v in variants[5:]:
            v.overrides["train.precision"] = "fp32"
            v.title += f" (fp32: this CPU emulates {amp_precision()})"
    full = variants[5].overrides
    variants.append(Variant("8-decay-all", "Stretch: weight decay on biases and norms too",
                            {**full, "optim.decay_bias_and_norm": True}))
    other = "fp16" if amp_precision() == "bf16" else "bf16"
    # CPUs emulate fp16 autocast, many times slower than bf16 (seconds a step where bf16 takes
    # milliseconds): there a handful of steps shows the throughput; a whole run would take
    # the lab's whole budget and show nothing more.
    short = {"train.max_steps": EMULATED_STEPS} if emulated(other) else {}
    variants.append(Variant("9-" + other, f"Stretch: {other} instead of {amp_precision()}"
                            + (f", {EMULATED_STEPS} steps (emulated here)" if short else ""),
                            {**full, "train.precision": other, **short}))
    return variants


def emulated(precision: str) -> bool:
    """A precision this machine only emulates: fp16 on any CPU, bf16 on a CPU without native
    bf16 instructions."""
    if torch.cuda.is_available() or precision == "fp32":
        return False
    return precision == "fp16" or not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _cfg(overrides: dict, run_dir: Path, root: str) -> Config:
    return load_config(None, []).with_overrides({**overrides, "run.dir": str(run_dir),
                                                 "data.root": root})


def run_lab(data: str, out: Path, root: str = "data", overwrite: bool = False) -> Path:
    """Run every step into ``out`` and write report.md, report.html and the plots."""
    if (out / "report.md").exists() and not overwrite:
        raise UserError(f"{out} already holds a lab report; pass --overwrite to replace it, "
                        f"or choose another --out")
    variants = steps_plan(data)
    if overwrite:
        for path in [out / v.name for v in variants] + [out / "7-crash-resume.yaml",
                                                        out / "accum-check", out / CLIP_COMPARE,
                                                        out / "reference"]:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(True)
    out.mkdir(parents=True, exist_ok=True)
    extras, clock = [], Clock()
    for v in variants:
        v.run_dir = out / v.name
        print(f"[lab] {v.name}: {v.title}", flush=True)
        with clock.part(v.name):
            if v.name == "7-crash-resume":
                crash_and_resume(v, out, root)
            else:
                train_config(_cfg(v.overrides, v.run_dir, root))
        if v.name == "3-clip":
            with clock.part(CLIP_COMPARE + " (if clipping fails)"):
                extras += clip_comparison(v, out, root)
    with clock.part("accumulation check"):
        variants[3].notes.update(accumulation_check(variants[3], out, root))
    variants[6].notes["bit_identical"] = _same_weights(variants[5].run_dir, variants[6].run_dir)
    reference = None
    if lab_reference.available():
        print("[lab] reference: examples/production_loop.py and its Accelerate version, with "
              "step 6's config", flush=True)
        with clock.part("reference scripts"):
            reference = lab_reference.run_references(
                _cfg(variants[5].overrides, out / "reference", root), out / "reference")
    with clock.part("plots and report"):
        plots = draw(variants, out)
        report = write_reports(variants, extras, out, plots, data, reference, clock)
    return report


CLIP_COMPARE = "3b-clip-p95"


def clip_comparison(v: Variant, out: Path, root: str) -> list[Variant]:
    """When step 3 clips too often in steady state, rerun it with max_norm at the steady-state
    p95 of its pre-clip norm, so the report can show what that threshold does."""
    stats = judge.clip_stats(v.metrics(), v.overrides["clip.max_norm"])
    v.notes["clip"] = stats
    if stats["steady"] < judge.CLIP_LIMIT:
        return []
    threshold = judge.suggested_max_norm(stats)
    c = Variant(CLIP_COMPARE, f"Comparison: step 3 with clipping at {threshold:g}",
                {**v.overrides, "clip.max_norm": threshold}, out / CLIP_COMPARE)
    print(f"[lab] {c.name}: {c.title}", flush=True)
    train_config(_cfg(c.overrides, c.run_dir, root))
    v.notes["compare"] = {**judge.clip_stats(c.metrics(), threshold),
                          "acc": c.epochs()[-1]["val_acc"]}
    return [c]


def crash_and_resume(v: Variant, out: Path, root: str) -> None:
    """Crash with os._exit(1) in epoch 3 in a real process, then resume in another."""
    cfg = _cfg(v.overrides, v.run_dir, root)
    probe = _cfg({**v.overrides, "train.epochs": 1}, v.run_dir, root)
    spe = steps_per_epoch(probe)
    crash = 2 * spe + spe // 2
    v.notes.update(crash_step=crash, steps_per_epoch=spe)
    path = out / "7-crash-resume.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    cmd = [sys.executable, "-m", "ironloop", "train", str(path)]
    first = subprocess.run([*cmd, f"fault.crash_at_step={crash}"], capture_output=True,
                           text=True)
    if first.returncode != 1:
        raise RuntimeError(f"the crash run should exit 1, got {first.returncode}: "
                           f"{first.stderr[-2000:]}")
    second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True)
    if second.returncode != 0:
        raise RuntimeError(f"the resumed run failed: {second.stderr[-2000:]}")
    events = [e for e in read_jsonl(v.run_dir / "events.jsonl") if e.get("event") == "resume"]
    v.notes["resumed_from"] = events[-1]["step"]


def steps_per_epoch(cfg: Config) -> int:
    from ironloop.data import build_data

    n = len(build_data(cfg.data).train)
    return math.ceil(n / (cfg.train.batch_size * cfg.train.accumulation_steps))


def accumulation_check(v: Variant, out: Path, root: str) -> dict:
    """Is the loss scaled by samples? One optimizer step through fit() on a full window
    (128 = 32 x 4) and on a ragged one (100 = 32 + 32 + 32 + 4) must give the weights that one
    batch of the same samples gives. (Over hundreds of Adam steps, fp32 rounding differences
    between the two summation orders grow, so one step is the sharp test; the 64 x 1 vs 16 x 4
    equivalence over whole epochs is in the test suite.)"""
    from ironloop.data import TensorData, build_data
    from ironloop.tools.models import model_for
    from ironloop.tools.recipe import fit_without_preflight as fit

    cfg = _cfg({**v.overrides, "train.epochs": 1, "schedule.name": "constant",
                "checkpoint.enabled": False}, out / "accum-check", root)
    bundle = build_data(cfg.data)
    diffs = {}
    for n in (128, 100):
        subset = TensorData(bundle.train.x[:n], bundle.train.y[:n])
        weights = []
        for batch, accum in ((32, 4), (n, 1)):
            model = model_for(cfg, bundle)  # seeded: both runs start from the same weights
            fit(model, subset, None, cfg.with_overrides({
                "run.dir": str(out / "accum-check" / f"n{n}-{batch}x{accum}"),
                "train.batch_size": batch, "train.accumulation_steps": accum}))
            weights.append(model.state_dict())
        diffs[n] = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    expected = steps_per_epoch(_cfg(v.overrides, v.run_dir, root)) * v.overrides["train.epochs"]
    return {"full_window_diff": diffs[128], "ragged_window_diff": diffs[100],
            "expected_steps": expected}


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "final.safetensors"), load_file(b / "final.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def draw(variants: list[Variant], out: Path) -> dict[str, Path]:
    by = {v.name: v for v in variants}
    crash = by["7-crash-resume"]
    resumes = [e for e in read_jsonl(crash.run_dir / "events.jsonl") if e.get("event") == "resume"]
    curves = {v.name: _with_epochs(v, variants[5]) for v in variants}
    return {
        "lr.png": plot_lr({"1-baseline (constant)": by["1-baseline"].metrics(),
                           "2-onecycle": by["2-onecycle"].metrics()}, out / "lr.png"),
        "grad_norm_hist.png": plot_grad_norm_hist(by["3-clip"].metrics(), 1.0,
                                                  out / "grad_norm_hist.png"),
        "resume_curve.png": plot_resume_curve(crash.metrics(), crash.epochs(),
                                              out / "resume_curve.png", resumes,
                                              crash.notes["crash_step"]),
        "loss_curves.png": plot_loss_curves(curves, out / "loss_curves.png", x="epochs",
                                            xlabel="epochs of data seen",
                                            title="Training loss, every lab variant"),
    }


def _with_epochs(v: Variant, like: Variant) -> list[dict]:
    """Metrics rows with x = epochs of data seen: steps are not comparable across variants
    whose optimizer steps cover different numbers of samples (accumulation). A variant stopped
    inside its first epoch (the emulated precision) has the steps per epoch of step 6, ``like``,
    whose config it extends."""
    per_epoch = (v.epochs() or like.epochs())[0]["step"]
    return [{**m, "epochs": m["step"] / per_epoch} for m in v.metrics()]


def summary_row(v: Variant) -> dict:
    """A variant's row; one that train.max_steps stopped inside its first epoch (the emulated
    precision) has no epoch line, and gives its logged steps' speed and its final val acc."""
    epochs, metrics = v.epochs(), v.metrics()
    clipped = clipped_fraction(metrics, v.overrides["clip.max_norm"]) \
        if v.overrides["clip.max_norm"] > 0 else None
    if not epochs:
        speeds = [m["samples_per_s"] for m in metrics[1:] or metrics]  # step 1 warms up
        res = v.results()
        return {"variant": v.name, "final val acc": res.get("final_val_acc"), "s/epoch": None,
                "s/epoch spread": None, "samples/s": statistics.median(speeds),
                "optimizer steps": res["steps"], "clipped": clipped}
    secs = [e["seconds"] for e in epochs]
    return {"variant": v.name, "final val acc": epochs[-1].get("val_acc"),
            "s/epoch": statistics.median(secs), "s/epoch spread": (min(secs), max(secs)),
            "samples/s": statistics.median(e["samples_per_s"] for e in epochs),
            "optimizer steps": epochs[-1]["step"], "clipped": clipped}


def findings(variants: list[Variant], rows: list[dict], under: str) -> dict[str, str]:
    """One sentence per step, computed from what the runs logged; timing comparisons say the
    conditions they were measured ``under`` (cores and load)."""
    by, row = {v.name: v for v in variants}, {r["variant"]: r for r in rows}
    acc = {k: r["final val acc"] for k, r in row.items()}
    lrs = [m["lr"] for m in by["2-onecycle"].metrics()]
    peak = lrs.index(max(lrs))
    norms = sorted(m["grad_norm"] for m in by["3-clip"].metrics())
    acc_notes, crash = by["4-accum"].notes, by["7-crash-resume"].notes
    speed4, speed5 = row["4-accum"]["samples/s"], row["5-amp"]["samples/s"]
    # Checkpointing's cost against the step before with the same precision (see steps_plan).
    same = "5-amp" if by["5-amp"].overrides["train.precision"] == \
        by["6-checkpoint"].overrides["train.precision"] else "4-accum"
    secs5, secs6 = row[same]["s/epoch"], row["6-checkpoint"]["s/epoch"]
    ckpts = sorted(p.name for p in RunDir(by["6-checkpoint"].run_dir).checkpoints.glob("*.pt"))
    s = {
        "1-baseline": f"val acc {acc['1-baseline']:.2%} after 5 epochs; epochs took "
                      + ", ".join(f"{e['seconds']:.2f}" for e in by["1-baseline"].epochs())
                      + " s.",
        "2-onecycle": f"the LR rose from {lrs[0]:.1e} to {max(lrs):.1e} at step {peak + 1} of "
                      f"{len(lrs)}, then fell to {lrs[-1]:.1e} (lr.png); val acc "
                      f"{acc['2-onecycle']:.2%} ({acc['2-onecycle'] - acc['1-baseline']:+.2%}).",
        "3-clip": f"{row['3-clip']['clipped']:.1%} of optimizer steps were clipped; median "
                  f"pre-clip norm {statistics.median(norms):.2f}, max {norms[-1]:.2f} "
                  f"(grad_norm_hist.png).",
        "4-accum": f"{row['4-accum']['optimizer steps']} optimizer steps for "
                   f"{acc_notes['expected_steps']} expected (one per window of 4, ragged last "
                   f"window included); one step of 32 x 4 against one batch of 128 differs by "
                   f"{acc_notes['full_window_diff']:.1e}, and a ragged window of 32+32+32+4 "
                   f"against one batch of 100 by {acc_notes['ragged_window_diff']:.1e}: "
                   + ("the loss is scaled by sample counts, not by 1/4."
                      if max(acc_notes["full_window_diff"], acc_notes["ragged_window_diff"])
                      < 1e-5 else "THE LOSS IS NOT SCALED CORRECTLY."),
        "5-amp": f"throughput {speed5:,.0f} samples/s vs {speed4:,.0f} in fp32 "
                 f"(x{speed5 / speed4:.2f}, {under}); val acc {acc['5-amp']:.2%}."
                 + (" On CPU, bf16 autocast often costs more in casts than it saves."
                    if not torch.cuda.is_available() else ""),
        "6-checkpoint": f"wrote {', '.join(ckpts)}; median {secs6:.2f} s/epoch vs {secs5:.2f} "
                        f"without checkpoints (step {same[0]}; {under}).",
        "7-crash-resume": f"os._exit(1) right after step {crash['crash_step']} (epoch 3), "
                          f"resumed from step {crash['resumed_from']}; final weights "
                          f"{'bit-identical' if crash['bit_identical'] else 'DIFFERENT'} to "
                          f"step 6's uninterrupted run (resume_curve.png).",
    }
    decay = variants[7].name
    s[decay] = f"val acc {acc[decay]:.2%} vs {acc['6-checkpoint']:.2%} for step 6."
    prec, first = variants[8], by["6-checkpoint"].epochs()[0]
    speed, speed6 = row[prec.name]["samples/s"], row["6-checkpoint"]["samples/s"]
    s[prec.name] = (f"{speed:,.0f} samples/s vs {speed6:,.0f} for step 6 "
                    f"(x{speed / speed6:.2f}, {under}); ")
    if not prec.epochs():  # the CPU's emulated fp16: a handful of steps, see steps_plan
        s[prec.name] += (f"{row[prec.name]['optimizer steps']} steps only: a CPU emulates "
                         f"{prec.overrides['train.precision']} autocast, and a whole run would "
                         f"take minutes to show the same (on CUDA this step runs all 5 epochs).")
    else:
        s[prec.name] += (f"val acc {acc[prec.name]:.2%} after {len(prec.epochs())} epoch(s)"
                         + (f" (step 6 had {first['val_acc']:.2%} after its first)."
                            if len(prec.epochs()) == 1 else "."))
    return s


def _fmt(value, kind: str) -> str:
    if value is None:
        return "n/a"
    return {"pct": f"{value:.2%}", "s": f"{value:.2f}", "int": f"{value:,.0f}"}[kind]


def verdicts(variants: list[Variant], rows: list[dict],
             reference: dict | None) -> tuple[list[judge.LabVerdict], str]:
    """Each step against the spec's criterion, and the sentence on step 4's accuracy."""
    by, row = {v.name: v for v in variants}, {r["variant"]: r for r in rows}
    acc = {k: r["final val acc"] for k, r in row.items()}
    lrs = {k: [m["lr"] for m in by[k].metrics()] for k in ("2-onecycle", "3-clip", "4-accum")}
    clip, crash = by["3-clip"].notes, by["7-crash-resume"].notes
    found = Checkpointer(RunDir(by["6-checkpoint"].run_dir)).latest()
    state = found.state if found is not None else {}
    out = [judge.baseline(acc["1-baseline"], NUM_CLASSES),
           judge.lr_rises_then_falls(lrs["2-onecycle"]),
           judge.clipping(clip["clip"], acc["3-clip"], acc["2-onecycle"], clip.get("compare")),
           judge.accumulation(row["4-accum"]["optimizer steps"], by["4-accum"].notes),
           judge.amp(row["4-accum"]["samples/s"], row["5-amp"]["samples/s"], acc["4-accum"],
                     acc["5-amp"], by["5-amp"].overrides["train.precision"],
                     "cuda" if torch.cuda.is_available() else "cpu", state.get("scaler")),
           judge.checkpoint_keys(state)]
    spe, every = crash["steps_per_epoch"], by["6-checkpoint"].overrides["checkpoint.every_steps"]
    expected = max(spe * (crash["crash_step"] // spe), every * (crash["crash_step"] // every))
    # The resumed process drops log lines past its checkpoint, so its own first line is the
    # first one written after the resume event.
    resumed_at = [e for e in read_jsonl(by["7-crash-resume"].run_dir / "events.jsonl")
                  if e.get("event") == "resume"][-1]["time"]
    after = next((m["step"] for m in by["7-crash-resume"].metrics() if m["time"] >= resumed_at),
                 None)
    out.append(judge.resume(crash, after, expected,
                            [e["val_acc"] for e in by["7-crash-resume"].epochs()],
                            [e["val_acc"] for e in by["6-checkpoint"].epochs()]))
    if reference is not None:
        out.append(judge.reference(reference["plain"], reference["accel"], acc["6-checkpoint"],
                                   reference["diff_lines"]))
    o = by["4-accum"].overrides
    drop = judge.accumulation_drop(acc["3-clip"], acc["4-accum"], lrs["3-clip"],
                                   lrs["4-accum"], by["3-clip"].overrides["train.batch_size"],
                                   o["train.batch_size"] * o["train.accumulation_steps"])
    return out, drop


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in rows]


def _summary_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The report's first table: one line per variant."""
    header = ["variant", "final val acc", "s/epoch (min-max)", "samples/s", "optimizer steps",
              "clipped fraction"]
    table = [[r["variant"], _fmt(r["final val acc"], "pct"),
              "n/a (stopped mid-epoch)" if r["s/epoch"] is None else
              f"{r['s/epoch']:.2f} ({r['s/epoch spread'][0]:.2f}-{r['s/epoch spread'][1]:.2f})",
              _fmt(r["samples/s"], "int"), str(r["optimizer steps"]),
              _fmt(r["clipped"], "pct") if r["clipped"] is not None else "off"]
             for r in rows]
    return header, table


def _same_losses(variants: list[Variant]) -> str:
    """A sentence for each group of variants whose training losses coincide ('' when none)."""
    same = [names for names, _ in coinciding({v.name: _with_epochs(v, variants[5])
                                             for v in variants},
                                             "epochs", "loss") if len(names) > 1]
    return "".join(f" The training losses of {', '.join(n)} coincide at every step: "
                   f"loss_curves.png draws them once." for n in same)


def write_reports(variants: list[Variant], extras: list[Variant], out: Path,
                  plots: dict[str, Path], data: str, reference: dict | None,
                  clock: Clock) -> Path:
    under = clock.under()
    rows = [summary_row(v) for v in variants]
    said = findings(variants, rows, under)
    judged, drop = verdicts(variants, rows, reference)
    for v in judged:
        if v.step == "5-amp":  # a speed ratio is a measurement of this machine at this load
            v.figure += f" (speed measured on {under})"
    for c in extras:
        said[c.name] = (f"step 3 rerun with max_norm {c.overrides['clip.max_norm']:g}: val acc "
                        f"{c.epochs()[-1]['val_acc']:.2%} (step 3: "
                        f"{rows[2]['final val acc']:.2%}).")
    rows = rows[:3] + [summary_row(c) for c in extras] + rows[3:]
    shown = variants[:3] + extras + variants[3:]
    header, table = _summary_table(rows)
    vheader = ["step", "the spec's criterion", "result", "figure"]
    vtable = [[v.step, v.criterion, v.result, v.figure] for v in judged]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    intro = (f"Dataset `{data}`, device {device}, torch {torch.__version__}. Each step keeps "
             f"everything before it and adds one thing; same seed and data throughout. "
             f"Timings were measured on {under}: on a shared machine they compare only "
             f"within this report.")
    theader, trows = clock.table()
    timing = (f"Wall and CPU seconds of each part of this lab ({under}). CPU seconds include "
              f"step 7's crash and resume processes.")
    ref = None if reference is None else (
        f"`examples/production_loop.py` and `examples/production_loop_accelerate.py`, run with "
        f"step 6's config, initial weights and data order. {judged[-1].figure}. The line diff "
        f"({reference['diff_lines']} lines added or removed):")
    md = [f"# ironloop lab: {data}", "", intro, "", *_md_table(header, table),
          "", "## Each step against the spec's criterion", "", *_md_table(vheader, vtable),
          "", f"**Step 4's accuracy:** {drop}", "", "## What each step showed", ""]
    md += [f"- **{v.name}** ({v.title}): {said[v.name]}" for v in shown]
    if ref is not None and reference is not None:
        md += ["", "## The hand-written script and its Accelerate version", "", ref, "",
               "```diff", reference["diff"], "```"]
    md += ["", "## Where the lab's time went", "", timing, "", *_md_table(theader, trows)]
    same = _same_losses(variants)
    md += ["", f"Plots.{same}", "", *[f"![{name}]({name})" for name in plots]]
    (out / "report.md").write_text("\n".join(md) + "\n")
    page = Page(f"ironloop lab: {data}").p(intro).table(header, table)
    page.h2("Each step against the spec's criterion").table(vheader, vtable, "l", classed=2)
    page.p(drop, bold="Step 4's accuracy:").h2("What each step showed")
    page.items([(v.name, f"({v.title}): {said[v.name]}") for v in shown])
    if ref is not None and reference is not None:
        page.h2("The hand-written script and its Accelerate version").p(ref)
        page.pre(reference["diff"])
    page.h2("Where the lab's time went").p(timing).table(theader, trows)
    page.h2("Plots").p(same.strip() or "Every variant's training loss differs.")
    for path in plots.values():
        page.image(path)
    page.write(out / "report.html")
    return out / "report.md"
