"""Resume cost against position in the epoch: it should be flat (no replay of skipped batches).

One run trains an epoch of a 1M-sample map-style dataset (per-sample ``__getitem__``, through
a DataLoader: not ironloop's sliced path) with a checkpoint after every step. Then, for the
checkpoints at 1%, 50% and 99% of the epoch, a fresh process is launched that resumes from it
and takes one step. Two times per launch:

- launch -> first resumed step: from just before the process is started to the moment the
  first resumed step is done (the second batch is fetched), interpreter and imports included;
- fit() -> first resumed step: the same, from the ``fit(..., resume=...)`` call, which is what
  depends on the position (loading and restoring the checkpoint, positioning the data).

and, with more repetitions because it is cheap, the same fit() -> first step inside one warm
process, where the noise of a cold start is gone and any cost that grows with the position
would show. Medians of the repetitions with min-max; positions rotate within each repetition.

    python benchmarks/resume_cost.py [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, size, summary

FRACTIONS = (0.01, 0.50, 0.99)


class MapStyle(Dataset):
    """A plain map-style dataset: one sample per ``__getitem__``, collated by the DataLoader."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]



class FirstStep:
    """A callback: when the first resumed optimizer step is done. (Not the second batch's
    fetch: the loop fetches one batch ahead, and per-sample seeding fetches sample by sample.)"""

    done: float | None = None

    def on_train_start(self, run, metrics) -> None:
        FirstStep.done = None

    def on_step_end(self, run, metrics) -> None:
        if FirstStep.done is None:
            FirstStep.done = time.time()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))


def config(run_dir: Path, batch: int, **extra) -> dict:
    return {"run.dir": str(run_dir), "run.device": "cpu", "train.epochs": 1,
            "train.batch_size": batch, "log.progress": "off", "log.every_steps": 50, **extra}


def child(ckpt: str, n: int, batch: int, run_dir: str, step: int) -> None:
    """The launched process: resume from ``ckpt``, take two steps (the second fetch marks the
    first step done), print the times."""
    import ironloop

    data = MapStyle(n)
    called = time.time()
    ironloop.fit(model(), data, None, config(Path(run_dir), batch, **{
        "train.max_steps": step + 2, "checkpoint.enabled": False}), resume=ckpt,
        allow_config_change=True, callbacks=[FirstStep()])  # a shorter run is the point here
    print(json.dumps({"fit_called": called, "first_step_done": FirstStep.done}))


def _flat(times: dict[float, list[float]]) -> bool:
    med = [statistics.median(v) for v in times.values()]
    spread = max(max(v) - min(v) for v in times.values())
    return max(med) - min(med) <= max(spread, 0.1 * min(med))


def run(quick: bool) -> dict:
    import ironloop

    torch.set_num_threads(1)
    n = size(1_000_000, 20_000, 4_000, quick)
    batch = size(4096, 1024, 256, quick)
    reps, warm_reps = size(3, 1, 1, quick), size(7, 2, 1, quick)
    steps = -(-n // batch)
    # At least two steps must remain in the epoch: the second fetch marks the first step done.
    positions = {f: max(1, min(steps - 2, round(f * steps))) for f in FRACTIONS}
    launch: dict[float, list[float]] = {f: [] for f in FRACTIONS}
    in_fit: dict[float, list[float]] = {f: [] for f in FRACTIONS}
    warm: dict[float, list[float]] = {f: [] for f in FRACTIONS}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(ironloop.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as d:
        base = Path(d) / "base"
        ironloop.fit(model(), MapStyle(n), None, config(
            base, batch, **{"checkpoint.every_steps": 1, "checkpoint.keep_last": steps + 1}))
        for rep in range(reps):
            order = FRACTIONS[rep % 3:] + FRACTIONS[:rep % 3]
            for f in order if not TINY else FRACTIONS[-1:]:  # the smoke test: one launch
                ckpt = base / "checkpoints" / f"step-{positions[f]:08d}.pt"
                start = time.time()
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(ckpt), str(n), str(batch),
                     str(Path(d) / f"resume-{rep}-{f}"), str(positions[f])],
                    env=env, capture_output=True, text=True, check=True)
                times = json.loads(out.stdout.strip().splitlines()[-1])
                launch[f].append(times["first_step_done"] - start)
                in_fit[f].append(times["first_step_done"] - times["fit_called"])
        data = MapStyle(n)
        for rep in range(warm_reps + 1):  # the first round warms the process up
            for f in FRACTIONS[rep % 3:] + FRACTIONS[:rep % 3]:
                ckpt = base / "checkpoints" / f"step-{positions[f]:08d}.pt"
                called = time.time()
                ironloop.fit(model(), data, None, config(
                    Path(d) / f"warm-{rep}-{f}", batch,
                    **{"train.max_steps": positions[f] + 2, "checkpoint.enabled": False}),
                    resume=str(ckpt), allow_config_change=True,  # max_steps differs
                    callbacks=[FirstStep()])
                if rep:
                    warm[f].append(FirstStep.done - called)
    rows = []
    for f in FRACTIONS:
        where = f"step {positions[f]}/{steps} ({positions[f] / steps:.0%})"
        if launch[f]:
            rows.append(summary(f"launch -> first resumed step, {where}", launch[f],
                                position=positions[f] / steps))
            rows.append(summary(f"fit() -> first resumed step, {where}", in_fit[f],
                                position=positions[f] / steps))
        rows.append(summary(f"warm process: fit() -> first resumed step, {where}", warm[f],
                            position=positions[f] / steps))
    med = {f: statistics.median(warm[f]) for f in FRACTIONS}
    flat = _flat(warm) and (reps < 2 or _flat(launch))
    return {
        "name": "resume_cost",
        "description": f"time to the first resumed step at 1%, 50%, 99% of a {n:,}-sample "
                       f"map-style epoch (batch {batch}, {steps} steps), from a fresh process",
        "results": rows,
        "ratio": {"warm fit() -> step, 99% / 1%": med[0.99] / med[0.01],
                  "warm fit() -> step, 50% / 1%": med[0.50] / med[0.01],
                  "launch -> step, 99% / 1%": statistics.median(launch[0.99])
                  / statistics.median(launch[0.01]) if launch[0.01] else None},
        "target": "flat within noise: the medians at 1%, 50% and 99% differ by no more than "
                  "the spread of the repetitions (or 10%)",
        "met": None if TINY else flat,
        "notes": "checkpoints come from one real run with a checkpoint after every step",
    }


if __name__ == "__main__":
    if "--child" in sys.argv:
        a = sys.argv[sys.argv.index("--child") + 1:]
        child(a[0], int(a[1]), int(a[2]), a[3], int(a[4]))
    else:
        from _common import main
        main(run)
