"""What the guard costs a good step: guard.enabled on against off, on the CPU MLP.

Two measurements, because a 1% target is below the noise of a shared machine:

- end to end: one epoch of a 784-512-512-10 MLP at batch 64 through ``ironloop.fit``, guard on
  and off alternating, samples/s from epochs.jsonl (training time only);
- in isolation: the guard's per-step work (``DeviceVerdicts.check`` on a good step: the verdict on
  the device, two kernels and a ``where``, no host read; plus a tenth of ``settle``, the
  lagged read at a log step every 10 steps) timed over many calls, as a fraction of the median
  step time measured above. This is the figure the target applies to.

On CUDA the check reads nothing either (see guard/reporter.py); this script measures CPU.

    .venv/bin/python benchmarks/guard_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ironloop
from ironloop.config import GuardConfig
from ironloop.data.loader import TensorData
from ironloop.engine.progress import Meter, Progress
from ironloop.guard.reporter import GuardReporter
from ironloop.guard.verdict import device_verdicts
from ironloop.parallel.world import World

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY, summary

TARGET = 0.01  # the guard may cost at most 1% of a step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def _epoch(data: TensorData, guard: bool, tmp: Path, rep: int) -> float:
    run_dir = tmp / f"{'on' if guard else 'off'}{rep}"
    with contextlib.redirect_stdout(io.StringIO()):  # keep stdout for the JSON
        ironloop.fit(_model(), data, None, {
            "run.dir": str(run_dir), "run.device": "cpu", "train.epochs": 1,
            "train.batch_size": 64, "log.every_steps": 50, "log.progress": "off",
            "checkpoint.enabled": False, "guard.enabled": guard})
    return json.loads((run_dir / "epochs.jsonl").read_text().splitlines()[-1])["samples_per_s"]


def _check_seconds(calls: int) -> float:
    """Seconds per DeviceVerdicts.check on a good step, with the settle of every 10th step (a log
    step's lagged read) shared out, with a real Meter."""
    meter, world, progress = Meter(torch.device("cpu")), World(), Progress()
    device = device_verdicts(GuardConfig(), meter.loss_sum.device, meter.loss_sum.dtype)
    reporter = GuardReporter(GuardConfig(), Path("."), device, False, 1, "")
    model = torch.nn.Linear(1, 1)

    def settle():  # the good path reads neither the data nor the run (owner)
        return reporter.settle(meter, progress, None, model, world, None)  # type: ignore[arg-type]

    device.rebase(meter, 0)
    loss, norm = torch.tensor(0.5), torch.tensor(1.3)
    for _ in range(100):  # warm-up
        meter.add_micro(loss, 64)
        device.check(meter, norm, 0, None, world)
    settle()
    total = 0.0
    for i in range(calls):
        meter.add_micro(loss, 64)  # the loop's own work, not timed
        t = time.perf_counter()
        device.check(meter, norm, 0, None, world)
        if i % 10 == 9:
            attempts, bad = settle()  # the log step's read of ten verdicts
            assert attempts == 10 and not bad
        total += time.perf_counter() - t
    return total / calls


def run(quick: bool) -> dict:
    reps, samples, calls = (1, 256, 200) if TINY else (3, 4096, 2000) if quick \
        else (9, 16384, 20000)  # TINY: the smoke test (the suite runs it)
    g = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(samples, 784, generator=g),
                      torch.randint(0, 10, (samples,), generator=g))
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp:
        _epoch(data, True, Path(tmp), -1)  # warm-up
        for rep in range(reps):  # alternate, so drifts in machine load hit both
            off.append(_epoch(data, False, Path(tmp), rep))
            on.append(_epoch(data, True, Path(tmp), rep))
    step_s = [64 / s for s in off]
    check_s = [_check_seconds(calls) for _ in range(3)]
    fraction = statistics.median(check_s) / statistics.median(step_s)
    paired = [a / b for a, b in zip(on, off)]
    return {
        "name": "guard_overhead",
        "description": "guard.enabled on vs off: a 784-512-512-10 MLP at batch 64 on CPU; "
                       "ratio = the guard's per-step check time / the median step time",
        "results": [summary("guard off", off, "samples/s"),
                    summary("guard on", on, "samples/s"),
                    summary("guard on/off samples/s, paired", paired, "x"),
                    summary("step time, guard off", [s * 1e3 for s in step_s], "ms"),
                    summary("guard check per step", [s * 1e6 for s in check_s], "us")],
        "ratio": fraction,
        "target": TARGET,
        "met": fraction <= TARGET,
        "notes": "The check reads nothing from the device: its verdict is applied by the fused "
                 "optimizer (found_inf) and read at log steps (settle, shared out here). "
                 "The end-to-end on/off ratio is within the machine's noise; the "
                 "isolated per-step cost is what the 1% target is judged on.",
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    print(json.dumps(run(p.parse_args().quick), indent=2))
