"""A real one-node SLURM for the tests (scripts/slurm-up), and the few verbs they need on it.

``cluster()`` uses the cluster that is running (``.ci/run`` starts one) or starts one itself
where it can: that needs root (slurmd starts jobs as their users) and, where SLURM is not
installed, apt-get. Anywhere else the SLURM tests skip and say which of the two is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ironloop.engine.slurm import show_job
from tests.conftest import REPO

SLURM_DIR = Path(os.environ.get("IRONLOOP_SLURM_DIR", "/tmp/ironloop-slurm"))
TEMPLATE = "examples/slurm/train.sbatch"
#: a job's end states; a requeued job is PENDING (Reason=BeginTime) again, not ended
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _up(conf: Path) -> bool:
    r = subprocess.run(["scontrol", "ping"], env={**os.environ, "SLURM_CONF": str(conf)},
                       capture_output=True, text=True) if shutil.which("scontrol") else None
    return r is not None and "UP" in r.stdout


def why_not() -> str | None:
    """Why this machine cannot have the test cluster, or None when it can."""
    if _up(SLURM_DIR / "slurm.conf"):
        return None
    if os.geteuid() != 0:
        return "the SLURM tests need root to start slurmd (scripts/slurm-up); run them as root"
    if not shutil.which("slurmd") and not shutil.which("apt-get"):
        return "SLURM is not installed and apt-get is missing to install it (scripts/slurm-up)"
    return None


def start() -> bool:
    """Bring the cluster up unless it runs; True when this call started it. A failure where root
    and apt are there is a failure, not a skip."""
    if _up(SLURM_DIR / "slurm.conf"):
        return False
    r = subprocess.run([str(REPO / "scripts" / "slurm-up")], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        pytest.fail(f"scripts/slurm-up failed:\n{r.stdout}{r.stderr}")
    return True


def stop() -> None:
    subprocess.run([str(REPO / "scripts" / "slurm-down")], capture_output=True, timeout=120)


def sbatch(*options: str, args: list[str], out: Path, env: dict) -> str:
    """Submit the shipped template as a user would; the job id."""
    r = subprocess.run(["sbatch", "--parsable", f"--output={out}", *options, TEMPLATE, *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (SLURM_CONF comes from the environment)."""
    fields = show_job(job_id)
    assert fields, f"scontrol show job {job_id} said nothing"
    return fields


#: slurmd refuses a job's launch whose credential dates from the second its previous one was
#: revoked ("Job credential revoked"; the requeue revokes it): release a requeued job only once
#: it has waited longer than this
REVOKED_S = 2.0


def release(job_id: str, lift: bool = False) -> bool:
    """A requeued job waits ~120 s (Reason=BeginTime) before it may start again: start it now
    (but see REVOKED_S); ``lift``: with no time limit to speak of. True when it was waiting."""
    r = subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now",
                        *(["TimeLimit=30"] if lift else [])], capture_output=True, timeout=60)
    return r.returncode == 0


def requeues(job_id: str) -> int:
    return int(job(job_id)["Restarts"])


def cancel(job_id: str, *options: str) -> None:
    subprocess.run(["scancel", *options, job_id], check=True, capture_output=True, timeout=60)


def wait(what, why: str, timeout: float, out: Path | None = None, every: float = 0.2) -> None:
    """Until ``what()`` is true; polled every ``every`` seconds, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            tail = out.read_text()[-3000:] if out is not None and out.exists() else ""
            pytest.fail(f"no {why} within {timeout:.0f} s\n{tail}")
        time.sleep(every)
