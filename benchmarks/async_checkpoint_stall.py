"""What ``checkpoint.every_steps`` costs the training loop, sync against ``checkpoint.async=true``.

checkpoint_stall.py times one ``FileWriter.save`` call; this one times the loop itself, as
distributed.md recommends it to bound the work a lost node costs: ``ironloop.fit`` trains an
MLP (8 x Linear(1024, 1024), 8.4M parameters; AdamW, so a ~100 MB checkpoint) for 31 steps of
64 samples three ways, in rotating order within each repetition:

- ``none``: checkpoint.enabled=false, the baseline;
- ``sync``: checkpoint.every_steps=10, each save on the training thread;
- ``async``: the same with checkpoint.async=true (a CPU snapshot, the write on a thread).

A callback stamps the end of every optimizer step; the window runs from step 1's end to the last
step's, which holds the saves of steps 10, 20, 30 and none of the run's setup or final save.
The stall per checkpoint is (window - the baseline's window of the same repetition) / saves: it
includes what the background write takes from the steps beside it, and on a busy machine the
load drifting between runs. Within each run, less exposed to that drift: the two step intervals
beside each save beyond twice the run's median interval (what the save blocks, not what a write
in flight takes from the steps after it). Medians over repetitions,
with min and max; the async/sync ratio is taken within each repetition.

An async save waits for the previous write, so async pays off only when a write fits in the
steps between two saves: ``--batch 16`` makes those steps 4x shorter than the write needs here.

    python benchmarks/async_checkpoint_stall.py [--quick] [--batch N] [--out results.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, machine, size, summary

MODES = ("none", "sync", "async")


class StepClock:
    """A callback: perf_counter at the end of each optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, run, metrics) -> None:
        self.ends.append(time.perf_counter())


def model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width),
                                                               nn.ReLU())])


def window(mode: str, width: int, layers: int, steps: int, every: int, batch: int,
           run_dir: Path) -> tuple[float, float]:
    """Seconds from the end of step 1 to the end of the last step; and what the two intervals
    beside each save (the save falls in one of them) took beyond twice the run's median
    interval, summed over the saves."""
    import ironloop

    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, width, generator=g)
    y = torch.randint(0, width, (steps * batch,), generator=g)
    ckpt = {"checkpoint.enabled": False} if mode == "none" else {
        "checkpoint.every_steps": every, "checkpoint.keep_last": 2,
        "checkpoint.async": mode == "async"}
    clock = StepClock()
    ironloop.fit(model(width, layers), (x, y), None, {
        "run.dir": str(run_dir), "run.device": "cpu", "train.epochs": 1,
        "train.batch_size": batch, "log.progress": "off", "log.every_steps": 1000,
        "doctor.preflight": False, "optim.name": "adamw", **ckpt}, callbacks=[clock])
    assert len(clock.ends) == steps, (mode, len(clock.ends))
    gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # gaps[i]: step i+1 to i+2
    typical = statistics.median(gaps)
    beside = sum(gaps[k - 2] + gaps[k - 1] - 2 * typical
                 for k in range(every, steps, every)) if mode != "none" else 0.0
    return clock.ends[-1] - clock.ends[0], beside


def run(quick: bool, batch: int = 64) -> dict:
    torch.set_num_threads(1)
    width, layers = size(1024, 1024, 64, quick), size(8, 4, 2, quick)
    every, batch = size(10, 10, 3, quick), size(batch, batch, 4, quick)
    steps, reps = size(31, 21, 7, quick), size(3, 2, 1, quick)
    saves = (steps - 1) // every  # steps every, 2 * every, ... inside the window
    times: dict[str, list[float]] = {m: [] for m in MODES}
    beside: dict[str, list[float]] = {m: [] for m in MODES}
    n_params = sum(p.numel() for p in model(width, layers).parameters())
    with tempfile.TemporaryDirectory() as d:
        for rep in range(reps):
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                t, b = window(mode, width, layers, steps, every, batch,
                              Path(d) / f"{mode}-{rep}")
                times[mode].append(t)
                beside[mode].append(b / saves)
    stall = {m: [(t - base) / saves for t, base in zip(times[m], times["none"])]
             for m in ("sync", "async")}
    ratio = [a / s if s > 0 else float("nan") for a, s in zip(stall["async"], stall["sync"])]
    return {
        "name": "async_checkpoint_stall",
        "description": f"seconds each checkpoint.every_steps={every} save adds to the loop, "
                       f"{n_params / 1e6:.1f}M-parameter MLP + AdamW state, sync vs "
                       f"checkpoint.async=true ({steps} steps, batch {batch}, 1 thread)",
        "results": [
            summary(f"no checkpoints: steps 1-{steps}", times["none"]),
            summary(f"sync: steps 1-{steps}, {saves} saves", times["sync"]),
            summary(f"async: steps 1-{steps}, {saves} saves", times["async"]),
            summary("sync: stall per save", stall["sync"]),
            summary("async: stall per save", stall["async"]),
            summary("sync: the steps beside a save, beyond the run's median", beside["sync"]),
            summary("async: the steps beside a save, beyond the run's median", beside["async"]),
        ],
        "ratio": {"async stall / sync stall": statistics.median(ratio),
                  "the same, steps beside a save": statistics.median(
                      a / s if s > 0 else float("nan")
                      for a, s in zip(beside["async"], beside["sync"]))},
        "target": "async stall <= 10% of sync stall",
        "met": None if TINY else statistics.median(ratio) <= 0.10,
        "notes": f"{n_params / 1e6:.1f}M parameters (~{n_params * 12 / 1e6:.0f} MB of "
                 "weights and AdamW moments); the stall includes what the background write "
                 "takes from the steps it runs beside, on the same cores",
    }


if __name__ == "__main__":
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the loop's lines: stdout holds the JSON
        batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 64
        result = {**run("--quick" in sys.argv, batch), "machine": machine(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    text = json.dumps(result, indent=1)
    if "--out" in sys.argv:
        Path(sys.argv[sys.argv.index("--out") + 1]).write_text(text + "\n")
    print(text)
