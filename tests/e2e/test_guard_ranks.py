"""The guard across processes: two gloo ranks with one poisoned, and SIGKILL + --resume after a
rollback."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from ironloop.data.loader import EpochSampler
from ironloop.state.io import load_verified
from tests.conftest import REPO
from tests.guard.test_guard import rows

# --- multi-process and SIGKILL ---------------------------------------------------------------

@pytest.mark.slow
def test_two_gloo_ranks_one_poisoned_roll_back_together(tmp_path):
    from tests.e2e.test_distributed import train

    order = EpochSampler(1438, 64, seed=0, shuffle=True, world_size=2).permutation().tolist()
    bad = order[128 * 3 + 70]  # step 4's window, in rank 1's half only
    run_dir = train(tmp_path / "ddp", "fault.nan_sample=" + str(bad), "guard.max_bad_steps=1",
                    "checkpoint.every_steps=2", ranks=2)
    lines = rows(run_dir / "guard.jsonl")
    assert [x["event"] for x in lines] == ["bad_step", "rollback"]
    assert lines[0]["step"] == 4 and lines[1]["to_step"] == 2
    state = load_verified(run_dir / "checkpoints" / "last.pt")
    assert bad in state["guard"]["skip"]
    assert all(torch.isfinite(v).all() for v in state["model"].values())


ONE_RANK_NAN_LOSS = """
import hashlib, json, os, sys
import torch
from torch import nn
import ironloop
from tests.conftest import blobs, tiny_mlp

rank, out = int(os.environ["RANK"]), sys.argv[1]
calls = 0


def step(model, batch):
    global calls
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    if model.training:
        calls += 1
        if rank == 1 and calls == 3:
            # Step 3's loss VALUE is NaN on rank 1 only. The NaN is a constant outside the
            # graph, so the gradients (and DDP's average of them) stay finite on both ranks.
            loss = loss + torch.tensor(float("nan"))
    return loss, {}


res = ironloop.fit(tiny_mlp(), blobs(n=256), None,
                   {"run.dir": out + "/run", "train.epochs": 1, "train.batch_size": 16,
                    "log.every_steps": 100, "log.progress": "off", "checkpoint.keep_last": 0,
                    "dist.timeout_s": 30}, step_fn=step)
weights = b"".join(v.numpy().tobytes() for v in res.model.state_dict().values())
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"steps": res.results["steps"], "bad_steps": res.results["bad_steps"],
               "weights": hashlib.sha256(weights).hexdigest()}, f)
"""


@pytest.mark.slow
def test_ddp_guard_verdict_agrees_when_only_one_rank_sees_a_nan_loss(tmp_path):
    """A rank's local view cannot decide alone: rank 1 alone sees a NaN loss (its gradients are
    finite, so DDP's gradient average carries nothing bad to rank 0). Both ranks must skip
    the step, or rank 0 steps while rank 1 does not and their weights part."""
    from tests.e2e.test_distributed import TIMEOUT, _stop

    script = tmp_path / "ironloop_one_rank_nan.py"  # "ironloop" in the name: _stop finds it
    script.write_text(ONE_RANK_NAN_LOSS)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    log = tmp_path / "ranks.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                 "--nproc_per_node=2", "--standalone", str(script),
                                 str(tmp_path)], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(f"the ranks hung (collectives out of step?):\n{log.read_text()[-5000:]}")
    assert proc.returncode == 0, log.read_text()[-8000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # the same steps, the same skip, the same weights
    assert (ranks[0]["steps"], ranks[0]["bad_steps"]) == (256 // 32 - 1, 1)
    (line,) = rows(tmp_path / "run" / "guard.jsonl")  # by rank 0, whose own loss was fine
    assert (line["step"], line["reason"]) == (3, "nonfinite_loss")
    # No gradient was non-finite; null when a later step had replaced them before the settle.
    assert line["nonfinite_grads"] in ([], None)


@pytest.mark.slow
def test_sigkill_after_a_rollback_then_resume_is_bit_exact(tmp_path):
    from tests.fault_kills import (
        assert_bit_exact,
        assert_same_tree,
        load_last,
        run_with_kills,
        train_in_process,
    )

    order = EpochSampler(1438, 16, seed=0, shuffle=True).permutation().tolist()
    bad = order[32 * 19 + 3]  # window 20: rolls back to the checkpoint at step 14
    extra = ("train.epochs=2", "model.kwargs={hidden: [64], dropout: 0.1}",
             f"fault.nan_sample={bad}", "guard.max_bad_steps=1")
    reference = tmp_path / "reference"
    train_in_process(reference, *extra)  # only the reference: in this process (issue 45)
    events = [(x["event"], x["step"]) for x in rows(reference / "guard.jsonl")]
    assert events == [("bad_step", 20), ("rollback", 20)]
    assert bad in load_last(reference)["guard"]["skip"]
    # one kill before the rollback (the resume replays it), one after it
    kills = run_with_kills(tmp_path / "run", [17, 30], random.Random(7), extra)
    assert kills == 2
    assert_bit_exact(reference, tmp_path / "run")
    assert_same_tree(load_last(reference)["guard"], load_last(tmp_path / "run")["guard"])

    def strip(path):
        return [{k: v for k, v in r.items() if k != "time"} for r in rows(path / "guard.jsonl")]

    assert strip(tmp_path / "run") == strip(reference)
