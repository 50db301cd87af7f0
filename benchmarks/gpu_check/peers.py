"""Part 3, ironloop against a hand-written CUDA loop, Lightning and Accelerate, in one run.

Two models: torchvision's ResNet-50 on 224x224 images held in memory (the loop's own cost, not
the decode's), and the char transformer of ``configs/char_gpt.yaml`` (its model, context,
batch and AdamW settings) on random bytes. Every loop trains the same model in bf16 autocast
with fused AdamW (no decay on biases and norm gains) and clipping at 1.0:

- ``hand``: ``DataLoader(shuffle, pin_memory)``, ``.to(device, non_blocking=True)``, autocast,
  backward, ``clip_grad_norm_``, step: the loop a person writes;
- ``ironloop``: ``ironloop.fit`` with checkpoints and the preflight off (as no peer has them),
  its defaults otherwise (a log line every 10 steps, guard and step-time split on); and the
  same with the guard and the step-time split off (not a peer: what those two cost);
- ``Lightning``: ``Trainer(precision="bf16-mixed")``, logger, checkpoints, bar and summary off,
  clipping in ``configure_gradient_clipping`` (its ``gradient_clip_val`` refuses a fused
  optimizer under mixed precision);
- ``Accelerate``: ``Accelerator(mixed_precision="bf16")`` with its ``prepare``, ``backward``
  and ``clip_grad_norm_``.

As in ``benchmarks/peers.py``: each repetition times every loop for 1 epoch and for LONG epochs
in a rotated order, the device synced at the end of each; the steady step time is
``(t(LONG) - t(1)) / (LONG - 1)`` per epoch over its steps, and each loop's ratio to the hand
loop is taken per repetition, then its median. MFU: the FLOPs of one step (torch's
FlopCounterMode) per steady step time, over the dense bf16 peak (``shared.PEAKS``).
A dry run (CPU): fp32, a stand-in CNN on 32x32 images, a few steps.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ironloop
from benchmarks.gpu_check.shared import Part, peak_flops, resnet50, sync, train_flops

REPO = Path(__file__).resolve().parents[2]
LR, CLIP = 1e-3, 1.0


@dataclass
class Spec:
    name: str
    make_model: Callable[[], nn.Module]
    dataset: TensorDataset | Dataset  # sized: a TensorDataset or char_gpt's Windows
    batch: int
    items: int                     # images or tokens in one batch
    unit: str                      # "images" or "tokens"
    loss: Callable                 # loss(model, (x, y)) -> scalar
    step_fn: Callable | None       # ironloop's step_fn (None: its (inputs, targets) step)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)

    @property
    def steps(self) -> int:
        """Optimizer steps in one epoch (the last batch ragged)."""
        return -(-len(self.dataset) // self.batch)  # type: ignore[arg-type]


@dataclass
class Env:
    device: torch.device
    dtype: torch.dtype | None      # autocast dtype; None = fp32
    tmp: Path


def classify(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def next_byte(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())


def adamw(model: nn.Module, spec: Spec) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=spec.betas, fused=True)


# ------------------------------------------------------------------------------ the loops --
def hand(spec: Spec, epochs: int, env: Env) -> None:
    model = spec.make_model().to(env.device)
    opt = adamw(model, spec)
    loader = DataLoader(spec.dataset, batch_size=spec.batch, shuffle=True,
                        pin_memory=env.device.type == "cuda",
                        generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(env.device.type, dtype=env.dtype, enabled=env.dtype is not None):
                loss = spec.loss(model, (x, y))
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()


def with_ironloop(spec: Spec, epochs: int, env: Env, **extra) -> None:
    precision = {torch.bfloat16: "bf16", None: "fp32"}[env.dtype]
    ironloop.fit(spec.make_model(), spec.dataset, None, {
        "run.dir": tempfile.mkdtemp(dir=env.tmp), "run.device": env.device.type,
        "train.epochs": epochs, "train.batch_size": spec.batch, "train.precision": precision,
        "optim.lr": LR, "optim.weight_decay": spec.weight_decay, "optim.betas": list(spec.betas),
        "clip.max_norm": CLIP, "log.progress": "off", "checkpoint.enabled": False,
        "doctor.preflight": False, **extra}, step_fn=spec.step_fn)


def with_lightning(spec: Spec, epochs: int, env: Env) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, model: nn.Module):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return spec.loss(self.model, batch)

        def configure_optimizers(self):
            return adamw(self.model, spec)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            # Lightning's own clipping (gradient_clip_val) refuses a fused optimizer under
            # mixed precision ("performs unscaling of gradients internally"); bf16 has no
            # scaler, so clipping the gradients as they are is what the others do.
            nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)

    cuda = env.device.type == "cuda"
    trainer = L.Trainer(max_epochs=epochs, accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-mixed" if env.dtype else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(env.tmp))
    loader = DataLoader(spec.dataset, batch_size=spec.batch, shuffle=True, pin_memory=cuda,
                        generator=torch.Generator().manual_seed(0))
    trainer.fit(Module(spec.make_model()), loader)


def with_accelerate(spec: Spec, epochs: int, env: Env) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=env.device.type != "cuda",
                              mixed_precision="bf16" if env.dtype else "no")
    model = spec.make_model()
    opt = adamw(model, spec)
    loader = DataLoader(spec.dataset, batch_size=spec.batch, shuffle=True,
                        pin_memory=env.device.type == "cuda",
                        generator=torch.Generator().manual_seed(0))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    for _ in range(epochs):
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            with accelerator.autocast():
                loss = spec.loss(model, batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()


#: Not a peer: ironloop with its guard and step-time split off, which says what those cost
#: (the verdict compares the default "ironloop" only).
BARE = "ironloop, guard and split off"
LOOPS = {"hand": (hand, None), "ironloop": (with_ironloop, None),
         BARE: (partial(with_ironloop, **{"guard.enabled": False,
                                          "profile.breakdown": False}), None),
         "Lightning": (with_lightning, "lightning"), "Accelerate": (with_accelerate, "accelerate")}


# ---------------------------------------------------------------------------- the models --
def resnet_spec(dry: bool) -> Spec:
    make, _ = resnet50(dry)
    size, batch, steps = (32, 8, 3) if dry else (224, 64, 20)
    g = torch.Generator().manual_seed(0)
    n = batch * steps
    data = TensorDataset(torch.randn(n, 3, size, size, generator=g),
                         torch.randint(0, 1000, (n,), generator=g))
    return Spec("resnet50", make, data, batch, batch, "images", classify, None)


def char_gpt_spec(dry: bool) -> Spec:
    """configs/char_gpt.yaml's model, context, batch and AdamW, on random bytes."""
    sys.path.insert(0, str(REPO))
    from examples import char_gpt

    cfg = yaml.safe_load((REPO / "configs" / "char_gpt.yaml").read_text())
    block = cfg["data"]["kwargs"]["block_size"]
    batch = 8 if dry else cfg["train"]["batch_size"]
    steps = 3 if dry else 50
    tokens = torch.randint(0, char_gpt.VOCAB, (batch * steps + block,),
                           generator=torch.Generator().manual_seed(0))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return char_gpt.gpt(block_size=block, **cfg["model"]["kwargs"])

    return Spec("char_gpt", make, char_gpt.Windows(tokens, block), batch, batch * block,
                "tokens", next_byte, char_gpt.step, cfg["optim"]["weight_decay"],
                tuple(cfg["optim"]["betas"]))


