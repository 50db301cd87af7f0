"""Host reads per plain optimizer step: none (issue 20).

A host read of a device value (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ...) is a
device sync on CUDA: the CPU stops queueing kernels until the GPU catches up. ``CountReads``, a
``TorchFunctionMode``, sees every such call made from outside torch itself (torch's own, e.g.
the single-tensor optimizers' ``.item()`` on a CPU step count, are not ironloop's to remove).

A run of N plain steps and one of 2N steps make the same reads at set-up, at the epoch end and
at the final checkpoint, so their difference is the reads of N plain steps, which must be 0.
Reads at log steps are allowed (the metrics line, the guard's lagged verdicts): the runs log
every 1000 steps, so they have none.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import ironloop
from tests.conftest import REPO, blobs, cfg, tiny_mlp

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy"}
TORCH = os.path.dirname(torch.__file__)
N = 6  # plain steps of the shorter run
BATCH = 32


class CountReads(TorchFunctionMode):
    """Counts host reads by call site (file:line), leaving out calls made inside torch."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            caller = sys._getframe(1).f_code
            if not caller.co_filename.startswith(TORCH):
                self.sites[f"{name} at {caller.co_filename}:{sys._getframe(1).f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


def reads_per_run(tmp_path: Path, steps: int, step_fn=None, **overrides) -> collections.Counter:
    options = dict(train__epochs=1, train__batch_size=BATCH, log__every_steps=1000)
    options.update(overrides)
    with CountReads() as counter:
        ironloop.fit(tiny_mlp(), blobs(n=steps * BATCH), None,
                     cfg(tmp_path / str(steps), **options), step_fn=step_fn, overwrite=True)
    return counter.sites


def plain_step_reads(tmp_path: Path, **kw) -> dict:
    """{call site: reads} made by N extra plain steps (2N-step run minus N-step run)."""
    short, long = reads_per_run(tmp_path, N, **kw), reads_per_run(tmp_path, 2 * N, **kw)
    assert sum(short.values()) > 0  # the counter sees the set-up and epoch-end reads
    return {site: long[site] - short[site] for site in long | short
            if long[site] != short[site]}


def step_with_metrics(model, batch):
    """A user step that returns a metric on every step (it stays on the device)."""
    x, y = batch
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    return loss, {"acc": (out.argmax(-1) == y).float().mean()}


@pytest.mark.parametrize("overrides", [
    {},                                                    # the defaults: guard and timer on
    {"train__precision": "bf16"},
    {"train__precision": "fp16"},                          # GradScaler + fused AdamW
    # spike mode computes its statistics every step; a factor no step of this run reaches
    {"guard__spike_factor": 50.0, "guard__spike_window": 4, "guard__spike_warmup": 2},
    {"train__accumulation_steps": 2},
    {"average__kind": "ema"},                              # the average updates on the device
    {"average__kind": "swa", "average__every_steps": 2},
], ids=["defaults", "bf16", "fp16", "spike", "accumulation", "ema", "swa"])
def test_no_host_read_in_a_plain_step(tmp_path, overrides):
    assert plain_step_reads(tmp_path, **overrides) == {}


def test_no_host_read_in_a_plain_step_of_a_step_function_with_metrics(tmp_path):
    assert plain_step_reads(tmp_path, step_fn=step_with_metrics) == {}


def test_the_counter_sees_a_read_per_step_when_there_is_one(tmp_path):
    """The test above can fail: an optimizer without found_inf makes the guard read its verdict
    before every step (the documented fallback), and the counter sees exactly those N reads."""
    reads = plain_step_reads(tmp_path, optim__fused=False)
    assert sum(reads.values()) == N and all("verdict.py" in site for site in reads)


RANK_SCRIPT = """
import gc, json, os, sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import ironloop
from tests.conftest import blobs, cfg, tiny_mlp
from tests.engine.test_host_reads import BATCH, CountReads
from pathlib import Path
out, steps = Path(sys.argv[1]), int(sys.argv[2])
# A DDP wrapper still alive when fit() destroys its process group is freed later, in the
# interpreter's teardown, where gloo's threads abort the finished rank now and then
# ("terminate called without an active exception", exit -6): count the wrappers alive then.
destroy, alive = dist.destroy_process_group, []
def counted_destroy(*args, **kwargs):
    alive.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
    return destroy(*args, **kwargs)
dist.destroy_process_group = counted_destroy
with CountReads() as counter:
    ironloop.fit(tiny_mlp(), blobs(n=steps * BATCH * 2), None,
                 cfg(out / "run", train__epochs=1, train__batch_size=BATCH,
                     log__every_steps=1000), overwrite=True)
(out / f"reads{os.environ['RANK']}.json").write_text(json.dumps(dict(counter.sites)))
(out / f"alive{os.environ['RANK']}.json").write_text(json.dumps(alive))
"""


@pytest.mark.slow
def test_no_host_read_in_a_plain_step_under_ddp(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    counts = {}
    for steps in (N, 2 * N):
        out = tmp_path / str(steps)
        out.mkdir()
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                              "--nproc_per_node=2", "--standalone", str(script), str(out),
                              str(steps)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-5000:]
        counts[steps] = [collections.Counter(json.loads((out / f"reads{r}.json").read_text()))
                         for r in (0, 1)]
        for r in (0, 1):  # every DDP wrapper freed before its process group, on both ranks
            assert json.loads((out / f"alive{r}.json").read_text()) == [0], r
    for rank in (0, 1):
        short, long = counts[N][rank], counts[2 * N][rank]
        assert sum(short.values()) > 0
        assert {s: long[s] - short[s] for s in long | short if long[s] != short[s]} == {}
