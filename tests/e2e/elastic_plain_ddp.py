"""torchrun's own behaviour on a lost node and its replacement, with no ironloop in it.

``python tests/e2e/elastic_plain_ddp.py [c10d|etcd-v2 HOST:PORT]`` runs, by hand, the scenario of
tests/e2e/test_elastic.py's replacement case with a plain torch DDP script: two torchrun agents
(``--nnodes=1:2 --max-restarts=3``, one worker each, gloo on 127.0.0.1; agent 0 hosts the c10d
store), agent 1 and its worker SIGKILLed mid-run, and once the survivor trains alone a new
agent started with the same command. It prints each agent's exit code and the lines that say how
the rendezvous went. (The worker: ``elastic_plain_ddp.py worker DIR``, checkpointing every 10
steps into DIR and resuming from there, as any torchrun --max-restarts job must.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 4000
CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"


def worker(folder: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ckpt, step = folder / "ckpt.pt", 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        step = state["step"]
    print(f"worker: rank {dist.get_rank()} of world {dist.get_world_size()} from step {step}",
          flush=True)
    while step < STEPS:
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 10 == 0 and dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "step": step}, folder / "tmp.pt")
            os.replace(folder / "tmp.pt", ckpt)
            (folder / "step").write_text(str(step))
    dist.destroy_process_group()


def agent(folder: Path, n: int, rdzv: list[str]) -> tuple[subprocess.Popen, Path]:
    log = folder / f"agent{n}.log"
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
             "--nproc-per-node=1", *rdzv, "--max-restarts=3", __file__, "worker", str(folder)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
            stderr=subprocess.STDOUT), log


def wait(what, proc: subprocess.Popen, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while not what():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting (agent 0 exit {proc.poll()})")
        time.sleep(0.05)


def main(backend: str, endpoint: str | None) -> None:
    folder = Path(tempfile.mkdtemp(prefix="plain-ddp-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = endpoint or f"127.0.0.1:{port}"

    def rdzv(host: bool) -> list[str]:
        conf = CONF + (f",is_host={str(host).lower()}" if backend == "c10d" else "")
        return [f"--rdzv-backend={backend}", f"--rdzv-id=plain{port}",
                f"--rdzv-endpoint={endpoint}", f"--rdzv-conf={conf}"]

    (a0, log0), (a1, _) = agent(folder, 0, rdzv(True)), agent(folder, 1, rdzv(False))
    step = folder / "step"
    wait(lambda: step.exists() and int(step.read_text() or 0) >= 100, a0)
    for pid in [a1.pid, *map(int, Path(f"/proc/{a1.pid}/task/{a1.pid}/children").read_text()
                             .split())]:
        os.kill(pid, signal.SIGKILL)
    a1.wait()
    wait(lambda: "of world 1" in log0.read_text(), a0)
    print(f"agent 1 killed at step >= 100; agent 0 trains alone: {step.read_text()}")
    a2, log2 = agent(folder, 2, rdzv(False))
    codes = [a.wait(timeout=600) for a in (a0, a2)]
    print(f"exit codes: agent 0 {codes[0]}, replacement {codes[1]}; last step "
          f"{step.read_text()} of {STEPS}")
    for name, log in (("agent 0", log0), ("replacement", log2)):
        said = [line for line in log.read_text().splitlines()
                if line.startswith(("worker:", "torch.distributed.DistStoreError"))
                or "Error:" in line[:80]]
        print(f"--- {name} ({log}):", *said, sep="\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(Path(sys.argv[2]))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "c10d", sys.argv[2] if len(sys.argv) > 2
             else None)
