"""Several ``ironloop train`` runs, one after another, in each rank of ONE torchrun job: what
tests/test_distributed.py launches instead of a torchrun job per run, so that torchrun and each
rank start (import torch and ironloop) once for all of them.

``python -m torch.distributed.run --nproc_per_node=2 --standalone tests/ranks_main.py RUNS``:
RUNS is a JSON file holding ``[{"argv": [...], "port": int}, ...]``; each ``argv`` goes to
``cli.main`` (what ``python -m ironloop`` runs) in turn, every rank the same. A run's process
group is its own: rank 0 hosts a fresh TCPStore on the run's ``port`` (torchrun's agent store
keeps the keys of the group before, which a second group of the same name would read). Each
rank writes its exit code of each run next to the run's directory
(``<run.dir>.rank<R>.exit``); the job exits non-zero when a run did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ironloop.cli import main


def run_all(runs_file: str) -> int:
    worst = 0
    rank = os.environ["RANK"]
    for run in json.loads(Path(runs_file).read_text()):
        os.environ["MASTER_PORT"] = str(run["port"])
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        print(f"=== ranks_main: rank {rank}: ironloop {' '.join(run['argv'])}", flush=True)
        code = main(run["argv"])
        run_dir = next(a.split("=", 1)[1] for a in run["argv"] if a.startswith("run.dir="))
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
