"""Part 1, the seed's story: one ResNet-50 run stepped through the seed's changes.

fp32 with num_workers=0 -> + bf16 -> + fp16 with GradScaler -> + num_workers=8, pin_memory ->
+ channels_last and torch.compile -> what ``ironloop.tune`` picks on its own from the first
row. Every row trains torchvision's ResNet-50 with ``ironloop.fit`` on the same JPEG-like
images (``shared.Jpegs``: decoded and augmented per sample on the CPU), clipping at 1.0, and
is timed over its steady steps (``shared.SteadyRate``). The figures: images/s, the speed-up
over the first row, the hours the seed's 40 M images would take per epoch at that speed, and
from ironloop's step-time split the shares of step time spent waiting for data and for the
host-to-device copy.

In a dry run (CPU): 32x32 images, a stand-in model without torchvision, 2 workers, compile
disabled (TORCH_COMPILE_DISABLE=1: the compile row runs its code path, not inductor).
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

import ironloop
from benchmarks.gpu_check.shared import Jpegs, Part, SteadyRate, resnet50

#: The seed's dataset: hours per epoch are for this many images.
SEED_IMAGES = 40_000_000
#: ImageNet-1k's training split: the length of the dataset every row reads, so that tune
#: plans for a run of that length (its choice of compile depends on it).
IMAGENET = 1_281_167


def step_fn(channels_last: bool):
    def step(model, batch):
        x, y = batch
        if channels_last:  # NHWC on the device: the layout cuDNN's tensor-core kernels want
            x = x.contiguous(memory_format=torch.channels_last)
        return F.cross_entropy(model(x), y), {}
    return step


def measure(part: Part, make_model, data, config: dict, channels_last: bool, warmup: int,
            steps: int, tmp: Path) -> dict:
    """Train ``warmup + steps`` optimizer steps with ``config``; images/s of the last
    ``steps``."""
    rate = SteadyRate(warmup, warmup + steps)
    model = make_model()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    cfg = {**config, "run.dir": tempfile.mkdtemp(dir=tmp), "train.max_steps": warmup + steps}
    result = ironloop.fit(model, data, None, cfg, step_fn=step_fn(channels_last),
                          callbacks=[rate])
    images = cfg["train.batch_size"] * cfg.get("train.accumulation_steps", 1)
    per_s = images / rate.per_step()
    return {"images_per_s": round(per_s, 1),
            "hours_per_40M_epoch": round(SEED_IMAGES / per_s / 3600, 2),
            "batch": cfg["train.batch_size"], **shares(result.results.get("time_split"))}


def shares(split: dict | None) -> dict:
    """ironloop's step-time split (CUDA events; the whole run, warm-up included): the share
    of step time the GPU waited for the next batch (data) and for its copy (copy: near 0 when
    the pinned non_blocking copy overlaps the step before)."""
    if not split:
        return {}
    step = sum(v for k, v in split.items() if k not in ("checkpoint", "validation"))
    return {"data_wait_share": round(split["data"] / step, 3),
            "copy_share": round(split["copy"] / step, 3)}


class Story:
    """The rows, each on top of the one before; the first row's speed is the 1x."""

    def __init__(self, part: Part):
        self.part, dry = part, part.dry
        self.size, batch, self.workers = (16, 8, 2) if dry else (224, 128, 8)
        self.warmup, self.steps = (1, 2) if dry else (3, 8)  # num_workers=0: seconds a step
        self.make_model, self.model_name = resnet50(dry)
        self.data = Jpegs(512 if dry else IMAGENET, self.size)
        self.base = {"run.device": part.device.type, "train.epochs": 1,
                     "train.batch_size": batch, "train.precision": "fp32",
                     "data.num_workers": 0, "data.pin_memory": False, "clip.max_norm": 1.0,
                     "log.progress": "off", "checkpoint.enabled": False,
                     "doctor.preflight": False}
        self.first: float | None = None

    def warmup_for(self, config: dict) -> int:
        """With workers, the warm-up also drains the 2 x num_workers batches they queue
        before the first step."""
        workers = config.get("data.num_workers", 0)
        return self.warmup if self.part.dry or not workers else 2 * workers + 4

    def row(self, config: dict, channels_last: bool, tmp: Path) -> dict:
        warmup = self.warmup_for(config)
        steps = self.steps if warmup == self.warmup else 3 * self.steps
        got = measure(self.part, self.make_model, self.data, config, channels_last, warmup,
                      steps, tmp)
        self.first = self.first or got["images_per_s"]
        return {**got, "speedup": round(got["images_per_s"] / self.first, 2),
                "model": self.model_name, "image": self.size}

    def tuned(self, tmp: Path) -> dict:
        """``ironloop.tune`` from the first row's config, trajectory changes applied, then
        measured like the other rows."""
        found = ironloop.tune(self.make_model(), self.data, {**self.base, "run.dir":
                                                             str(tmp / "tune")},
                              step_fn=step_fn(False), budget=4.0 if self.part.dry else 100.0,
                              apply_trajectory_changes=True)
        picked = {**found.chosen, **found.trajectory}
        got = self.row({**self.base, **picked}, False, tmp)
        return {**got, "picked": ", ".join(f"{k}={v}" for k, v in picked.items()) or "nothing"}


def main() -> None:
    part = Part("story", __doc__.splitlines()[0])
    if part.dry:
        os.environ["TORCH_COMPILE_DISABLE"] = "1"  # inductor on 2 CPU cores takes minutes
    story = Story(part)
    # (row, overrides on top of the row before, channels_last, seconds it needs at least)
    chain: list[tuple[str, dict, bool, float]] = [("fp32, num_workers=0", {}, False, 10),
             ("+ bf16", {"train.precision": "bf16"}, False, 10),
             ("+ fp16 with GradScaler (in place of bf16)", {"train.precision": "fp16"}, False,
              10),
             (f"+ num_workers={story.workers}, pin_memory", {"data.num_workers": story.workers,
                                                             "data.pin_memory": True}, False,
              10),
             ("+ channels_last, torch.compile", {"train.compile": True}, True, 100)]
    with tempfile.TemporaryDirectory() as d:
        tmp, config = Path(d), dict(story.base)
        for label, overrides, channels_last, need in chain:
            config = {**config, **overrides}
            if config["train.precision"] == "fp16" and not part.cuda:
                part.write(label, "skipped: no CUDA (fp16 autocast is emulated on a CPU)")
                config["train.precision"] = "bf16"  # the rows after it go on in bf16
                continue
            part.attempt(label, partial(story.row, dict(config), channels_last, tmp),
                         need_s=need)
        part.attempt("ironloop tune's pick, from the first row", lambda: story.tuned(tmp),
                     need_s=90)


if __name__ == "__main__":
    main()
