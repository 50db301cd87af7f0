"""What ``ironloop tune`` shows and writes: the progress bar, the two tables, tune.json and
tuned.yaml (the user's config with the chosen overrides, which ``ironloop train`` takes as is)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from ironloop.config import Config
from ironloop.engine.precision import resolve_device
from ironloop.errors import option, speaks_python
from ironloop.state.io import write_atomic
from ironloop.state.prepare import unwritable
from ironloop.state.run_dir import TUNE, TUNED

PART_ORDER = ("data", "copy", "forward", "backward", "optimizer", "checkpoint", "validation",
              "other")


class _Bar:
    """A tqdm bar over the budget's seconds; its description names the trial running."""

    def __init__(self, bar: tqdm, budget: float):
        self.bar, self.budget, self.started = bar, budget, time.perf_counter()

    def set_description(self, text: str) -> None:
        self.bar.set_description(f"tune: {text}")

    def update(self, _rows: int) -> None:
        done = min(self.budget, time.perf_counter() - self.started)
        self.bar.update(done - self.bar.n)


@contextlib.contextmanager
def progress_bar(mode: str, budget: float):
    """On a terminal (log.progress=auto) or with log.progress=on; closed whatever happens."""
    show = mode == "on" or (mode == "auto" and sys.stderr.isatty())
    bar = tqdm(total=round(budget), disable=not show, leave=False, unit="s",
               bar_format="{desc} {bar} {n:.0f}/{total:.0f} s budget", dynamic_ncols=True)
    try:
        yield _Bar(bar, budget)
    finally:
        bar.close()


def tokens_per_sample(train) -> int | None:
    """Tokens in one sample when the inputs are 1-D integer sequences (a language model)."""
    data = train.dataset if isinstance(train, torch.utils.data.DataLoader) else train
    try:
        if isinstance(data, (tuple, list)):
            x = data[0][0]
        else:
            sample = data[0]
            x = sample.get("input_ids") if isinstance(sample, dict) else \
                sample[0] if isinstance(sample, (tuple, list)) else sample
    except Exception:  # noqa: BLE001 - the dataset's own error shows in the trials
        return None
    if isinstance(x, torch.Tensor) and x.ndim == 1 and not x.is_floating_point() \
            and x.dtype != torch.bool:
        return x.numel()
    return None


def context(subject, tuner, budget: float, path: Path | None, overrides: list[str]) -> dict:
    cfg = subject.cfg
    return {"config": str(path) if path else None, "overrides": list(overrides),
            "device": str(resolve_device(cfg.run.device)), "torch": torch.__version__,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "budget_s": budget, "used_s": round(time.perf_counter() - tuner.started, 1),
            "epochs": cfg.train.epochs, "max_steps": cfg.train.max_steps,
            "train_samples": subject.samples, "planned_samples": tuner.samples,
            "tokens_per_sample": tokens_per_sample(subject.train),
            "plan": {"warmup_steps": tuner.plan.warmup, "window_steps": tuner.plan.window,
                     "windows": tuner.plan.repeats, "measure_s": round(tuner.plan.measure_s, 3),
                     "pairs": tuner.pairs, "trial_estimate_s": round(tuner.est_s, 2)}}


# -- the terminal -------------------------------------------------------------------------------


def duration(seconds: float | None) -> str:
    """72 h, 4.0 h, 13 min, 45 s."""
    if seconds is None:
        return "-"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _row_line(row) -> str:
    m = row.measure
    if m is None:
        figures = f"{'-':>10}  {'':<15}{'':>7}{'-':>10}"
        verdict = f"{row.status}: {row.reason}"
    else:
        lo, hi = m.spread
        figures = (f"{m.samples_per_s:>10,.0f}  {f'{lo:,.0f}-{hi:,.0f}':<15}"
                   f"{row.ratio:>7.2f}{duration(row.projected_s):>10}")
        verdict = row.verdict + (f" ({row.note})" if row.note else "")
    return f"  {row.setting:<44}{figures}   {verdict}"


def table(result) -> str:
    """The terminal report: baseline, both tables, and the projected run time."""
    info, base = result.info, result.baseline
    m = base.measure
    tokens = info.get("tokens_per_sample")
    lines = [f"ironloop tune{' ' + info['config'] if info['config'] else ''}: "
             f"{info['device']}, {info['cpus']} CPU cores, "
             f"load {' '.join(map(str, info['load_average']))}, "
             f"budget {info['budget_s']:.0f} s, used {info['used_s']:.0f} s",
             f"baseline: {m.samples_per_s:,.0f} samples/s"
             + (f" ({m.samples_per_s * tokens:,.0f} tokens/s)" if tokens else "")
             + f", {m.step_ms:.2f} ms/step; peak memory {m.peak_mb:,.0f} MB"
             + (" (CUDA allocated)" if torch.cuda.is_available() else " (process RSS)")]
    if m.time_split:
        whole = sum(m.time_split.values()) or 1.0
        parts = [f"{p} {100 * m.time_split[p] / whole:.0f}%" for p in PART_ORDER
                 if m.time_split.get(p, 0.0) / whole >= 0.005]
        lines.append(f"  time split: {', '.join(parts)}")
    head = (f"  {'setting':<44}{'samples/s':>10}  {'spread':<15}{'x base':>7}{'run time':>10}"
            f"   verdict")
    for kind, title in (("free", "settings that cannot change the trajectory (tune applies "
                                 "the chosen ones):"),
                        ("trajectory", f"settings that change the trajectory (reported; "
                                       f"{option('apply_trajectory_changes')} applies the "
                                       f"winners):")):
        rows = [r for r in result.rows if r.kind == kind]
        if rows or kind == "free":
            lines += ["", title, head, *([_row_line(base)] if kind == "free" else []),
                      *map(_row_line, rows)]
    what = (f"{info['max_steps']} steps" if info["max_steps"] and
            info["planned_samples"] < info["epochs"] * info["train_samples"]
            else f"{info['epochs']} epochs of {info['train_samples']:,} samples")
    tuned = base.projected_s / result.speedup
    lines += ["", f"run time at {what} (training only): {duration(base.projected_s)} -> "
              f"{duration(tuned)} ({result.speedup:.2f}x)"]
    pairs = result.info.get("plan", {}).get("pairs", 4)
    unconfirmed = [r.setting for r in result.rows if r.kind == "free" and r.pairs
                   and len(r.pairs["ratios"]) < pairs and all(x > 1.0 for x in r.pairs["ratios"])]
    if not result.chosen and unconfirmed:
        lines.append(f"the budget ran out during the paired runs of {', '.join(unconfirmed)} "
                     f"(faster in every pair measured): tuned.yaml is the input config; rerun "
                     f"with a larger {'budget=' if speaks_python() else '--budget'} to confirm "
                     f"them")
    elif not result.chosen:
        lines.append("no trajectory-free setting was faster beyond the noise (faster in "
                     "every paired run, median more than 5%): tuned.yaml is the input config")
    return "\n".join(lines)


