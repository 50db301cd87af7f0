"""The guard's rollback under FSDP2 goes through the checkpointer, as a resume does: two gloo
ranks with sharded (.dcp) checkpoints roll back past a poisoned sample and finish; a SIGKILL
after that rollback and a --resume end bit-exact with the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ironloop.data.loader import EpochSampler
from ironloop.state.dcp import load_extras
from tests.e2e.test_distributed import launch, rank_pids, train, wait_for_step

pytestmark = pytest.mark.slow


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fsdp_rolls_back_a_poisoned_sample_and_a_sigkill_after_it_resumes_bit_exact(tmp_path):
    order = EpochSampler(1438, 64, seed=0, shuffle=True, world_size=2).permutation().tolist()
    bad = order[128 * 3 + 70]  # step 4's window, in rank 1's half only
    args = ("dist.strategy=fsdp", f"fault.nan_sample={bad}", "guard.max_bad_steps=1",
            "checkpoint.every_steps=2", "checkpoint.keep_last=20", "log.every_steps=1")
    reference = train(tmp_path / "reference", *args, ranks=2)  # exit 0, or the test fails
    lines = rows(reference / "guard.jsonl")
    assert [x["event"] for x in lines] == ["bad_step", "rollback"]
    assert (lines[0]["step"], lines[1]["to_step"]) == (4, 2)
    assert lines[1]["source"] == "checkpoints/last.dcp"  # the sharded checkpoint, not memory
    assert bad in load_extras(reference / "checkpoints" / "last.dcp")["guard"]["skip"]
    weights = load_file(reference / "final.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())

    run = tmp_path / "run"
    proc, log = launch(run, *args, ranks=2)
    wait_for_step(run, 8, proc, log)  # step 8 comes only after the rollback at step 4
    ranks = rank_pids(proc)
    for pid in [*ranks.values(), proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert [x["event"] for x in rows(run / "guard.jsonl")][:2] == ["bad_step", "rollback"]
    train(run, *args, "--resume", ranks=2)
    resumed = load_file(run / "final.safetensors")
    assert resumed.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(resumed[name], w), name
    # the resume went on past the rollback: no second one, the same steps in guard.jsonl
    assert [(x["event"], x["step"]) for x in rows(run / "guard.jsonl")] == \
        [(x["event"], x["step"]) for x in lines]
    assert json.loads((run / "results.json").read_text())["steps"] == \
        json.loads((reference / "results.json").read_text())["steps"]
    assert load_extras(run / "checkpoints" / "last.dcp")["guard"]["skip"] == \
        load_extras(reference / "checkpoints" / "last.dcp")["guard"]["skip"]
