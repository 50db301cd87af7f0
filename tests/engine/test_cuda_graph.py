"""engine/cuda_graph.py on the CPU: the step a graph captures is capture-safe (no host read,
the same ops and allocations every steady window), it trains as the eager step does, the guard
skips a non-finite window inside it, and what cannot be captured is refused before training.

On the CPU nothing is captured (``StepGraph(capture=False)``): the same body runs eager, so a
CUDA run is not the first time it executes.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ironloop
from ironloop.config import ClipConfig, Config, GuardConfig
from ironloop.engine import cuda_graph
from ironloop.engine.cuda_graph import HOST_READS, TORCH_DIR, StepGraph
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.train_module import TrainModule
from ironloop.errors import ConfigError, UserError
from ironloop.guard.verdict import device_verdicts
from ironloop.parallel.world import World
from tests.conftest import blobs, cfg, tiny_mlp

BATCH, STEPS = 8, 6
WORLD = World()


class RaiseOnHostRead(torch.overrides.TorchFunctionMode):
    """Any host read of a tensor made outside torch's own files raises."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not sys._getframe(1).f_code.co_filename.startswith(TORCH_DIR):
            raise AssertionError(f"host read in the step: {name}")
        return func(*args, **(kwargs or {}))


class RecordOps(TorchDispatchMode):
    """Every aten op of the step with its outputs' shapes and dtypes: the allocations."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), tuple((tuple(t.shape), t.dtype) for t in flat
                                          if isinstance(t, torch.Tensor))))
        return out


def step_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y), {}


def parts(guard=True, max_norm=1.0, fn=step_fn):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    device = torch.device("cpu")
    verdicts = device_verdicts(GuardConfig(), device, torch.float64) if guard else None
    module = TrainModule(model=model, raw_model=model, optimizer=opt, scheduler=sched,
                         schedule_on="step", scaler=None, step_fn=fn, carry=None, device=device,
                         precision="fp32", clip=ClipConfig(max_norm=max_norm), total_steps=99,
                         verdicts=verdicts)
    meter, progress = Meter(device), Progress()
    if verdicts is not None:
        verdicts.start(opt, always=False)
        verdicts.rebase(meter, 0)
    return module, meter, progress


def batches(n: int, accum: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
             for _ in range(accum)] for _ in range(n)]


def graphed_window(graph: StepGraph, module, meter, progress, window: list) -> None:
    """One window through the graph's path, as the loop drives it."""
    module.zero_grad()
    for batch in window:
        progress.offset += BATCH
        graph.collect(batch, BATCH)
    graph.step(progress, meter, WORLD, BATCH * len(window))


@pytest.mark.parametrize("accum", [1, 2])
def test_the_steady_step_is_capture_safe(accum):
    """No host read, and the same ops with the same output shapes in every steady window:
    a graph captured from one window replays every other."""
    module, meter, progress = parts()
    graph = StepGraph(module, capture=False)
    per_window = []
    for window in batches(STEPS, accum):
        with RaiseOnHostRead(), RecordOps() as rec:
            graphed_window(graph, module, meter, progress, window)
        per_window.append(rec.ops)
    assert len(per_window[1]) > 20  # forward, backward, norm, verdict, clip, fused AdamW
    assert any("_fused_adamw" in op for op, _ in per_window[1])
    # the first window makes the optimizer's state; every later one is the same
    assert all(ops == per_window[1] for ops in per_window[2:])


def test_the_safety_check_sees_a_host_read_and_a_varying_allocation():
    """The test above can fail: a step function that reads a value, or that allocates by the
    step, is caught by the same instruments."""
    def reads(model, batch):
        loss = step_fn(model, batch)[0]
        return loss * (1.0 if loss.item() > 0 else 2.0), {}

    module, meter, progress = parts(fn=reads)
    graph = StepGraph(module, capture=False)
    graph.windows = 1  # past the graph's own trap: the test's instrument must see it
    with pytest.raises(AssertionError, match="host read"), RaiseOnHostRead():
        graphed_window(graph, module, meter, progress, batches(1)[0])

    counter = iter(range(1, 99))

    def grows(model, batch):
        return step_fn(model, batch)[0] + torch.zeros(next(counter)).sum(), {}

    module, meter, progress = parts(fn=grows)
    graph, per_window = StepGraph(module, capture=False), []
    for window in batches(3):
        with RecordOps() as rec:
            graphed_window(graph, module, meter, progress, window)
        per_window.append(rec.ops)
    assert per_window[2] != per_window[1]


