"""time_sequence_prediction (pytorch/examples): LBFGS, float64, the whole batch per step; its
train.py's loop against ironloop.fit with optim.name=LBFGS, on the same sine waves.

Size: generate_sine_wave.py's recipe with L=200 points (not 1000) so a step fits this machine;
N=100 waves (97 train, 3 test), STEPS=4 LBFGS steps (train.py: 15), each up to 20 evaluations.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.outside import common

STEPS, L = 4, 200
sys.path.insert(0, str(common.OUTSIDE / "time_sequence_prediction"))
from train import Sequence  # noqa: E402  # the public model, unmodified


def waves() -> np.ndarray:
    """generate_sine_wave.py's data, L points per wave."""
    np.random.seed(2)
    T, N = 20, 100
    x = np.empty((N, L), "int64")
    x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
    return np.sin(x / 1.0 / T).astype("float64")


def splits():
    data = torch.from_numpy(waves())
    return (data[3:, :-1], data[3:, 1:]), (data[:3, :-1], data[:3, 1:])


def reference() -> tuple[nn.Module, list[float]]:
    """train.py's loop (its __main__ without the plots)."""
    (input, target), _ = splits()
    np.random.seed(0)
    torch.manual_seed(0)
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    ms = []
    for _ in range(STEPS):
        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            loss.backward()
            return loss
        started = time.perf_counter()
        optimizer.step(closure)
        ms.append(1000 * (time.perf_counter() - started))
    return seq, ms


def ironloop_user(run_dir, resume=False, callbacks=()):
    import ironloop
    torch.manual_seed(0)
    train, _ = splits()
    return ironloop.fit(Sequence().double(), train, None, {
        "run.dir": str(run_dir), "train.epochs": STEPS, "train.batch_size": 97,
        "data.shuffle": False, "optim.name": "LBFGS", "optim.lr": 0.8, "loss.name": "mse",
        "clip.max_norm": 0.0, "run.threads": 1, "log.progress": "off",
        "checkpoint.every_steps": 1}, resume=resume, callbacks=list(callbacks))


def test_loss(model: nn.Module) -> str:
    _, (x, y) = splits()
    with torch.no_grad():
        return f"test MSE {nn.functional.mse_loss(model(x), y).item():.4g}"


def main() -> None:
    common.one_thread()
    child = common.child_args()
    if child:
        ironloop_user(child[0], resume=child[1])
        return
    ref, ref_ms = reference()
    clock = common.StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        ours = ironloop_user(Path(tmp) / "straight", callbacks=[clock])
        first = 1000 * (time.perf_counter() - started)
        same = sum(torch.equal(a, b) for a, b in zip(ref.state_dict().values(),
                                                       ours.model.state_dict().values()))
        resume = common.kill_and_resume("benchmarks.outside.time_sequence",
                                        Path(tmp) / "killed", 2,
                                        Path(tmp) / "straight" / "final.safetensors")
    ms = clock.ms or [first / STEPS]
    common.print_row("time_sequence_prediction (LBFGS, float64)", {
        "ref_metric": test_loss(ref), "ours_metric": f"{test_loss(ours.model)} (weights "
        f"torch.equal: {same}/{len(ref.state_dict())})", "ref_ms": common.median(ref_ms),
        "ours_ms": common.median(ms),
        "ref_lines": common.file_lines(common.OUTSIDE / "time_sequence_prediction/train.py"),
        "ours_lines": common.lines_of(ironloop_user), "resume": resume})


if __name__ == "__main__":
    main()
