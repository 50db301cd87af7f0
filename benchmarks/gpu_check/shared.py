"""What the parts of ``scripts/gpu-check`` share: the row file, the device, the JPEG-like
images, ResNet-50, and a callback that times the steady steps.

Each part is a module run as ``python -m benchmarks.gpu_check.PART --rows FILE --deadline T
[--dry-run]``: it appends one JSON row per line to FILE as soon as the row is measured, so a
part killed at its time cap still leaves the rows it finished. A row is ``{"part", "row",
"device", "status", "figures"}``; ``status`` is "ok", "skipped: ..." or "failed: ...".
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from ironloop.callbacks import Callback

#: Dense bf16 peak of an H100 or H200 SXM by the datasheet (989 TFLOP/s): the MFU's
#: denominator. KINDS.md measured about 790 on these machines' 8192^3 matrix product.
PEAKS = {"H100": 989e12, "H200": 989e12}


class Part:
    """One part's run: its arguments, its row file, its deadline."""

    def __init__(self, name: str, description: str):
        parser = argparse.ArgumentParser(description=description)
        parser.add_argument("--rows", required=True, help="append JSON rows to this file")
        parser.add_argument("--deadline", type=float, required=True,
                            help="time.time() by which the part must have finished")
        parser.add_argument("--dry-run", action="store_true",
                            help="tiny sizes on whatever device there is (CPU in CI)")
        args = parser.parse_args()
        self.name, self.rows, self.deadline, self.dry = name, Path(args.rows), args.deadline, \
            args.dry_run
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.device_name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self._fault(os.environ.get("GPU_CHECK_FAULT", ""))

    def _fault(self, spec: str) -> None:
        """GPU_CHECK_FAULT=PART:crash|hang: the test of the isolation between parts."""
        faults = dict(f.split(":", 1) for f in spec.split(",") if ":" in f)
        if faults.get(self.name) == "crash":
            raise SystemExit(f"GPU_CHECK_FAULT: {self.name} crashes on purpose")
        if faults.get(self.name) == "hang":
            while time.time() < self.deadline + 600:  # until the cap's kill, bounded
                time.sleep(0.1)

    def left(self) -> float:
        return self.deadline - time.time()

    def write(self, row: str, status: str = "ok", **figures) -> None:
        line = {"part": self.name, "row": row, "device": self.device_name, "status": status,
                "figures": figures}
        with self.rows.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def attempt(self, row: str, fn: Callable[[], dict], need_s: float = 0.0,
                needs_cuda: bool = False, cpu_status: str = "ok") -> dict | None:
        """Measure one row: ``fn()`` returns its figures. A failure is written as the row's
        status and the part goes on; so is a row that would start with less than ``need_s``
        seconds left, or that needs CUDA where there is none. ``cpu_status`` is the status of
        a row that ran without CUDA but whose verdict needs it. Figures with a ``problem``
        (a verdict not met) make the row failed, with CUDA or without."""
        figures = self.guarded(row, fn, need_s, needs_cuda)
        if figures is not None:
            problem = figures.pop("problem", None)
            status = f"failed: {problem}" if problem else "ok" if self.cuda else cpu_status
            self.write(row, status, **figures)
        return figures

    def guarded(self, row: str, fn: Callable, need_s: float = 0.0, needs_cuda: bool = False):
        """``fn()``'s result, or None after writing the row as skipped or failed. For a ``fn``
        that writes its own rows, ``row`` names them all."""
        if needs_cuda and not self.cuda:
            self.write(row, "skipped: no CUDA")
            return None
        if not self.dry and self.left() < need_s:  # a dry run's sizes need seconds
            self.write(row, f"skipped: out of time ({self.left():.0f} s left, needs "
                            f"{need_s:.0f})")
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failed row must not stop the others
            traceback.print_exc()
            first = str(e).splitlines()[0][:300] if str(e) else ""
            self.write(row, f"failed: {type(e).__name__}: {first}")
            return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAKS.items() if k in device_name), None)


