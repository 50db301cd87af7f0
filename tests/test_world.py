"""parallel/world.py in one process: the fresh store of an elastic restart and the sum over
ranks of an evaluation. The torchrun runs are in tests/test_distributed.py."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ironloop.parallel.world import World, _fresh_store, sum_over_ranks


def test_an_elastic_restart_gets_a_fresh_store_that_rank_0_hosts_and_every_rank_reaches():
    agent = dist.HashStore()  # torchrun's agent store: it outlives the attempts
    agent.set_timeout(timedelta(seconds=5))
    agent.set("gloo/connect/0", "the previous attempt's dead rank 0")
    joining = timedelta(seconds=17)
    host = _fresh_store(agent, 0, 2, "1", joining)
    other = _fresh_store(agent, 1, 2, "1", joining)  # learns rank 0's address from the agent
    host.set("attempt 1", "rank 0 was here")
    assert other.get("attempt 1") == b"rank 0 was here"
    assert not other.check(["gloo/connect/0"])  # nothing of the previous attempt
    assert other.timeout == host.timeout == joining


def _rank_zero(store_path: str, expected: dict) -> None:
    """Rank 0, in a forked process: 4 samples whose losses sum to 3.0 and accuracies to 2.0."""
    code = 1
    try:
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=timedelta(seconds=60),
                                store=dist.FileStore(store_path, 2))
        got = sum_over_ranks(["loss", "acc"], torch.tensor([3.0, 2.0]), 4, World(size=2))
        code = 0 if got == expected else 1
        dist.destroy_process_group()
    finally:
        os._exit(code)  # a forked pytest: nothing of the parent's teardown may run here


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="forks rank 0 from this process")
def test_a_rank_that_saw_no_sample_still_joins_the_sum_and_gets_the_others_averages(tmp_path):
    """Fewer validation samples than ranks: rank 1 (this process) saw none. It learns the names
    from rank 0 and adds zeros, so both ranks return the same averages (and neither hangs)."""
    expected = {"loss": 0.75, "acc": 0.5}
    store = str(tmp_path / "store")
    rank0 = multiprocessing.get_context("fork").Process(target=_rank_zero,
                                                        args=(store, expected))
    rank0.start()
    try:
        dist.init_process_group("gloo", rank=1, world_size=2, timeout=timedelta(seconds=60),
                                store=dist.FileStore(store, 2))
        got = sum_over_ranks([], None, 0, World(rank=1, size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        rank0.join(timeout=60)
        if rank0.exitcode is None:  # left waiting for this rank's part of the sum
            rank0.kill()
            rank0.join()
    assert got == expected
    assert rank0.exitcode == 0  # rank 0 got the same averages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sums_on_the_gpu_are_divided_by_their_count():
    got = sum_over_ranks(["loss"], torch.tensor([3.0], device="cuda"), 4, World())
    assert got == {"loss": 0.75}