# ----------------------------------------------------------------------------- measuring --
def _installed(module: str | None) -> bool:
    try:
        if module:
            __import__(module)
        return True
    except Exception:  # noqa: BLE001 - Lightning's import fails outright with a broken torchvision
        return False


def _time(fn: Callable, spec: Spec, epochs: int, env: Env) -> float:
    start = time.perf_counter()
    fn(spec, epochs, env)
    sync(env.device)
    return time.perf_counter() - start


def measure(spec: Spec, loops: dict, reps: int, long: int, env: Env, warm_up: bool,
            failed: dict[str, str]) -> dict[str, list[float]]:
    """Steady seconds per epoch of each loop, one value per repetition (rotated order). A loop
    that raises is dropped, its error in ``failed``; the others go on."""
    names = list(loops)

    def call(name: str, epochs: int) -> float | None:
        try:
            return _time(loops[name], spec, epochs, env)
        except Exception as e:  # noqa: BLE001 - one broken peer must not hide the others
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            names.remove(name)
            return None

    for name in list(names) if warm_up else ():  # imports, cuDNN's and the allocator's firsts
        call(name, 1)
    steady: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            one = call(name, 1)
            many = call(name, long) if one is not None else None
            if many is not None and one is not None:
                steady[name].append((many - one) / (long - 1))
    return {name: values for name, values in steady.items() if name in names}


