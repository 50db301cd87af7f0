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
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_distributed import (
    ARGS,
    TIMEOUT,
    assert_same_run,
    assert_same_weights,
    finish,
    rank_pids,
    read,
    train_here,
    wait_for_step,
    wait_signalled,
)

pytestmark = pytest.mark.slow

#: a lost node is seen after keep_alive_interval x keep_alive_max_attempt s (default 5 x 3), and
#: a round with fewer than --nnodes' maximum waits last_call_timeout (default 30 s) for more.
#: (Whole seconds only. 1 x 2 marks a live agent dead at load 6, its heartbeat late while its
#: worker loads torch: a newcomer then forms a group of its own beside it.)
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1"
#: (the doctor's preflight checks nothing these tests look at: off, a second less per run)
RUN = ["train.batch_size=32", "checkpoint.every_steps=5", "checkpoint.keep_last=20",
       "log.every_steps=1", "dist.timeout_s=30", "doctor.preflight=false"]


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


#: torchrun's main, run once ``gate`` exists: a replacement node whose interpreter and torch
#: are loaded ahead, so that it joins as soon as the test opens the gate, not seconds later
GATED = ("import sys, time; from pathlib import Path; from torch.distributed.run import main\n"
         "gate = Path(sys.argv.pop(1))\n"
         "while not gate.exists():\n    time.sleep(0.01)\n"
         "main(sys.argv[1:])")


