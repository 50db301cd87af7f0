"""tools.doctor.env_checks: the cores, threads and workers findings at both sides of each
threshold."""

from __future__ import annotations

import os

import pytest
import torch

from ironloop.tools.doctor import env_checks
from ironloop.tools.doctor.findings import info
from tests.tools.doctor.helpers import config

# -- env: threads ---------------------------------------------------------------------------------

def test_cores_is_the_affinity_mask_else_the_cpu_count_else_one(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert env_checks.cores() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert env_checks.cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert env_checks.cores() == 1


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(env_checks, "cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")


def test_threads_equal_to_the_cores_pass_and_one_more_is_oversubscribed(four_cores):
    (f,) = env_checks.check_threads()
    assert f == info("threads", "4 torch thread(s) (torch's default) x 1 process(es) on 4 "
                                "core(s)")
    (f,) = env_checks.check_threads(config(run__threads=5))
    assert f.severity == "warning"
    assert f.measured == "5 torch thread(s) (run.threads) x 1 process(es) on 4 core(s): " \
                         "oversubscribed"
    assert f.fix == "set run.threads=4 (or OMP_NUM_THREADS=4) so that threads x processes " \
                    "<= cores"
    assert "preempt each other" in f.cause


def test_the_threads_fix_divides_the_cores_among_the_processes(four_cores, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert env_checks.check_threads(config(run__threads=2))[0].severity == "info"
    (f,) = env_checks.check_threads(config(run__threads=3))
    assert "x 2 process(es)" in f.measured and "run.threads=2 (or OMP_NUM_THREADS=2)" in f.fix
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    (f,) = env_checks.check_threads(config(run__threads=1))
    assert "run.threads=1 (or OMP_NUM_THREADS=1)" in f.fix  # never 0


def test_threads_that_leave_the_workers_no_cores_are_reported_on_cpu(four_cores):
    # 4 cores, 1 worker: 3 threads leave it its core, 4 do not
    assert env_checks.check_threads(config(run__threads=3, data__num_workers=1))[0] == \
        info("threads", "3 torch thread(s) (run.threads) x 1 process(es) on 4 core(s)")
    (f,) = env_checks.check_threads(config(run__threads=4, data__num_workers=1))
    assert f.severity == "info" and f.measured == (
        "4 torch thread(s) (run.threads) x 1 process(es) on 4 core(s) and 1 DataLoader "
        "worker(s) per process")
    assert f.cause == "torch's threads spin-wait between ops on the cores the workers need"
    assert f.fix == "if the loader is the bottleneck, set run.threads=3 (ironloop tune " \
                    "measures it)"
    (f,) = env_checks.check_threads(config(run__threads=2, data__num_workers=4))
    assert "set run.threads=1 " in f.fix  # no core left: still one thread
    assert env_checks.check_threads(config(run__threads=4, data__num_workers=0))[0].fix == ""


def test_the_workers_advice_is_for_cpu_runs_only(four_cores, monkeypatch):
    monkeypatch.setattr(env_checks, "resolve_device", lambda name: torch.device(name))
    cfg = config(run__threads=4, data__num_workers=1, run__device="cuda")
    assert env_checks.check_threads(cfg)[0].fix == ""
    assert env_checks._cpu(config()) and not env_checks._cpu(None)
