"""The run's time split as a table, and what its numbers say to change: the user-facing text of
the step-time breakdown that ``engine/timing.py`` measures (``profile.breakdown``)."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ironloop.state.run_dir import TUNE

#: The parts of the breakdown, in the order they happen. "other" is the loop's own bookkeeping;
#: "startup" (from building the run to its first step: loggers such as MLflow starting, the
#: remote's first uploads, the guard's snapshot) and "closing" (after the last epoch: the test
#: split, waiting for uploads, the final weights) are one-off costs, in the run's totals only.
PARTS = ("startup", "data", "copy", "forward", "backward", "optimizer", "average", "checkpoint",
         "validation", "other", "closing")
#: The one-off parts: outside every epoch's split and outside the per-step figures.
ONE_OFF = ("startup", "closing")
#: The parts of an epoch's split (epochs.jsonl): they add up to the epoch's seconds.
EPOCH_PARTS = tuple(p for p in PARTS if p not in ONE_OFF)
#: Parts that make up a training step (the rest is checkpoints, validation and one-off costs).
STEP_PARTS = ("data", "copy", "forward", "backward", "optimizer", "average", "other")



def table(total: dict[str, float], steps: int, device: torch.device, sync: bool,
          run: RunSettings, tokens_per_s: float | None = None, counted: str = "") -> str:
    """The run's time split as a text table, plus the advice its numbers call for; and the
    training throughput in tokens/s when the step reports its tokens. ``steps``: the optimizer
    steps timed (ms/step divides by them); ``counted``: what they were, when not all of them
    count as the run's steps (``steps_timed``)."""
    if not total:
        return ""
    whole = sum(total.values()) or 1e-12
    how = ("wall time" if device.type != "cuda" else
           "wall time, synchronized around forward/backward" if sync else "CUDA events")
    lines = [f"time split ({how}; {whole:.2f} s, {counted or f'{steps} optimizer steps'}):",
             f"  {'part':<11}{'seconds':>9}{'share':>8}{'ms/step':>10}"]
    for part in PARTS:
        sec = total.get(part, 0.0)
        if part in ("average", *ONE_OFF) and not sec:
            continue  # a run without weight averaging (average.kind=none), or no such cost
        per = f"{1000 * sec / steps:.2f}" if steps and part in STEP_PARTS else ""
        lines.append(f"  {part:<11}{sec:9.3f}{100 * sec / whole:7.1f}%{per:>10}")
    step_time = sum(total.get(p, 0.0) for p in STEP_PARTS)
    if sync and step_time:
        gpu = total.get("forward", 0.0) + total.get("backward", 0.0)
        lines.append(f"  GPU compute (forward + backward): {100 * gpu / step_time:.1f}% "
                     f"of step time")
    if tokens_per_s:
        lines.append(f"  tokens/s (training, every process): {tokens_per_s:,.0f}")
    lines += [f"  advice: {a}" for a in advice(total, run)]
    return "\n".join(lines)


def steps_timed(timed: int, steps: int, skipped: int) -> str:
    """The table's step count in words, adding up to what the timer timed: ``steps`` optimizer
    steps the run counts (this process's), ``skipped`` bad ones the guard took back, and the
    rest redone after a rollback; "" when every timed step counts."""
    redone = timed - steps - skipped
    if not skipped and not redone:
        return ""
    extra = [f"{skipped} skipped by the guard"] if skipped else []
    extra += [f"{redone} redone after a rollback"] if redone else []
    return f"{steps} optimizer steps + {' + '.join(extra)} = {timed} timed"


@dataclass(frozen=True)
class RunSettings:
    """What the run already uses, so that advice names only a step that is still open."""

    device: str = "cpu"           # the device's type: cpu, cuda, mps
    num_workers: int = 0          # data.num_workers
    cores: int = 1                # the cores this process may run on
    threads: int = 1              # torch's intra-op threads in the run (run.threads, resolved)
    pin_memory: bool = False      # data.pin_memory, as applied (CUDA only)
    optimizer: str = "loop"       # the optimizer's kernel: fused, foreach, or loop (per tensor)
    fused_open: bool = False      # a fused kernel exists for this optimizer and device
    foreach_open: bool = True     # the optimizer's class takes foreach= (LBFGS does not)
    closure: bool = False         # step(closure): its time holds the closure's evaluations
    optimizer_class: str = ""     # the optimizer's class, when it is not the one optim.* names
    checkpoint_async: bool = False
    checkpoint_every_steps: int = 0  # 0: at epoch ends only
    precision: str = "fp32"
    bf16_open: bool = False       # this device runs bf16 natively (CUDA with bf16 support)
    sliced: bool = False          # batches are index slices of in-memory tensors (loader.py)
    tuned_none: str = ""          # run.dir/tune.json, when that tune found nothing faster


def advice(total: dict[str, float], run: RunSettings) -> list[str]:
    """What the numbers call for, one line per bottleneck, naming only what ``run`` does not
    do already; a bottleneck with no setting left to change gets no line."""
    step_time = sum(total.get(p, 0.0) for p in STEP_PARTS)
    whole = sum(total.values())
    if not step_time or not whole:
        return []
    share = {p: total.get(p, 0.0) / step_time for p in STEP_PARTS}
    lines = [_data_advice(share["data"], run), _copy_advice(share["copy"], run),
             _optimizer_advice(share, run), _precision_advice(share, run),
             _checkpoint_advice(total.get("checkpoint", 0.0) / whole, run)]
    return [line for line in lines if line]