def agent(run_dir: Path, name: str, rdzv: list[str], *overrides: str,
          gate: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """One torchrun agent (a "node": one rank) of the elastic job into ``run_dir``, writing to
    run_dir.{name}.log; ``rdzv`` its --rdzv-* arguments; with ``gate``, it joins once that file
    exists."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           # torchrun's agents share one TCPStore across rendezvous rounds by default, and a
           # round with a newcomer then never completes (the replacement waits for MASTER_ADDR,
           # the survivor for role_info: the same with a plain DDP script,
           # tests/e2e/elastic_plain_ddp.py); a store per round lets a node rejoin.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = run_dir.parent / f"{run_dir.name}.{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, *(["-c", GATED, str(gate)] if gate else
                               ["-m", "torch.distributed.run"]), "--nnodes=1:2",
             "--nproc-per-node=1", *rdzv, "--max-restarts=3",
             "-m", "ironloop", "train", *ARGS, f"run.dir={run_dir}", *RUN, *overrides,
             "--resume"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def c10d(port: int, host: bool) -> list[str]:
    """c10d rendezvous on 127.0.0.1:``port``; ``host``: this agent hosts its store. (Said, not
    guessed: on one machine every agent's hostname matches the endpoint's, and whichever binds
    the port first would host it.)"""
    return ["--rdzv-backend=c10d", f"--rdzv-id=t{port}", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-conf={RDZV_CONF},is_host={str(host).lower()}"]


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


def logged_at_loss(run_dir: Path, rank0: int) -> int:
    """The last step rank 0 (pid ``rank0``) logged before the group broke: read once that
    process is gone (SIGKILLed, or its one-line exit after the broken collective)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("gone", "Z", "X"):
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            return max(json.loads(x)["step"] for x in lines if x.endswith("}"))
        time.sleep(0.02)
    pytest.fail(f"rank 0 (pid {rank0}) still running {TIMEOUT}s after the loss")


def assert_redone_said(resume: dict, survivor: Path, logged: int) -> None:
    """The work the loss cost: the steps rank 0 had logged past the resumed checkpoint are
    counted in the resume event and named in the survivor's resume line (or none, when the
    loss came right after a checkpoint)."""
    a, b = resume["step"] + 1, logged
    assert resume["last_logged_step"] == logged and resume["steps_redone"] == b - a + 1, \
        (resume, logged)
    said = "the previous process logged no step past it" if b < a else \
        f"redoing steps {a}-{b}" if b > a else f"redoing step {a}"
    assert any(line.startswith("resumed from") and said in line
               for line in survivor.read_text().splitlines()), survivor.read_text()[-6000:]


def test_a_lost_node_continues_at_one_rank_with_the_global_batch_kept(uninterrupted, tmp_path):
    # The non-host agent (agent 1) and its worker SIGKILLed mid-epoch 1: the survivor's
    # collective breaks ("Connection reset by peer"), it says so on one line, torchrun restarts
    # its group at world size 1, and the run resumes from the newest checkpoint with two
    # micro-batches of 32 per step.
    run_dir = tmp_path / "run"
    port = free_port()
    host, log0 = agent(run_dir, "agent0", c10d(port, True))
    other, _ = agent(run_dir, "agent1", c10d(port, False))
    try:
        wait_for_step(run_dir, 12, host, log0)
        rank0 = rank_pids(host)[0]
        kill_node(other)
        logged = logged_at_loss(run_dir, rank0)
        finish(host, log0, ranks=2)
    finally:
        for p in (host, other):
            p.kill()
    resumes = assert_finished_exact(run_dir, uninterrupted, log0)
    assert resumes[-1]["step"] in (10, 15), resumes
    assert_redone_said(resumes[-1], log0, logged)
    lost = [line for line in log0.read_text().splitlines() if "lost" in line]
    assert any("rank 1" in line and "torchrun restarts" in line for line in lost), \
        log0.read_text()[-6000:]


def wait_for_start(run_dir: Path, world_size: int, nth: int, proc: subprocess.Popen,
                   log: Path) -> None:
    """Until events.jsonl holds ``nth`` start events at ``world_size`` ranks."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if (run_dir / "events.jsonl").exists() and sum(
                e["event"] == "start" and e["world_size"] == world_size
                for e in events(run_dir)) >= nth:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its start at {world_size} rank(s):\n"
                        f"{log.read_text()[-5000:]}")
        time.sleep(0.02)
    pytest.fail(f"no start at {world_size} rank(s) after {TIMEOUT}s:\n{log.read_text()[-5000:]}")


def test_a_replacement_node_grows_the_group_back_and_the_run_stays_exact(tmp_path):
    # As above, then a new agent joins once the survivor has trained alone to step 20: the
    # survivor's agent sees it waiting, stops its worker (which checkpoints on torchrun's
    # SIGTERM), and the two resume at world size 2 (accumulation 2 -> 1). The new agent is
    # started at the loss, gated (GATED), and the survivor's worker is paused (SIGSTOP)
    # from step 20 until its agent's SIGTERM for the newcomer is pending: the group grows back
    # mid-run whatever the machine's load, with no long run to leave the newcomer time.
    # (Every agent runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see agent(): without it the
    # group never re-forms, torchrun's own limit.)
    longer = ("train.epochs=5",)  # 115 steps
    reference = read(train_here(tmp_path / "one", "train.batch_size=64",
                                "checkpoint.enabled=false", "log.every_steps=1", *longer))
    run_dir = tmp_path / "run"
    port, gate = free_port(), tmp_path / "join"
    host, log0 = agent(run_dir, "agent0", c10d(port, True), *longer)
    other, _ = agent(run_dir, "agent1", c10d(port, False), *longer)
    new = other
    try:
        wait_for_step(run_dir, 12, host, log0)
        kill_node(other)
        # the newcomer loads torch while the survivor waits out the dead node's keep-alive
        new, log2 = agent(run_dir, "agent2", c10d(port, False), *longer, gate=gate)
        wait_for_start(run_dir, 1, 1, host, log0)
        wait_for_step(run_dir, 20, host, log0)  # the survivor trains alone
        worker = rank_pids(host)[0]
        os.kill(worker, signal.SIGSTOP)
        try:
            gate.touch()
            wait_signalled(worker, signal.SIGTERM)  # its agent restarts for the newcomer
        finally:
            os.kill(worker, signal.SIGCONT)
        for proc, log in ((host, log0), (new, log2)):
            finish(proc, log, ranks=2)
    finally:
        for p in (host, other, new):
            p.kill()
    assert_same_weights(reference, read(run_dir))
    starts = [(e["world_size"], e["step"]) for e in events(run_dir) if e["event"] == "start"]
    assert [w for w, _ in starts] == [2, 1, 2], events(run_dir)
    assert 20 <= starts[-1][1] < 115, events(run_dir)  # grown back mid-run
    for log in (log0, log2):
        assert "Traceback" not in log.read_text(), log.read_text()[-6000:]


def etcd_endpoint() -> str:
    """host:port of the etcd scripts/etcd-up started (the test skips, saying why, without one
    or without torchrun's etcd client)."""
    try:
        import etcd  # noqa: F401  (PyPI's python-etcd: torchrun's etcd rendezvous imports it)
    except ImportError:
        pytest.skip("python-etcd is not installed (pip install python-etcd)")
    folder = Path(os.environ.get("IRONLOOP_ETCD_DIR", "/tmp/ironloop-etcd"))
    try:
        endpoint = (folder / "endpoint").read_text().strip()
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=5) as r:
            assert json.load(r)["health"] == "true"
    except (OSError, AssertionError, ValueError, KeyError) as e:
        pytest.skip(f"no etcd answers ({e}): start one with scripts/etcd-up (Debian's "
                    f"etcd-server; needs root and apt-get)")
    return endpoint


def test_with_etcd_losing_the_first_node_lets_the_other_finish_exact(uninterrupted, tmp_path):
    # c10d's store lives in one agent, and losing that agent ends the job; etcd holds the
    # rendezvous outside every node, so the FIRST agent (rank 0's) SIGKILLed mid-epoch leaves
    # the other to restart at world size 1 and finish the same run.
    endpoint = etcd_endpoint()
    run_dir = tmp_path / "run"
    rdzv = ["--rdzv-backend=etcd-v2", f"--rdzv-id=t{uuid.uuid4().hex}",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-conf={RDZV_CONF}"]
    first, log0 = agent(run_dir, "agent0", rdzv)
    other, log1 = agent(run_dir, "agent1", rdzv)
    try:
        wait_for_step(run_dir, 12, first, log0)
        rank0 = rank_pids(first)[0]
        kill_node(first)
        logged = logged_at_loss(run_dir, rank0)
        finish(other, log1, ranks=2)
    finally:
        for p in (first, other):
            p.kill()
    resumes = assert_finished_exact(run_dir, uninterrupted, log1)
    assert_redone_said(resumes[-1], log1, logged)
    assert "lost rank 0" in log1.read_text(), log1.read_text()[-6000:]