def test_the_graphs_path_trains_as_the_eager_step():
    """Same weights, optimizer state, LR and logged loss after the same windows."""
    eager, meter_e, progress_e = parts()
    graphed, meter_g, progress_g = parts()
    graph = StepGraph(graphed, capture=False)
    for window in batches(STEPS, 2):
        eager.zero_grad()
        for x, y in window:
            loss = eager.step_fn(eager.model, (x, y))[0]
            (loss * 0.5).backward()
            meter_e.add_micro(loss, BATCH)
            progress_e.offset += BATCH
        eager.optimizer_step(progress_e, meter_e, WORLD)
        graphed_window(graph, graphed, meter_g, progress_g, window)
    for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert progress_g.step == progress_e.step == STEPS and graphed.lr == eager.lr
    torch.testing.assert_close(meter_g.loss_sum, meter_e.loss_sum)


def test_the_guard_skips_a_non_finite_window_inside_the_step():
    module, meter, progress = parts()
    graph = StepGraph(module, capture=False)
    windows = batches(4)
    for window in windows[:3]:
        graphed_window(graph, module, meter, progress, window)
    before = [p.detach().clone() for p in module.model.parameters()]
    x, y = windows[3][0]
    x[0, 0] = float("nan")
    graphed_window(graph, module, meter, progress, [(x, y)])
    assert all(torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert module.verdicts.pending[-1].ok.item() is False  # host read: the test's, after
    assert torch.isfinite(meter.loss_sum)  # the bad window's loss stays out of the logs


def test_a_step_function_with_a_host_read_is_refused_at_its_first_window():
    def reads(model, batch):
        loss = step_fn(model, batch)[0]
        return loss * float(loss), {}

    module, meter, progress = parts(fn=reads)
    with pytest.raises(UserError, match=r"reads a device value on the host \(__float__ at"):
        graphed_window(StepGraph(module, capture=False), module, meter, progress,
                       batches(1)[0])


def test_a_third_window_shape_is_refused_as_dynamic_shapes():
    module, meter, progress = parts()
    graph = StepGraph(module, capture=False)
    for size in (8, 5, 8, 3):
        x, y = torch.randn(size, 4), torch.randint(0, 3, (size,))
        module.zero_grad()
        graph.collect((x, y), size)
        if size == 3:
            with pytest.raises(UserError, match="change shape from window to window"):
                graph.step(progress, meter, WORLD, size)
        else:
            graph.step(progress, meter, WORLD, size)


def config(**overrides) -> Config:
    return Config.from_dict({}).with_overrides(
        {"train.cuda_graph": True, **{k.replace("__", "."): v for k, v in overrides.items()}})


@pytest.mark.parametrize("overrides, names", [
    ({"train__compile": True}, "train.compile=true"),
    ({"train__precision": "fp16"}, "train.precision=fp16"),
    ({"guard__spike_factor": 6.0}, "guard.spike_factor=6.0"),
    ({"optim__fused": False}, "optim.fused: AdamW is not fused"),
])
def test_what_cannot_be_captured_is_refused_naming_it(overrides, names):
    c = config(**overrides)
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=c.optim.fused is not False)
    with pytest.raises(ConfigError, match=r"^train.cuda_graph=true cannot capture .*"
                       + names.replace(".", r"\.")):
        cuda_graph.check(c, torch.device("cuda"), opt, WORLD, False, False)
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    assert cuda_graph.refusal(config(), torch.device("cuda"), fused, WORLD, False, False) is None


@pytest.mark.parametrize("why, args", [
    ("takes a closure", dict(closure=True)), ("a stateful step", dict(stateful=True)),
    ("2 processes", dict(world=World(size=2))), ("run.device=cpu", dict(device="cpu"))])
def test_closures_state_ranks_and_the_cpu_are_refused(why, args):
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), fused=True)
    found = cuda_graph.refusal(config(), torch.device(args.get("device", "cuda")), opt,
                               args.get("world", WORLD), args.get("stateful", False),
                               args.get("closure", False))
    assert found is not None and why in found


def test_fit_refuses_a_graph_on_the_cpu_before_training(tmp_path):
    with pytest.raises(ConfigError, match="run.device=cpu: a CUDA graph needs a CUDA device"):
        ironloop.fit(tiny_mlp(), blobs(n=64), None, cfg(tmp_path, train__cuda_graph=True))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_fit_through_the_graphs_path_matches_the_eager_run(tmp_path, monkeypatch):
    """The loop's graph branch end to end (eager on the CPU): the same weights and loss log
    as the plain loop, a ragged last window included (100 samples, batches of 32)."""
    eager = ironloop.fit(tiny_mlp(), blobs(n=100), None, cfg(tmp_path / "e"))
    monkeypatch.setattr(cuda_graph, "DEVICES", ("cuda", "cpu"))
    graphed = ironloop.fit(tiny_mlp(), blobs(n=100), None,
                           cfg(tmp_path / "g", train__cuda_graph=True))
    for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "run" / "metrics.jsonl")
               .read_text().splitlines()] for d in ("e", "g")]
    assert len(losses[0]) == 8 and losses[1] == pytest.approx(losses[0], rel=1e-5)
