"""A production training loop in plain PyTorch: the script the 7-step ironloop lab builds.

AdamW (no decay on biases and norm gains), OneCycle or warmup+cosine stepped per optimizer step,
clipping at 1.0 with the pre-clip norm logged, accumulation weighted by samples (exact for a
ragged last window), AMP (autocast; GradScaler only for fp16 on CUDA), atomic last.pt/best.pt
holding everything a resume needs, and --resume after a crash. No ironloop import.

    python examples/production_loop.py --out runs/plain                  # sklearn's digits
    python examples/production_loop.py --out runs/plain --crash-at-step 50
    python examples/production_loop.py --out runs/plain --resume

The data order is a pure function of (seed, epoch) (``epoch_order``), so a resumed run sees
exactly the batches an uninterrupted one would have seen; pass ``order=`` to use another.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: depends on (seed, epoch) only, never on the global RNG."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices and kernels; biases and norm gains (ndim < 2) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_schedule(opt, name: str, max_lr: float, total: int, warmup: int):
    if name == "onecycle":
        return lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=total)
    return lr_scheduler.SequentialLR(opt, [  # warmup_cosine: linear warmup, then cosine to 0
        lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warmup),
        lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup)], milestones=[warmup])


def save_atomic(state: dict, path: Path) -> None:
    """Temp file, fsync, rename: a crash leaves the old checkpoint or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s["cuda"]:
        torch.cuda.set_rng_state_all(s["cuda"])


@torch.inference_mode()
def accuracy(model: nn.Module, data, batch_size: int, amp) -> float:
    model.eval()
    x, y = data
    device = next(model.parameters()).device
    correct = torch.zeros((), device=device)
    for i in range(0, len(x), batch_size):
        with amp():
            out = model(x[i:i + batch_size].to(device))
        correct += (out.argmax(-1) == y[i:i + batch_size].to(device)).sum()
    model.train()
    return correct.item() / len(x)  # host sync, once per epoch


def train(model: nn.Module, train_set, val_set, out_dir, *, epochs=5, batch_size=64, accum=1,
          lr=1e-3, max_lr=3e-3, weight_decay=0.01, schedule="onecycle", warmup=20,
          max_norm=1.0, label_smoothing=0.0, precision="fp32", seed=0, order=epoch_order,
          ckpt_every=100, log_every=1, resume=False, crash_at_step=0) -> dict:
    """Train on (x, y) tensor pairs; returns the logged rows. Writes out_dir/{last,best}.pt
    and out_dir/log.jsonl. ``max_norm=0`` measures the norm without clipping."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    x, y = train_set
    window_size = batch_size * accum
    steps_per_epoch = math.ceil(len(x) / window_size)
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, fused=True)  # one kernel
    sched = make_schedule(opt, schedule, max_lr, steps_per_epoch * epochs, warmup)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16 and device.type == "cuda")

    def amp():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    step, epoch, best, acc, rows = 0, 0, -1.0, None, []
    if resume and (out / "last.pt").exists():
        ck = torch.load(out / "last.pt", weights_only=False)  # our own file: numpy RNG state
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        step, epoch, best = ck["step"], ck["epoch"], ck["best_acc"]
        set_rng_state(ck["rng_state"])
        rows = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
                if r["step"] <= step]  # lines logged after the checkpoint are replayed
        print(f"resumed from step {step}")
    log = open(out / "log.jsonl", "w")  # noqa: SIM115 - closed after the loop
    log.writelines(json.dumps(r) + "\n" for r in rows)

    def checkpoint(name: str) -> None:
        save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                     "step": step, "epoch": epoch, "best_acc": best, "rng_state": rng_state()},
                    out / name)

    def write(row: dict) -> None:
        rows.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()

    while epoch < epochs:
        perm = order(len(x), seed, epoch)
        done = step - epoch * steps_per_epoch  # windows of this epoch before a resume
        loss_sum = torch.zeros((), device=device)
        for start in range(done * window_size, len(x), window_size):
            window = perm[start:start + window_size]
            opt.zero_grad(set_to_none=True)
            for idx in window.split(batch_size):
                xb, yb = x[idx].to(device, non_blocking=True), y[idx].to(device, non_blocking=True)
                with amp():
                    out_b = model(xb)
                loss = F.cross_entropy(out_b.float(), yb, label_smoothing=label_smoothing)
                # Weight by samples, not 1/accum: the window's mean gradient, ragged or not.
                weighted = loss * (len(idx) / len(window))
                scaler.scale(weighted).backward()
                loss_sum += weighted.detach()
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            # Returns the PRE-clip norm; max_norm inf multiplies by 1.0, i.e. only measures.
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)
            step_lr = opt.param_groups[0]["lr"]
            scaler.step(opt)  # skips the step if fp16 gradients overflowed
            scaler.update()
            sched.step()  # after optimizer.step, once per optimizer step
            step += 1
            if step == crash_at_step:
                os._exit(1)  # die like a preempted job: no cleanup, no last checkpoint
            if step % log_every == 0:
                pre_clip = norm.item()  # host sync, at log steps only
                write({"step": step, "epoch": epoch + 1, "loss": loss_sum.item() / log_every,
                       "lr": step_lr, "grad_norm": pre_clip,
                       "clipped": bool(max_norm) and pre_clip > max_norm})
                loss_sum.zero_()
            if ckpt_every and step % ckpt_every == 0:
                checkpoint("last.pt")
        acc = accuracy(model, val_set, batch_size, amp)
        epoch += 1
        write({"step": step, "epoch": epoch, "val_acc": acc})
        if acc > best:
            best = acc
            checkpoint("best.pt")
        checkpoint("last.pt")
    log.close()
    return {"rows": rows, "val_acc": acc, "best_acc": best, "steps": step}


def digits():
    """sklearn's 8x8 digits, a fixed 80/20 split, standardised with the training split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    xs = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1)
    ys = torch.tensor(d.target)
    perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(1234))
    val, tr = perm[:round(0.2 * len(xs))], perm[round(0.2 * len(xs)):]
    mean, std = xs[tr].mean(), xs[tr].std()
    return ((xs[tr] - mean) / std, ys[tr]), ((xs[val] - mean) / std, ys[val])


def small_cnn(c1=32, c2=64, classes=10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(c2 * 2 * 2, 128), nn.ReLU(),
                         nn.Linear(128, classes))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/production_loop")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                    default="bf16" if torch.cuda.is_available() else "fp32")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--crash-at-step", type=int, default=0)
    args = ap.parse_args(argv)
    train_set, val_set = digits()
    torch.manual_seed(args.seed)  # the initial weights
    model = small_cnn().to("cuda" if torch.cuda.is_available() else "cpu")
    result = train(model, train_set, val_set, args.out, epochs=args.epochs,
                   batch_size=args.batch_size, accum=args.accum, precision=args.precision,
                   seed=args.seed, ckpt_every=args.ckpt_every, resume=args.resume,
                   crash_at_step=args.crash_at_step)
    print(f"val acc {result['val_acc']:.2%} (best {result['best_acc']:.2%}) "
          f"after {result['steps']} steps")
    return result


if __name__ == "__main__":
    main()