def _data_advice(data: float, run: RunSettings) -> str:
    if data <= 0.10:
        return ""
    steps, workers = [], run.num_workers
    if run.sliced:  # one index_select per tensor: workers would only pickle the slices
        return (f"data wait is {100 * data:.0f}% of step time: the batches are already slices "
                f"of in-memory tensors, which loader workers would only copy between processes;"
                f" a larger train.batch_size spreads the per-batch cost over more samples")
    if run.num_workers < run.cores:
        steps.append(f"raise data.num_workers (now {run.num_workers}; {run.cores} cores)")
        workers = max(run.num_workers + 1, min(run.cores, 2))  # the workers that would run
    leave = max(1, run.cores - workers)
    if run.device == "cpu" and workers and run.threads > leave:
        # torch's threads spin-wait between ops on the cores the workers need
        steps.append(f"set run.threads={leave} (now {run.threads}) so torch leaves the "
                     f"workers their cores")
    if run.device == "cuda" and not run.pin_memory:
        steps.append("set data.pin_memory=true")
    if not steps:
        steps.append(f"the {run.num_workers} workers already have every core: make "
                     f"__getitem__ cheaper (decode once and cache, lighter augmentation)")
    then = (found_nothing(run.tuned_none) if run.tuned_none else
            f"`{tune_command()}` measures the options on this run and writes a faster config")
    return f"data wait is {100 * data:.0f}% of step time: {'; '.join(steps)}; {then}"


def _copy_advice(copy: float, run: RunSettings) -> str:
    if copy <= 0.10 or run.device != "cuda":
        return ""
    step = ("keep the dataset on the device (pinned memory is already on)" if run.pin_memory
            else "set data.pin_memory=true")
    return f"host-to-device copies are {100 * copy:.0f}% of step time: {step}"


def _optimizer_advice(share: dict[str, float], run: RunSettings) -> str:
    opt = share["optimizer"]
    if opt <= 0.3 or opt <= share["forward"] + share["backward"] or run.optimizer == "fused":
        return ""
    head = f"the optimizer step is {100 * opt:.0f}% of step time, more than forward + backward"
    if run.closure:  # LBFGS: its step re-runs forward + backward; no kernel changes that
        return (f"{head}: it holds the closure's extra forward + backward evaluations "
                f"(max_iter per step); fewer iterations cut it, no kernel setting does")
    # the config's key, or the constructor's argument when the optimizer is the user's own
    fused, foreach = (("set optim.fused=true", "set optim.foreach=true") if not
                      run.optimizer_class else (f"pass fused=True to {run.optimizer_class}",
                                                f"pass foreach=True to {run.optimizer_class}"))
    if run.fused_open:
        step = f"{fused} (now the {run.optimizer} kernel)"
    elif run.optimizer == "loop" and run.foreach_open:
        step = f"{foreach} (one kernel per step for all tensors)"
    else:
        return ""  # foreach, or no kernel to switch to here: nothing left to switch on
    return f"{head}: {step}"


def _precision_advice(share: dict[str, float], run: RunSettings) -> str:
    compute = share["forward"] + share["backward"]
    if compute <= 0.6 or run.precision != "fp32" or not run.bf16_open:
        return ""
    return (f"forward + backward are {100 * compute:.0f}% of step time in fp32: "
            f"train.precision=bf16 runs them faster on this device (it changes the "
            f"trajectory; `{tune_command()} --apply-trajectory-changes` measures it)")


def _checkpoint_advice(stall: float, run: RunSettings) -> str:
    if stall <= 0.10:
        return ""
    every = run.checkpoint_every_steps
    fewer = f"raise checkpoint.every_steps (now {every}) or set it to 0 (epoch ends only)"
    if not run.checkpoint_async:
        step = "set checkpoint.async=true" + (f", or {fewer}" if every else "")
    elif every:
        step = f"checkpoint.async is already on: {fewer}"
    else:
        return ""  # async, at epoch ends only: nothing left but fewer epochs
    return f"checkpoint writes stall the run {100 * stall:.0f}% of the time: {step}"


def tuned_none(run_dir: str | Path) -> str:
    """run.dir/tune.json's path when the tune that wrote it chose no trajectory-free setting
    (nothing was faster beyond the noise), else "": advice then names that finding instead of
    sending the user to run the same tune again."""
    path = Path(run_dir) / TUNE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):  # no tune here, or a file that is not a tune's
        return ""
    return str(path) if isinstance(doc, dict) and doc.get("chosen") == {} else ""


def found_nothing(tune_json: str) -> str:
    """What the advice says in place of "run tune" when a tune of this run.dir chose nothing."""
    return (f"the tune in {tune_json} measured this run.dir's config and found no "
            f"trajectory-free setting faster beyond the noise")


def tune_hint(run_dir: str | Path, run_tune: str) -> str:
    """``run_tune`` (the advice to run tune), or what the tune of ``run_dir`` found when it
    chose nothing (``tuned_none``): the advice never sends the user to run it again."""
    tuned = tuned_none(run_dir)
    return found_nothing(tuned) if tuned else run_tune


def tune_command(argv: list[str] | None = None) -> str:
    """How to tune this run: ``ironloop tune`` with the config and overrides of an ``ironloop
    train`` (or ``doctor``) command line, else the Python call."""
    argv = sys.argv if argv is None else argv
    if len(argv) > 2 and argv[1] in ("train", "doctor"):
        config = next((a for a in argv[2:] if a.endswith((".yaml", ".yml"))
                       and not a.startswith("-")), None)
        if config is not None:
            overrides = [a for a in argv[2:] if "=" in a and not a.startswith("-")]
            return shlex.join(["ironloop", "tune", config, *overrides])
    return "ironloop.tune(model, train_data, config)"
