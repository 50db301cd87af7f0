"""examples/slurm/multinode.sbatch on the real one-node SLURM (scripts/slurm-up).

The template runs one torchrun agent per node (srun), a c10d rendezvous on the allocation's
first node, ``--nnodes=1:$SLURM_NNODES --max-restarts --resume``. The test cluster has one
node, so the job here is ``--nodes=1``: it shows that the template trains through srun and
torchrun, and that a requeued attempt (``scontrol requeue`` mid-run: SIGTERM to every process of
the step, as for a node failure's requeue) resumes from the checkpoint and ends with the weights
and optimizer state of an uninterrupted run, torch.equal. A node lost among several is
tests/e2e/test_elastic.py's (two torchrun agents on 127.0.0.1, the same torchrun arguments).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import slurm_cluster as sc
from tests.conftest import REPO
from tests.engine.test_slurm import (  # noqa: F401  (cluster: the module's fixture)
    ARGS,
    cluster,
    events,
    job_env,
    logged,
    reference,
    same_training,
    state,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu_alone", "cluster")]

TEMPLATE = "examples/slurm/multinode.sbatch"
#: ~7 s of reads (examples/slow_reads.py): the requeue comes well before the end
RUN = ["train.epochs=3", "checkpoint.every_steps=4"]
TIMEOUT = 300.0  # seconds for each wait below, a limit only: the job takes ~30 s on 2 idle cores


def test_the_multinode_template_trains_through_torchrun_and_a_requeued_attempt_resumes_exact(
        tmp_path):
    ref = reference(tmp_path / "ref", *RUN)
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    env = job_env(IRONLOOP_PYTHON=sys.executable)
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--output={out}", TEMPLATE, *ARGS,
                        *RUN, f"run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    job = r.stdout.strip().split(";")[0]
    try:
        sc.wait(lambda: logged(run_dir) >= 10, "step 10 of the first attempt", TIMEOUT, out)
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
        sc.wait(lambda: sc.job(job)["JobState"] == "PENDING", "the requeued job pending",
                TIMEOUT, out)
        # it would wait ~120 s (BeginTime): start it once its credential may be reused
        pending = time.monotonic()
        sc.wait(lambda: time.monotonic() - pending > sc.REVOKED_S and sc.release(job),
                "the requeued attempt released", TIMEOUT, out)
        sc.wait(lambda: sc.job(job)["JobState"] in sc.ENDED, "the job's end", TIMEOUT, out)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=60)
    fields, text = sc.job(job), out.read_text()
    assert fields["JobState"] == "COMPLETED", text[-4000:]
    assert int(fields["Restarts"]) == 1, fields
    starts = [e for e in events(run_dir) if e["event"] == "start"]
    assert [e["world_size"] for e in starts] == [1, 1], starts
    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 8, resumes  # from a checkpoint mid-run
    assert same_training(state(run_dir), state(ref))

