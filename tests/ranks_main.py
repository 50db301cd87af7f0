"""Several ``ironloop train`` runs, one after another, in each rank of ONE torchrun job: what
tests/e2e/test_distributed.py launches instead of a torchrun job per run, so that torchrun and each
rank start (import torch and ironloop) once for all of them.

``python -m torch.distributed.run --nproc_per_node=2 --standalone tests/ranks_main.py RUNS``:
RUNS is a JSON file holding a list of argument lists; each goes to ``cli.main`` (what
``python -m ironloop`` runs) in turn, every rank the same. A run's process group is its own:
rank 0 hosts a fresh TCPStore on a free port it picks just before the run and hands to the
other ranks through torchrun's agent store (whose own keys of the group before, a second group
of the same name would read). Each rank writes its exit code of each run next to the run's
directory (``<run.dir>.rank<R>.exit``); the job exits non-zero when a run did.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from ironloop.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_all(runs_file: str) -> int:
    worst = 0
    rank = os.environ["RANK"]
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     int(os.environ["WORLD_SIZE"]), is_master=False,
                     timeout=timedelta(seconds=600))
    for i, argv in enumerate(json.loads(Path(runs_file).read_text())):
        if rank == "0":
            agent.set(f"ranks_main/port/{i}", str(_free_port()))
        os.environ["MASTER_PORT"] = agent.get(f"ranks_main/port/{i}").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        print(f"=== ranks_main: rank {rank}: ironloop {' '.join(argv)}", flush=True)
        code = main(argv)
        run_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("run.dir="))
        Path(f"{run_dir}.rank{rank}.exit").write_text(f"{code}\n")
        worst = worst or code
        if code:
            break  # the other rank stops at the same run: its group ends with this one
    return worst


if __name__ == "__main__":
    code = run_all(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as cli.entry: no interpreter teardown (gloo's destructors under torchrun)
