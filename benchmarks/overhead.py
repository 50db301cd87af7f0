"""ironloop's per-step cost against a hand-written loop doing the same work.

Same model, data, optimizer, clipping and batch size; both run one epoch per repetition,
alternating (who goes first swaps every repetition), and the result gives the median
samples/s with the min-max spread and the median of the per-repetition ratio. ironloop's figure
is its epoch's training time (train_seconds in epochs.jsonl), so set-up is not counted against
it, as it is not counted for the hand loop.

    python benchmarks/overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ironloop
from ironloop.data.loader import TensorData

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import main as common_main, size, summary


def model(d: int, c: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, c))


def hand_loop(data: TensorData, device: str, batch: int) -> float:
    m = model(data.x.shape[1], 10).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = data.x.to(device), data.y.to(device)
    perm = torch.randperm(len(x), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, len(x), batch):
        idx = perm[i:i + batch]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(m(x[idx]), y[idx])
        loss.backward()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return len(x) / (time.perf_counter() - t)


def ironloop_loop(data: TensorData, device: str, batch: int, tmp: Path, rep: int) -> float:
    run_dir = tmp / f"run{rep}"
    ironloop.fit(model(data.x.shape[1], 10), data, None, {
        "run.dir": str(run_dir), "run.device": device, "train.epochs": 1,
        "train.batch_size": batch, "log.every_steps": 50, "log.progress": "off",
        "checkpoint.enabled": False, "optim.weight_decay": 0.01})
    row = json.loads((run_dir / "epochs.jsonl").read_text().splitlines()[-1])
    return row["samples_per_s"]


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reps = size(9, 3, 1, quick)
    samples = size(16384, 4096, 256, quick)
    batch = 64
    g = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(samples, 784, generator=g),
                      torch.randint(0, 10, (samples,), generator=g))
    hand, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        hand_loop(data, device, batch)  # warm-up
        for rep in range(reps):  # alternate, and swap who goes first every repetition
            pair = [lambda: hand.append(hand_loop(data, device, batch)),
                    lambda rep=rep: ours.append(ironloop_loop(data, device, batch, Path(tmp), rep))]
            for fn in (pair if rep % 2 == 0 else pair[::-1]):
                fn()
    ratio = [o / h for o, h in zip(ours, hand)]
    return {
        "name": "overhead",
        "description": f"samples/s of one epoch, 784-512-512-10 MLP, batch {batch}, "
                       f"{samples} samples, {device}: ironloop's train_seconds against a "
                       "hand-written loop on the same index-sliced batches",
        "results": [summary("hand-written loop", hand, "samples/s"),
                    summary("ironloop", ours, "samples/s")],
        "ratio": {"ironloop / hand samples/s": statistics.median(ratio),
                  "min-max": [min(ratio), max(ratio)]},
        "target": "none of its own (issue 10's targets are in peers); >= 0.98 expected",
        "met": None,
        "notes": "the compute of a 784-512-512 MLP hides the loop; see peers for a tiny model",
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.parse_args()
    common_main(run)


if __name__ == "__main__":
    main()
