"""The GPU check (issue 20): run it on any machine with a CUDA device.

    python benchmarks/gpu.py [--quick]

1. **Syncs in plain steps**: ``torch.cuda.set_sync_debug_mode("error")`` is armed for every
   plain step (forward, backward, optimizer, the guard's verdict; not the log, settle, epoch-end
   or checkpoint work) in fp32, bf16 and fp16. Any host sync there raises; the row says where.
2. **Throughput** in fp32, bf16 and fp16 on small_cnn and a small ResNet (defined here, no
   torchvision): samples/s of the second epoch, from epochs.jsonl.
3. **Data wait**: the share of step time charged to ``data`` (CUDA events: the GPU idle while
   waiting for the next batch) and to ``copy`` (near 0 with the prefetch) for a loader-bound
   dataset (per-sample ``__getitem__`` with a flip), at ``data.num_workers`` 0 and 4.
4. **Bit-exact resume** under ``torch.use_deterministic_algorithms(True)``: 2 epochs straight
   against 1 epoch + a resume to 2 epochs, final weights compared with ``torch.equal``.

Without CUDA it prints that there is none and exits 0. Prints one JSON object, and a markdown
table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

PRECISIONS = ("fp32", "bf16", "fp16")


class Flipped(Dataset):
    """Loader-bound on purpose: one sample at a time, with a random flip (module level, so the
    workers can pickle it)."""

    def __init__(self, n: int, shape: tuple[int, ...]):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, *shape, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        return (x.flip(-1) if torch.rand(()) < 0.5 else x), self.y[i]


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def resnet(classes: int = 10) -> nn.Module:
    """A ResNet-style net for 3x32x32 inputs: 4 stages of 2 basic blocks (ResNet-18's shape)."""
    torch.manual_seed(0)
    stages, c_in = [], 64
    for c, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [Block(c_in, c, stride), Block(c, c, 1)]
        c_in = c
    return nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def cnn() -> nn.Module:
    from ironloop.tools.models import small_cnn

    torch.manual_seed(0)
    return small_cnn((3, 32, 32), 10)


def _fit(model, data, tmp: Path, **keys):
    import ironloop

    config = {"run.dir": str(tmp / "run"), "run.device": "cuda", "train.batch_size": 128,
              "log.progress": "off", "checkpoint.enabled": False, **keys}
    return ironloop.fit(model, data, None, config, overwrite=True)


def _epochs(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "epochs.jsonl").read_text().splitlines()]


def sync_check(precision: str, tmp: Path) -> dict:
    """Arm sync debug mode "error" on plain steps only; any sync there raises."""
    from ironloop.engine import loop
    from ironloop.engine.run import Run
    from ironloop.engine.train_module import TrainModule

    armed = {"steps": 0}
    originals = loop.after_step, Run.settle, TrainModule.optimizer_step

    def arm():
        torch.cuda.set_sync_debug_mode("error")

    def disarm():
        torch.cuda.set_sync_debug_mode(0)

    def optimizer_step(self, progress, meter, world):
        arm()
        originals[2](self, progress, meter, world)
        armed["steps"] += 1

    def after_step(run, bar):
        if run.settle_due():
            disarm()  # a settle point: the lagged read, the log line, ... are allowed syncs
        try:
            originals[0](run, bar)
        finally:
            disarm()

    def settle(run):
        disarm()
        return originals[1](run)  # type: ignore[call-arg]

    def step_fn(model, batch):  # the forward and backward of every micro-batch run armed
        if model.training:
            arm()
        out = model(batch[0])
        return nn.functional.cross_entropy(out, batch[1]), {}

    loop.after_step, Run.settle, TrainModule.optimizer_step = after_step, settle, optimizer_step  # type: ignore[method-assign]
    try:
        data = Flipped(64 * 40, (3, 32, 32))
        import ironloop

        ironloop.fit(cnn(), data, None, {
            "run.dir": str(tmp / "run"), "run.device": "cuda", "train.batch_size": 64,
            "train.precision": precision, "train.epochs": 1, "log.every_steps": 10,
            "log.progress": "off", "checkpoint.enabled": False}, step_fn=step_fn,
            overwrite=True)
        return {"check": f"no sync in plain steps, {precision}", "ok": True,
                "steps": armed["steps"]}
    except RuntimeError as e:
        return {"check": f"no sync in plain steps, {precision}", "ok": False,
                "error": str(e)[:300], "where": traceback.format_exc().splitlines()[-6:]}
    finally:
        disarm()
        loop.after_step, Run.settle, TrainModule.optimizer_step = originals  # type: ignore[method-assign]