# -- the files ----------------------------------------------------------------------------------


def _set(raw: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _differs(raw: dict, default: dict) -> dict:
    """The keys of ``raw`` (a Config's to_dict) whose value is not the default's, by section."""
    out = {}
    for section, keys in raw.items():
        changed = {k: v for k, v in keys.items() if v != default[section][k]}
        if changed:
            out[section] = changed
    return out


def tuned_yaml(cfg: Config, path: Path | None, overrides: list[str], applied: dict,
               tuned: str = "model on train_data") -> str:
    """The user's config with the chosen overrides: the input file verbatim when nothing
    changes, else its keys (plus the command line's overrides) with the chosen ones set.

    From ``ironloop.tune()`` (``path`` None) the config was a Python object: the file holds
    the keys that differ from the defaults (so no data or model section the run never used),
    and its header names what was tuned (``tuned``: the model's class and the training data's
    size) and how to pass the file to ``fit()``."""
    if path is not None and not overrides and not applied:
        return path.read_text()
    if path is None:
        raw = _differs(cfg.to_dict(), Config().to_dict())
        header = [f"# from ironloop.tune() of {tuned}: the config's keys that differ from "
                  f"the defaults, with the chosen ones"]
        use = [f"# use it: ironloop.fit(model, train_data, config=ironloop.load_config("
               f"{str(Path(cfg.run.dir) / TUNED)!r}))"]
    else:
        raw = yaml.safe_load(path.read_text()) or {}
        for item in overrides:
            key, text = item.split("=", 1)
            _set(raw, key.strip(), yaml.safe_load(text) if text.strip() else "")
        header = [f"# ironloop tune {path} {' '.join(overrides)}".rstrip()]
        use = []
    for key, value in applied.items():
        _set(raw, key, value)
    header += [f"#   {k}: {v!r}" for k, v in applied.items()] or ["#   (no change)"]
    text = "\n".join(header + use) + "\n" + (yaml.safe_dump(raw, sort_keys=False) if raw else "")
    expected = cfg.with_overrides(applied).to_dict()
    assert Config.from_dict(yaml.safe_load(text)).to_dict() == expected, "tuned.yaml round trip"
    return text


def write(result, cfg: Config, path: Path | None, overrides: list[str], applied: dict,
          tuned: str = "model on train_data") -> None:
    """tune.json and tuned.yaml in run.dir, then the table and what to run next: from Python
    (``path`` None), how to pass the tuned config to fit()."""
    run_dir = Path(cfg.run.dir)
    doc = {"info": result.info, "baseline": result.baseline.to_dict(),
           "trials": [r.to_dict() for r in result.rows], "chosen": result.chosen,
           "trajectory_winners": result.trajectory,
           "applied_trajectory_changes": result.applied_trajectory,
           "speedup": round(result.speedup, 4)}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / TUNE, json.dumps(doc, indent=2) + "\n")
        write_atomic(run_dir / TUNED, tuned_yaml(cfg, path, overrides, applied, tuned))
    except OSError as e:
        raise unwritable(run_dir, e) from e
    result.paths = {TUNE: run_dir / TUNE, TUNED: run_dir / TUNED}
    print(table(result))
    if result.applied_trajectory:
        for key, value in result.trajectory.items():
            print(f"notice: {option('apply_trajectory_changes')}: {key}: "
                  f"{_get(cfg, key)!r} -> {value!r} changes the training trajectory")
    elif result.trajectory:
        flat = " ".join(f"{k}={v}" for k, v in result.trajectory.items())
        print(f"the second table's winners change the trajectory and were not applied: "
              f"{flat} ({option('apply_trajectory_changes')} applies them)")
    use = (f"ironloop.fit(model, train_data, config=result.config), or config="
           f"ironloop.load_config({str(run_dir / TUNED)!r})" if path is None else
           f"ironloop train {run_dir / 'tuned.yaml'}")
    print(f"wrote {run_dir / 'tune.json'} and {run_dir / 'tuned.yaml'}; train with: {use}")


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".", 1)
    return cfg.to_dict()[section][key]