class SteadyRate(Callback):
    """Seconds of optimizer steps ``warmup+1 .. last``: the device is synced at step
    ``warmup`` and at ``last`` (two host syncs in the run, both outside the timed steps'
    own work), so queued GPU work is inside the window on both ends."""

    def __init__(self, warmup: int, last: int):
        self.warmup, self.last = warmup, last
        self.start: float | None = None
        self.seconds: float | None = None

    def on_step_end(self, run, metrics: dict) -> None:
        if metrics["step"] == self.warmup:
            sync(run.device)
            self.start = time.perf_counter()
        elif metrics["step"] == self.last and self.start is not None:
            sync(run.device)
            self.seconds = time.perf_counter() - self.start

    def per_step(self) -> float:
        if self.seconds is None:
            raise RuntimeError(f"the run ended before step {self.last}: nothing timed")
        return self.seconds / (self.last - self.warmup)


# --------------------------------------------------------------------------- the images --
class Jpegs(Dataset):
    """Synthetic photos read the way a JPEG pipeline reads them: each ``__getitem__`` decodes
    a 256x256 JPEG with PIL, takes a random resized crop to ``size``, flips at random and
    normalises, on the CPU. ``n`` may exceed the ``distinct`` encoded images (they repeat),
    so a dataset of ImageNet's length costs no memory. The randomness comes from ``random``,
    which ironloop seeds per sample (data.seed_samples)."""

    MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def __init__(self, n: int, size: int, distinct: int = 64, classes: int = 1000):
        from PIL import Image

        g = torch.Generator().manual_seed(0)
        self.n, self.size = n, size
        self.blobs, self.labels = [], torch.randint(0, classes, (distinct,), generator=g)
        for _ in range(distinct):  # smooth shapes plus grain: JPEG-sized, not noise-sized
            low = torch.rand(3, 8, 8, generator=g)
            img = nn.functional.interpolate(low[None], size=256, mode="bicubic")[0]
            img = (img + 0.05 * torch.randn(3, 256, 256, generator=g)).clamp(0, 1)
            pixels = (img.permute(1, 2, 0) * 255).to(torch.uint8).numpy()
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
            self.blobs.append(buf.getvalue())
        self.mean = torch.tensor(self.MEAN).view(3, 1, 1)
        self.std = torch.tensor(self.STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        from PIL import Image

        k = i % len(self.blobs)
        img = Image.open(io.BytesIO(self.blobs[k])).convert("RGB")  # the decode
        side = img.width * random.uniform(0.35, 1.0) ** 0.5
        x0, y0 = random.uniform(0, img.width - side), random.uniform(0, img.height - side)
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR,
                         box=(x0, y0, x0 + side, y0 + side))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        x = x.view(self.size, self.size, 3).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std, self.labels[k]


# ---------------------------------------------------------------------------- the model --
def resnet50(dry: bool) -> tuple[Callable[[], nn.Module], str]:
    """torchvision's ResNet-50 (1000 classes), and its name. In a dry run without torchvision
    (none on the CPU machines: it breaks Lightning there) a two-block stand-in takes its place;
    a real run without it fails here, by name."""
    try:
        from torchvision.models import resnet50 as tv_resnet50
    except ImportError:
        if not dry:
            raise RuntimeError("torchvision is not importable: the seed's ResNet-50 comes from "
                               "it (python3 -m pip show torchvision)") from None
        return stand_in, "stand-in CNN (dry run: no torchvision)"

    def make() -> nn.Module:
        torch.manual_seed(0)
        return tv_resnet50(num_classes=1000)

    return make, "torchvision resnet50"


def stand_in() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))


def train_flops(model: nn.Module, batch, loss_fn, device: torch.device,
                dtype: torch.dtype | None) -> int:
    """FLOPs of one forward and backward of ``batch``, counted by torch's FlopCounterMode
    (matrix products and convolutions) on a copy of the model."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    clone = copy.deepcopy(model).to(device)
    with FlopCounterMode(display=False) as counter, \
            torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss_fn(clone, batch).backward()
    return counter.get_total_flops()