def profile(spec: Spec, env: Env, names: tuple[str, ...] = ("hand", "ironloop")) -> None:
    """Into the log (not a row): torch.profiler's kernels and host ops of one epoch of each of
    ``names``, so that a gap between them can be read off the device time by kernel (a kernel
    one loop runs and the other does not, or the same kernels slower) and the host time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda"
                                           else [])
    steps = spec.steps
    device_sort = "cuda_time_total" if env.device.type == "cuda" else "cpu_time_total"
    for name in names:
        with torch_profile(activities=activities) as prof:
            _time(LOOPS[name][0], spec, 1, env)
        print(f"\n----- profile of {spec.name}: {name}, one epoch ({steps} steps), by device "
              f"time -----")
        print(prof.key_averages().table(sort_by=device_sort, row_limit=22,
                                        max_name_column_width=60))
        print(f"----- profile of {spec.name}: {name}, by host time (self) -----")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22,
                                        max_name_column_width=60))


def run_spec(part: Part, make_spec: Callable[[], Spec], env: Env, reps: int,
             long: int) -> Spec:
    spec = make_spec()
    loops = {name: fn for name, (fn, module) in LOOPS.items() if _installed(module)}
    for name in LOOPS.keys() - loops.keys():
        part.write(f"{spec.name}: {name}", f"skipped: {LOOPS[name][1]} is not importable")
    steps = spec.steps
    x, y = next(iter(DataLoader(spec.dataset, batch_size=spec.batch)))
    flops = train_flops(spec.make_model(), (x.to(env.device), y.to(env.device)), spec.loss,
                        env.device, env.dtype)
    peak = peak_flops(part.device_name) if env.dtype is torch.bfloat16 else None
    failed: dict[str, str] = {}
    steady = measure(spec, loops, reps, long, env, not part.dry, failed)
    for name, error in failed.items():
        part.write(f"{spec.name}: {name}", f"failed: {error}")
    for needed in ("hand", "ironloop"):
        if needed not in steady:
            raise RuntimeError(f"the {needed} loop failed ({failed.get(needed)}): no ratio")
    for name in steady:
        ratios = [a / b for a, b in zip(steady[name], steady["hand"])]
        step_s = statistics.median(steady[name]) / steps
        part.write(f"{spec.name}: {name}", "ok", ms_per_step=round(1e3 * step_s, 3),
                   ratio_to_hand=round(statistics.median(ratios), 4),
                   ratio_min_max=[round(min(ratios), 4), round(max(ratios), 4)],
                   **{f"{spec.unit}_per_s": round(spec.items / step_s, 1)},
                   mfu=round(flops / step_s / peak, 4) if peak else None,
                   steps_per_epoch=steps, batch=spec.batch, reps=reps)
    verdict = {f"ironloop / {peer}": round(statistics.median(
        [a / b for a, b in zip(steady["ironloop"], steady[peer])]), 4)
        for peer in ("hand", "Lightning", "Accelerate") if peer in steady}
    met = verdict["ironloop / hand"] <= 1.02 and all(
        v < 1.0 for k, v in verdict.items() if k != "ironloop / hand")
    part.write(f"{spec.name}: verdict (goal: <= 1.02x the hand loop, ahead of both peers)",
               "ok" if part.cuda else "skipped: no CUDA (dry-run figures mean nothing)",
               **verdict, met=met if part.cuda else None)
    return spec


def main() -> None:
    part = Part("peers", __doc__.splitlines()[0])
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    reps, long = (1, 2) if part.dry else (3, 3)
    with tempfile.TemporaryDirectory() as d:
        env = Env(part.device, torch.bfloat16 if part.cuda else None, Path(d))
        measured = {}
        for make_spec, need in ((resnet_spec, 50), (char_gpt_spec, 30)):
            name = make_spec.__name__.removesuffix("_spec")
            measured[name] = part.guarded(name, partial(run_spec, part, partial(
                make_spec, part.dry), env, reps, long), need_s=need)
        # Last, in the time left (it cost the first H200 run its char_gpt rows when it ran
        # between the two): the log only, for a gap between ironloop and the hand loop.
        if measured["resnet"] is not None and (part.dry or part.left() > 40):
            try:
                profile(measured["resnet"], env)
            except Exception:  # noqa: BLE001 - a diagnosis must not fail the rows above
                traceback.print_exc()


if __name__ == "__main__":
    main()
