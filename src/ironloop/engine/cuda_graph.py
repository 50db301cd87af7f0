"""``train.cuda_graph``: the whole optimizer step as one CUDA graph, captured once, replayed.

A small model's step on a GPU is launch-bound: the host queues hundreds of kernels, each a few
microseconds of work. Captured, the window's forward, loss and backward (every micro-batch of
an accumulation window), the grad norm, the guard's on-device verdict, the clip and the masked
optimizer step are one ``CUDAGraph.replay()``. The order, as ``TrainModule.optimizer_step``::

    [copy the window's batches into the graph's static inputs]          eager, device to device
    [write schedule LR x guard LR factor into each group's LR tensor]   eager: fill_, no sync
    replay:  for each micro-batch: loss = step_fn(model, batch); backward(loss * n / window)
             grad_norm -> ok = guard verdict (isfinite) -> clip(where(ok, norm, 0))
             optimizer.step() with found_inf = !ok      (the fused kernel skips a bad step)
    [meter, guard.check, scheduler.step(), progress]                     eager, as unfused

The first ``WARMUP`` windows run eager (torch's rule: warm up before capture, so that lazily
made state, the optimizer's and cuBLAS's, exists), the first of them under ``HostReadTrap``: a
step function that reads a device value on the host (``.item()``, ``bool(t)``, ...) cannot be
captured and is refused there, naming the line. A window whose shapes differ from the captured
one (an epoch's ragged last window) runs eager, the same code uncaptured; a third distinct
shape means the shapes are dynamic and is refused. Off CUDA (the tests) nothing is captured
and every window runs the same body eager.

Everything the graph touches is static: the LR is a device tensor per group (a Python float
would be baked in at capture), the outputs are cloned before the host keeps them, and after the
capture the gradients are the graph's and are never set to None (``TrainModule.zero_grad``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ironloop.engine.gradients import clip_to_norm, grad_norm_of
from ironloop.engine.step_fns import unpack
from ironloop.errors import ConfigError, UserError
from ironloop.guard.verdict import masked_step, takes_found_inf

#: Eager windows before the capture (torch's examples warm up 3 iterations; DDP needs 11).
WARMUP = 3
#: Distinct window shapes a run may have: the full window and an epoch's ragged last one.
MAX_SHAPES = 2
HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy"}
TORCH_DIR = str(Path(torch.__file__).parent)
#: Device types a run may ask to capture on. Off CUDA nothing is captured: the tests add "cpu"
#: to run the same windows eager through the loop.
DEVICES = ("cuda",)


def refusal(cfg, device: torch.device, optimizer: torch.optim.Optimizer, world,
            stateful: bool, closure: bool) -> str | None:
    """Why this run's step cannot be captured, as '<key=value>: why; the fix', or None."""
    train, guard = cfg.train, cfg.guard
    name = type(optimizer).__name__
    fused = all(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    return (
        f"run.device={device.type}: a CUDA graph needs a CUDA device; set run.device=cuda"
        if device.type not in DEVICES else
        "train.compile=true: torch.compile captures its own graphs (compile_mode="
        "reduce-overhead); set train.compile=false" if train.compile else
        f"optim.name={cfg.optim.name}: {name} takes a closure (step(closure)), which a graph "
        f"cannot re-run; use another optimizer" if closure else
        f"{world.size} processes: the collectives of DDP/FSDP are not captured here; train "
        f"in one process" if world.size > 1 else
        "train.precision=fp16: GradScaler grows its scale on the host; use train.precision="
        "bf16" if train.precision == "fp16" else
        "a stateful step (step(model, batch, state)): its state moves between batches; carry "
        "the state in the model" if stateful else
        f"guard.spike_factor={guard.spike_factor}: the spike statistics rebind their tensors "
        f"every step; set guard.spike_factor=0" if guard.enabled and guard.spike_factor else
        f"optim.fused: {name} is not fused (nor capturable), its step count on the host; set "
        f"optim.fused=true" if not fused else
        f"optim.fused: {name} takes no on-device found_inf, so the guard would read its "
        f"verdict on the host; use adamw, adam or sgd with optim.fused=true"
        if guard.enabled and not takes_found_inf(optimizer) else None)


def check(cfg, device: torch.device, optimizer: torch.optim.Optimizer, world, stateful: bool,
          closure: bool) -> None:
    """Refuse, before training, a run with ``train.cuda_graph=true`` that cannot capture."""
    why = refusal(cfg, device, optimizer, world, stateful, closure)
    if why is not None:
        raise ConfigError(f"train.cuda_graph=true cannot capture this run's step, {why} (or "
                          f"set train.cuda_graph=false)")


class HostReadTrap(TorchFunctionMode):
    """Raises on a host read of a device value made outside torch itself: what a captured
    step cannot do (the read would see the capture's placeholder, not this step's value)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            frame = sys._getframe(1)
            if not frame.f_code.co_filename.startswith(TORCH_DIR):
                raise UserError(
                    f"train.cuda_graph=true: the step reads a device value on the host "
                    f"({func.__name__} at {frame.f_code.co_filename}:{frame.f_lineno}), which "
                    f"a CUDA graph cannot capture; keep the step's values on the device, or "
                    f"set train.cuda_graph=false")
        return func(*args, **(kwargs or {}))


@dataclass
class Out:
    """What one window leaves on the device: static under a graph, overwritten by the next."""

    losses: list[torch.Tensor]   # each micro-batch's loss (detached)
    weights: list[Any]           # each micro-batch's weight (tokens), or None
    norm: torch.Tensor           # the pre-clip grad norm
    clipped: torch.Tensor        # whether the clip acted


class StepGraph:
    """The window's device work (``body``), run eager for the warm-up, then captured once per
    shape and replayed; the host's bookkeeping (``account``) after it, eager, every window."""

    def __init__(self, module, capture: bool | None = None):
        self.module = module
        self.capture = module.device.type == "cuda" if capture is None else capture
        self.batches: list = []          # this window's (batch, n_micro)
        self.windows = 0                 # windows run so far (the warm-up counts them)
        self.graphs: dict[tuple, tuple[Any, list, Out]] = {}  # shape -> (graph, inputs, out)
        self.shapes: set[tuple] = set()
        self.captured = False            # the gradients belong to a graph from now on
        groups = module.optimizer.param_groups
        self.lrs = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=module.device)
                    for g in groups]

    def collect(self, batch, n_micro: int) -> None:
        """One micro-batch of the window (the loop calls ``step`` after the last)."""
        self.batches.append((batch, n_micro))

    def step(self, progress, meter, world, window: int) -> None:
        """The window's optimizer step: warm-up eager, then replay; then the bookkeeping."""
        batches, self.batches = self.batches, []
        shape = signature(batches, window)
        self.shapes.add(shape)
        if len(self.shapes) > MAX_SHAPES:
            raise UserError(f"train.cuda_graph=true: the batches change shape from window to "
                            f"window ({len(self.shapes)} shapes so far), which a graph cannot "
                            f"replay; pad them to one shape, or set train.cuda_graph=false")
        self._write_lr()
        if not self.capture or self.windows < WARMUP or (self.captured and
                                                          shape not in self.graphs):
            out = self._eager(batches, window, world)
        else:
            out = self._replay(shape, batches, window, world)
        if self.windows == 0 and any(w is not None for w in out.weights) and \
                len(batches) * world.size > 1:
            raise UserError("train.cuda_graph=true: the step returns a weight (tokens), which "
                            "the graph does not weight windows by; set train.accumulation_steps"
                            "=1, or train.cuda_graph=false")
        self.windows += 1
        self.account(out, [n for _, n in batches], progress, meter, world)

    def _write_lr(self) -> None:
        """The schedule's LR times the guard's factor into the device LRs: a kernel each, no
        sync; the param groups keep their float LR (schedulers, checkpoints)."""
        factor = self.module.lr_factor
        for lr, group in zip(self.lrs, self.module.optimizer.param_groups):
            lr.fill_(float(group["lr"]) * factor)

    def _eager(self, batches: list, window: int, world) -> Out:
        if self.captured:  # the graph's gradients, zeroed in place: never None after capture
            torch._foreach_zero_([p.grad for p in self.module.params if p.grad is not None])
        if self.windows == 0:  # the first window: refuse a step that reads on the host
            with HostReadTrap():
                return self.body(batches, window, world)
        if self.capture:  # torch's rule: warm up on a side stream
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.body(batches, window, world)
            torch.cuda.current_stream().wait_stream(side)
            return out
        return self.body(batches, window, world)

    def _replay(self, shape: tuple, batches: list, window: int, world) -> Out:
        if shape not in self.graphs:
            self._capture(shape, batches, window, world)
        graph, inputs, out = self.graphs[shape]
        leaves = tree_flatten([b for b, _ in batches])[0]
        for static, leaf in zip(inputs, leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(leaf, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, shape: tuple, batches: list, window: int, world) -> None:
        """Capture the window once: the gradients are None here, so the first backward
        allocates them in the graph's pool and every replay overwrites them."""
        leaves, spec = tree_flatten([b for b, _ in batches])
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static = [(b, n) for b, (_, n) in zip(tree_unflatten(inputs, spec), batches)]
        self.module.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            out = self.body(static, window, world)
        self.graphs[shape] = (graph, inputs, out)
        self.captured = True

    def body(self, batches: list, window: int, world) -> Out:
        """The device work of one window, with no host read and the same allocations every
        time: what is captured. The order of ``TrainModule.optimizer_step``."""
        module, guard = self.module, self.module.verdicts
        losses, weights, window_sum = [], [], None
        for batch, n_micro in batches:
            with module.autocast():
                loss, _, weight = unpack(module.step_fn(module.model, batch))
            scale = n_micro * world.size / window  # a Python float: fixed for a shape
            (loss if scale == 1.0 else loss * scale).backward()
            loss = loss.detach()
            losses.append(loss)
            weights.append(weight)
            window_sum = loss * n_micro if window_sum is None else window_sum + loss * n_micro
        params = [p for p in module.params if p.grad is not None]
        norm = grad_norm_of(params)
        ok = None if guard is None else guard.judge.verdict(window_sum, window_sum, norm,
                                                            window, None, world)
        clip_norm = norm if ok is None or module.clip.mode != "norm" else \
            torch.where(ok, norm, 0.0)  # a bad step is not clipped (as optimizer_step)
        clipped = clip_to_norm(params, clip_norm, module.clip.max_norm, module.clip.mode)
        with device_lr(module.optimizer, self.lrs):
            if ok is not None:
                masked_step(module.optimizer, None, ok, guard.judge.found_inf(ok))
            else:
                module.optimizer.step()
        return Out(losses, weights, norm, clipped)

    def account(self, out: Out, sizes: list[int], progress, meter, world) -> None:
        """The host's side of the step, eager: the meter, the guard's pending verdict (the
        same formula on the meter's running total: equal to the graph's while that total is
        finite, which the guard keeps it), the scheduler, the counters. The graph's outputs
        are cloned: the next replay overwrites them, and the meter and guard keep theirs."""
        module, guard = self.module, self.module.verdicts
        for loss, n, weight in zip(out.losses, sizes, out.weights):
            meter.add_micro(loss.clone(), n, weight)
        norm, clipped = out.norm.clone(), out.clipped.clone()
        ok = None if guard is None else guard.check(meter, norm, progress.offset, None, world)
        module.lr = float(module.optimizer.param_groups[0]["lr"]) * module.lr_factor
        module.step_schedule(progress.step)  # after optimizer.step, once per optimizer step
        progress.step += 1
        meter.add_step(norm, clipped, None, ok)


class device_lr:
    """Each param group's LR as its device tensor for the duration of ``optimizer.step``: the
    fused kernels read the tensor, so a replay takes the LR written before it."""

    def __init__(self, optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor]):
        self.groups, self.lrs = optimizer.param_groups, lrs
        self.saved: list = []

    def __enter__(self) -> None:
        self.saved = [g["lr"] for g in self.groups]
        for g, lr in zip(self.groups, self.lrs):
            g["lr"] = lr

    def __exit__(self, *exc) -> None:
        for g, lr in zip(self.groups, self.saved):
            g["lr"] = lr


def signature(batches: list, window: int) -> tuple:
    """A window's shape: each leaf's shape and dtype (a value for a non-tensor), the sizes."""
    leaves = tree_flatten([b for b, _ in batches])[0]
    return (window, tuple(n for _, n in batches),
            tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                  for x in leaves))


def build(cfg, module, world, closure: bool) -> StepGraph | None:
    """The run's StepGraph with ``train.cuda_graph=true`` (refused here if it cannot
    capture), else None: the eager step, unchanged."""
    if not cfg.train.cuda_graph:
        return None
    check(cfg, module.device, module.optimizer, world, module.carry is not None, closure)
    return StepGraph(module)

