"""The lab's verdicts: each step judged against the lab spec's own criterion, from what it logged.

Pure functions of logged rows and notes, so each verdict can be unit-tested without training.
A verdict is PASS or FAIL with the figure behind it; a stretch comparison has no verdict (None).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from itertools import pairwise

#: The spec's criterion for step 3.
CLIP_LIMIT = 0.05
#: What "steady state" means for step 3: every optimizer step after the first epoch.
STEADY = "every optimizer step after the first epoch"
#: What a checkpoint must hold (the spec's names) and where ironloop keeps each one.
REQUIRED_KEYS = {"model": "model", "optimizer": "optimizer", "scheduler": "scheduler",
                 "scaler": "scaler", "step": "progress.step", "rng_state": "rng"}


@dataclass
class LabVerdict:
    step: str
    criterion: str
    passed: bool | None  # None: a comparison with nothing to pass or fail
    figure: str

    @property
    def result(self) -> str:
        return {True: "PASS", False: "FAIL", None: "-"}[self.passed]


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def baseline(acc: float, num_classes: int) -> LabVerdict:
    chance = 1 / num_classes
    return LabVerdict("1-baseline", "the toy script trains: val acc far above chance",
                   acc > 3 * chance, f"val acc {acc:.2%} vs chance {chance:.0%}")


def lr_rises_then_falls(lrs: list[float]) -> LabVerdict:
    """The LR each optimizer step used (logged from the optimizer, as the scheduler set it)."""
    peak = lrs.index(max(lrs))
    rises = all(a <= b for a, b in pairwise(lrs[:peak + 1]))
    falls = all(a >= b for a, b in pairwise(lrs[peak:]))
    ok = 0 < peak < len(lrs) - 1 and rises and falls and lrs[0] < lrs[peak] > lrs[-1]
    return LabVerdict("2-onecycle", "the LR rises, then falls (read back per step)", ok,
                   f"{lrs[0]:.1e} -> {lrs[peak]:.1e} at step {peak + 1} of {len(lrs)} -> "
                   f"{lrs[-1]:.1e}; monotone up {'yes' if rises else 'NO'}, "
                   f"down {'yes' if falls else 'NO'}")


def clip_stats(rows: list[dict], max_norm: float) -> dict:
    """Clipped fractions (steady state and whole run) and the pre-clip norm distribution.

    ``rows`` are metrics.jsonl lines logged every step (grad_norm, clipped, lr, epoch)."""
    steady = [r for r in rows if r["epoch"] >= 2]
    first = [r for r in rows if r["epoch"] == 1]
    norms = [r["grad_norm"] for r in steady]
    peak = max(r["lr"] for r in rows)
    high = [r["grad_norm"] for r in steady if r["lr"] >= peak / 2]
    low = [r["grad_norm"] for r in steady if r["lr"] < peak / 2]
    return {"max_norm": max_norm, "steps": len(rows), "steady_steps": len(steady),
            "first_steady_step": steady[0]["step"] if steady else None,
            "steady": sum(r["grad_norm"] > max_norm for r in steady) / max(len(steady), 1),
            "whole": sum(r["grad_norm"] > max_norm for r in rows) / max(len(rows), 1),
            "median": statistics.median(norms) if norms else math.nan,
            "p95": _quantile(norms, 0.95) if norms else math.nan,
            "max": max(norms) if norms else math.nan,
            "first_epoch_median": statistics.median(r["grad_norm"] for r in first)
            if first else math.nan,
            "median_high_lr": statistics.median(high) if high else math.nan,
            "median_low_lr": statistics.median(low) if low else math.nan, "peak_lr": peak}


def suggested_max_norm(stats: dict) -> float:
    """The steady-state p95 of the pre-clip norm, rounded up to 2 significant digits: the
    smallest round threshold that leaves at least 95% of steady-state steps unclipped."""
    p95 = stats["p95"]
    scale = 10 ** (math.floor(math.log10(p95)) - 1)
    return math.ceil(p95 / scale) * scale


def clipping(stats: dict, acc_clip: float, acc_noclip: float, compare: dict | None) -> LabVerdict:
    s = stats
    figure = (f"{s['steady']:.1%} of the {s['steady_steps']} steady-state steps clipped "
              f"({s['whole']:.1%} of all {s['steps']}); steady pre-clip norm median "
              f"{s['median']:.2f}, p95 {s['p95']:.2f}, max {s['max']:.2f}")
    ok = s["steady"] < CLIP_LIMIT
    if not ok:
        figure += (f". Why: a pre-clip norm above {s['max_norm']:g} is not a rare spike but "
                   f"the typical value once training is under way (the first epoch's median "
                   f"was {s['first_epoch_median']:.2f}), and it grows with the LR: median "
                   f"{s['median_high_lr']:.2f} while the LR is at least half its "
                   f"{s['peak_lr']:.1e} peak, {s['median_low_lr']:.2f} below that. With AdamW, "
                   f"which divides each step by the gradient's running scale, clipping this "
                   f"often barely changes the run: val acc {acc_clip:.2%} clipped vs "
                   f"{acc_noclip:.2%} without")
    if compare:
        figure += (f". Clipping at {compare['max_norm']:g} (the steady-state p95, rounded up) "
                   f"clips {compare['steady']:.1%} in steady state ({compare['whole']:.1%} of "
                   f"all steps), val acc {compare['acc']:.2%}")
        if compare["steady"] < CLIP_LIMIT and compare["acc"] >= acc_clip - 0.005:
            figure += (f": max_norm {compare['max_norm']:g} meets the criterion with val "
                       f"acc within 0.5 points, and is the production choice for this model "
                       f"and schedule (a guard against spikes, not a constant rescaling)")
    return LabVerdict("3-clip", f"< {CLIP_LIMIT:.0%} of steps clipped in steady state "
                   f"({STEADY})", ok, figure)


def accumulation(steps: int, notes: dict) -> LabVerdict:
    diff = max(notes["full_window_diff"], notes["ragged_window_diff"])
    ok = steps == notes["expected_steps"] and diff < 1e-5
    return LabVerdict("4-accum", "one optimizer step per window of 4; loss scaled by samples, "
                   "not 1/4", ok,
                   f"{steps} optimizer steps for {notes['expected_steps']} windows; one step "
                   f"of 32x4 vs one batch of 128 differs by {notes['full_window_diff']:.1e}, "
                   f"ragged 32+32+32+4 vs 100 by {notes['ragged_window_diff']:.1e}")


#: An accuracy change smaller than this (half a point) is "held", not a rise or a fall to explain.
HELD = 0.005


def accumulation_drop(acc3: float, acc4: float, lrs3: list[float], lrs4: list[float],
                      window3: int, window4: int) -> str:
    """One sentence: why step 4's accuracy differs from step 3's, from steps and the LR."""
    n3, n4 = len(lrs3), len(lrs4)
    budget = (f"the same epochs give {n4} optimizer steps of {window4} samples instead of {n3} "
              f"of {window3}, and OneCycle spreads the same peak LR {max(lrs4):.1e} over those "
              f"{n4} steps, so the summed LR (how far AdamW can move the weights) is "
              f"{sum(lrs4):.3f} instead of {sum(lrs3):.3f} ({sum(lrs4) / sum(lrs3):.2f}x) with "
              f"no LR increase for the {window4 // window3}x bigger batch")
    if abs(acc4 - acc3) < HELD:
        return (f"Step 4's val acc held at {acc4:.2%} ({acc3:.2%} before) although {budget}: "
                f"on this data the smaller update budget still reaches the same accuracy.")
    what = "fell" if acc4 < acc3 else "rose"
    return f"Step 4's val acc {what} from {acc3:.2%} to {acc4:.2%} because {budget}."


def amp(speed_fp32: float, speed_amp: float, acc_fp32: float, acc_amp: float, precision: str,
        device: str, scaler_state) -> LabVerdict:
    uses_scaler = scaler_state is not None
    needs_scaler = precision == "fp16"
    scaler = ("GradScaler in use (fp16)" if uses_scaler else
              f"no GradScaler: {precision} has fp32's exponent range and needs none")
    ok = abs(acc_amp - acc_fp32) <= 0.01 and uses_scaler == needs_scaler
    return LabVerdict("5-amp", "throughput change measured; accuracy kept (within 1 point)"
                   + ("; fp16 on CUDA uses a GradScaler" if device == "cuda" else ""), ok,
                   f"x{speed_amp / speed_fp32:.2f} samples/s ({speed_amp:,.0f} vs "
                   f"{speed_fp32:,.0f} in fp32 on {device}); val acc {acc_amp:.2%} vs "
                   f"{acc_fp32:.2%}; {scaler}")


def checkpoint_keys(state: dict) -> LabVerdict:
    def find(path: str):
        node = state
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return True, node

    parts, ok = [], True
    for need, path in REQUIRED_KEYS.items():
        present, value = find(path)
        ok &= present
        where = "" if path == need else f" as {path}"
        note = ""
        if need == "scaler" and present and value is None:
            note = ", None: no fp16"
        elif need == "step" and present:
            note = f" = {value}"
        parts.append(f"{need}{where} {'present' if present else 'MISSING'}{note}")
    return LabVerdict("6-checkpoint", "last.pt holds model, optimizer, scheduler, scaler, step, "
                   "rng_state", ok, "; ".join(parts))


def resume(crash: dict, first_step_after: int | None, expected_from: int,
           epochs_resumed: list, epochs_whole: list) -> LabVerdict:
    ok = (crash["resumed_from"] == expected_from and first_step_after == expected_from + 1
          and crash["bit_identical"] and epochs_resumed == epochs_whole)
    return LabVerdict("7-crash-resume", "resumes at the step after the checkpoint; validation "
                   "continues smoothly", ok,
                   f"crashed after step {crash['crash_step']}, last checkpoint step "
                   f"{expected_from}, resumed from {crash['resumed_from']}, first step after "
                   f"the resume {first_step_after}; per-epoch val acc "
                   f"{'equal to' if epochs_resumed == epochs_whole else 'DIFFERENT from'} the "
                   f"uninterrupted run's ({', '.join(f'{a:.2%}' for a in epochs_resumed)}); "
                   f"final weights {'bit-identical' if crash['bit_identical'] else 'DIFFERENT'}")


def reference(plain: dict, accel: dict | None, ironloop_acc: float, diff_lines: int) -> LabVerdict:
    """The plain-PyTorch script and its Accelerate twin against ironloop's step 6."""
    same = abs(plain["val_acc"] - ironloop_acc) < 1e-9
    fig = (f"examples/production_loop.py val acc {plain['val_acc']:.2%} vs ironloop step 6 "
           f"{ironloop_acc:.2%} ({'equal' if same else 'DIFFERENT'})")
    ok = same
    if accel is not None:
        close = abs(accel["val_acc"] - plain["val_acc"]) <= 0.005
        ok &= close
        fig += (f"; the Accelerate version {accel['val_acc']:.2%} "
                f"({'same to 0.5 points' if close else 'NOT the same'}), {diff_lines} lines "
                f"of diff")
    else:
        fig += "; accelerate is not installed, so its version was not run"
    return LabVerdict("reference", "the hand-written script reaches ironloop's accuracy; the "
                   "Accelerate diff is small and reaches the same", ok, fig)
