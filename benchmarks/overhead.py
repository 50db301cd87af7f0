"""ironloop's per-step cost against a hand-written loop doing the same work.

Same model, data, optimizer, clipping and batch size; both run one epoch per repetition,
alternating, and the table gives the median samples/s with the min-max spread and the median
of the per-repetition ratio. ironloop's figure is its epoch's training time (train_seconds in
epochs.jsonl), so set-up is not counted against it, as it is not counted for the hand loop.

    .venv/bin/python benchmarks/overhead.py [--reps 7] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ironloop
from ironloop.data.loader import TensorData


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=16384)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(args.samples, 784, generator=g),
                      torch.randint(0, 10, (args.samples,), generator=g))
    hand, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        hand_loop(data, args.device, args.batch)  # warm-up
        for rep in range(args.reps):
            hand.append(hand_loop(data, args.device, args.batch))
            ours.append(ironloop_loop(data, args.device, args.batch, Path(tmp), rep))
    ratio = [o / h for o, h in zip(ours, hand)]

    def fmt(v):
        return f"{statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})"

    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"MLP 784-512-512-10, batch {args.batch}, {args.reps} reps")
    print(f"hand-written loop  samples/s  {fmt(hand)}")
    print(f"ironloop           samples/s  {fmt(ours)}")
    print(f"ironloop / hand    median {statistics.median(ratio):.3f} "
          f"(min {min(ratio):.3f}, max {max(ratio):.3f})")


if __name__ == "__main__":
    main()