def throughput(name: str, make, shape, precision: str, steps: int, tmp: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    n = 128 * steps
    data = (torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g))
    _fit(make(), data, tmp, **{"train.precision": precision, "train.epochs": 2,
                               "log.every_steps": 50})
    row = _epochs(tmp)[-1]
    return {"model": name, "precision": precision, "samples_per_s": row["samples_per_s"]}


def data_wait(workers: int, steps: int, tmp: Path) -> dict:
    _fit(cnn(), Flipped(128 * steps, (3, 32, 32)), tmp, **{
        "train.epochs": 2, "data.num_workers": workers, "train.precision": "bf16"})
    split = _epochs(tmp)[-1]["time_split"]
    step = sum(split[k] for k in ("data", "copy", "forward", "backward", "optimizer", "other"))
    return {"num_workers": workers, "data_share": split["data"] / step,
            "copy_share": split["copy"] / step}


def resume_exact(tmp: Path) -> dict:
    import ironloop

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        g = torch.Generator().manual_seed(0)
        data = (torch.randn(64 * 20, 3, 32, 32, generator=g),
                torch.randint(0, 10, (64 * 20,), generator=g))
        # A constant LR: a schedule built for 1 epoch and extended to 2 is not the 2-epoch one.
        keys = {"run.device": "cuda", "train.batch_size": 64, "log.progress": "off",
                "train.precision": "bf16", "schedule.name": "constant"}
        whole = ironloop.fit(cnn(), data, None, {**keys, "run.dir": str(tmp / "a"),
                                                 "train.epochs": 2}, overwrite=True)
        ironloop.fit(cnn(), data, None, {**keys, "run.dir": str(tmp / "b"), "train.epochs": 1},
                     overwrite=True)
        resumed = ironloop.fit(cnn(), data, None, {**keys, "run.dir": str(tmp / "b"),
                                                   "train.epochs": 2}, resume=True,
                               allow_config_change=True)
        a, b = whole.model.state_dict(), resumed.model.state_dict()
        return {"check": "bit-exact resume, deterministic algorithms",
                "ok": all(torch.equal(a[k], b[k]) for k in a)}
    finally:
        torch.use_deterministic_algorithms(False)


def table(out: dict) -> str:
    lines = [f"GPU check on {out['gpu']}, torch {out['torch']}", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {c['check']} | {'ok' if c['ok'] else 'FAILED: ' + c.get('error', '')} |"
              for c in out["checks"]]
    lines += ["", "| model | precision | samples/s |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['precision']} | {r['samples_per_s']:.0f} |"
              for r in out["throughput"]]
    lines += ["", "| num_workers | data wait share | copy share |", "|---|---|---|"]
    lines += [f"| {r['num_workers']} | {r['data_share']:.1%} | {r['copy_share']:.1%} |"
              for r in out["data_wait"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing measured. Run it on a machine with a GPU.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    steps = 20 if args.quick else 100
    out = {"gpu": torch.cuda.get_device_name(0), "torch": str(torch.__version__),
           "checks": [], "throughput": [], "data_wait": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for p in PRECISIONS:
            out["checks"].append(sync_check(p, tmp / f"sync-{p}"))
        for name, make, shape in (("small_cnn", cnn, (3, 32, 32)),
                                  ("resnet", resnet, (3, 32, 32))):
            for p in PRECISIONS:
                out["throughput"].append(throughput(name, make, shape, p, steps,
                                                    tmp / f"{name}-{p}"))
        for workers in (0, 4):
            out["data_wait"].append(data_wait(workers, steps // 2, tmp / f"wait-{workers}"))
        out["checks"].append(resume_exact(tmp / "resume"))
    print(json.dumps(out, indent=1))
    print(table(out))
    return 0 if all(c["ok"] for c in out["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
