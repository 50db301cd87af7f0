"""Elastic scale-in and out under torchrun: a lost node does not end the job, nor change it.

Two torchrun agents on 127.0.0.1 play two nodes (one rank each, ``--nnodes=1:2``,
``--max-restarts=3``, ``--resume``, gloo). One is SIGKILLed with its worker mid-epoch; the
survivor restarts at world size 1 from the newest checkpoint, re-derives
``train.accumulation_steps`` so the global batch of 64 is kept (state/global_batch.py), and
finishes the same run: the step count, the LR schedule and the weights of the uninterrupted
run (rtol=1e-5, atol=1e-6: the fp32 rounding distributed.md documents).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_distributed import (
    ARGS,
    assert_same_run,
    finish,
    read,
    train_here,
    wait_for_step,
)

pytestmark = pytest.mark.slow

#: a lost node is seen after keep_alive_interval x keep_alive_max_attempt s (default 5 x 3), and
#: a round with fewer than --nnodes' maximum waits last_call_timeout (default 30 s) for more
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
RUN = ["train.batch_size=32", "checkpoint.every_steps=5", "checkpoint.keep_last=20",
       "log.every_steps=1", "dist.timeout_s=30"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The reference: one process at the global batch of 64, which the uninterrupted 2 x 32
    run equals (tests/e2e/test_distributed.py); logged at every step as the runs here."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    return read(train_here(run_dir, "train.batch_size=64", "checkpoint.enabled=false",
                           "log.every_steps=1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(run_dir: Path, name: str, rdzv: list[str], *overrides: str
          ) -> tuple[subprocess.Popen, Path]:
    """One torchrun agent (a "node": one rank) of the elastic job into ``run_dir``, writing to
    run_dir.{name}.log; ``rdzv`` its --rdzv-* arguments."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = run_dir.parent / f"{run_dir.name}.{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
             "--nproc-per-node=1", *rdzv, f"--rdzv-conf={RDZV_CONF}", "--max-restarts=3",
             "-m", "ironloop", "train", *ARGS, f"run.dir={run_dir}", *RUN, *overrides,
             "--resume"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def c10d(port: int) -> list[str]:
    return ["--rdzv-backend=c10d", f"--rdzv-id=t{port}", f"--rdzv-endpoint=127.0.0.1:{port}"]


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and its worker at once, as a node that loses power."""
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    for pid in [proc.pid, *map(int, workers)]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def assert_finished_exact(run_dir: Path, reference: dict, survivor: Path) -> list[dict]:
    """The survivor's run is the uninterrupted one; its output has no traceback; returns the
    resume events."""
    assert_same_run(reference, read(run_dir))
    out = survivor.read_text()
    assert "Traceback" not in out, out[-6000:]
    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resumes and resumes[-1]["world_size"] == 1, events(run_dir)
    return resumes


def test_a_lost_node_continues_at_one_rank_with_the_global_batch_kept(uninterrupted, tmp_path):
    # The non-host agent (agent 1) and its worker SIGKILLed mid-epoch 1: the survivor's
    # collective breaks ("Connection reset by peer"), it says so on one line, torchrun restarts
    # its group at world size 1, and the run resumes from the newest checkpoint with two
    # micro-batches of 32 per step.
    run_dir = tmp_path / "run"
    port = free_port()
    host, log0 = agent(run_dir, "agent0", c10d(port))
    other, _ = agent(run_dir, "agent1", c10d(port))
    try:
        wait_for_step(run_dir, 12, host, log0)
        kill_node(other)
        finish(host, log0, ranks=2)
    finally:
        for p in (host, other):
            p.kill()
    resumes = assert_finished_exact(run_dir, uninterrupted, log0)
    assert resumes[-1]["steps_redone"] >= 1 and resumes[-1]["step"] in (10, 15), resumes
    lost = [line for line in log0.read_text().splitlines() if "lost" in line]
    assert any("rank 1" in line and "torchrun restarts" in line for line in lost), \
        log0.read_text()[-6000:]
