"""parallel/world.py in one process: the fresh store of an elastic restart and the sum over
ranks of an evaluation. The torchrun runs are in tests/e2e/test_distributed.py."""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ironloop.errors import ConfigError, UserError
from ironloop.parallel import world as w
from ironloop.parallel.world import CollectiveTimeout, World, _fresh_store, sum_over_ranks


def test_an_elastic_restart_gets_a_fresh_store_that_rank_0_hosts_and_every_rank_reaches():
    agent = dist.HashStore()  # torchrun's agent store: it outlives the attempts
    agent.set_timeout(timedelta(seconds=5))
    agent.set("gloo/connect/0", "the previous attempt's dead rank 0")
    joining = timedelta(seconds=17)
    host = _fresh_store(agent, 0, 2, joining, 5, 0)
    other = _fresh_store(agent, 1, 2, joining, 5, 0)  # learns rank 0's address from the agent
    host.set("attempt 1", "rank 0 was here")
    assert other.get("attempt 1") == b"rank 0 was here"
    assert not other.check(["gloo/connect/0"])  # nothing of the previous attempt
    assert other.timeout == host.timeout == joining


def test_two_jobs_restarting_on_one_node_each_get_a_free_port_for_their_fresh_store():
    """Rank 0 lets the OS pick the fresh store's port: two jobs whose rank 0 share a node
    (or the world size taken as a port) would otherwise collide."""
    joining = timedelta(seconds=5)
    first = _fresh_store(dist.HashStore(), 0, 2, joining, 5, 0)
    second = _fresh_store(dist.HashStore(), 0, 2, joining, 5, 0)
    assert first.port != second.port and min(first.port, second.port) > 1023


def test_a_rank_reaches_a_fresh_store_at_an_ipv6_address():
    """The port is what follows the address's last colon."""
    try:
        host = dist.TCPStore("::1", 0, 2, is_master=True, timeout=timedelta(seconds=5),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no IPv6 loopback here
        pytest.skip("no IPv6 loopback")
    agent = dist.HashStore()
    host.set("ironloop/token", "t")
    agent.set("ironloop/group_store/3", f"::1:{host.port}:t")
    other = _fresh_store(agent, 1, 2, timedelta(seconds=5), 5, 3)
    host.set("k", "v")
    assert other.get("k") == b"v"


def test_a_stale_address_is_passed_over_and_a_missing_rank_0_fails_in_one_line():
    """The previous attempt's rank 0 (gone) left its address under the key: the others wait
    for this attempt's, and give up after dist.timeout_s naming it."""
    agent = dist.HashStore()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    agent.set("ironloop/group_store/0", f"127.0.0.1:{dead}:old")
    with pytest.raises(CollectiveTimeout, match=r"rank 1: rank 0 of this attempt did not "
                                                r"publish its store within dist.timeout_s=1 s"):
        _fresh_store(agent, 1, 2, timedelta(seconds=5), 1, 0)


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


def _rank_zero_refuses(store_path: str) -> None:
    """Rank 0, in a forked process: its part of rank_zero_first raises a UserError."""
    code = 1
    try:
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=timedelta(seconds=60),
                                store=dist.FileStore(store_path, 2))

        def refuse():
            raise ConfigError("run.dir has another run's checkpoints")

        try:
            w.rank_zero_first(refuse, World(rank=0, size=2))
        except ConfigError:
            code = 0
        dist.destroy_process_group()
    finally:
        os._exit(code)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="forks rank 0 from this process")
def test_rank_zeros_user_error_stops_the_other_ranks_with_the_same_line(tmp_path):
    store = str(tmp_path / "store")
    rank0 = multiprocessing.get_context("fork").Process(target=_rank_zero_refuses, args=(store,))
    rank0.start()
    ran = []
    try:
        dist.init_process_group("gloo", rank=1, world_size=2, timeout=timedelta(seconds=60),
                                store=dist.FileStore(store, 2))
        with pytest.raises(w.RankZeroError, match="^run.dir has another run's checkpoints$"):
            w.rank_zero_first(lambda: ran.append(1), World(rank=1, size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        rank0.join(timeout=60)
        if rank0.exitcode is None:
            rank0.kill()
            rank0.join()
    assert ran == [] and rank0.exitcode == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sums_on_the_gpu_are_divided_by_their_count():
    got = sum_over_ranks(["loss"], torch.tensor([3.0], device="cuda"), 4, World())
    assert got == {"loss": 0.75}


def test_the_sample_count_joins_the_sums_in_one_all_reduce_on_the_sums_device(monkeypatch):
    """Sums left on an accelerator (here the meta device, which any host has) are reduced
    there, with the count appended to them: one collective, on one device."""
    sent = []

    def all_reduce_sum(t, world):
        sent.append((t.device.type, t.dtype, tuple(t.shape)))
        return torch.tensor([3.0, 1.0, 4.0], dtype=torch.float64)  # what the ranks added up

    monkeypatch.setattr(w, "all_reduce_sum", all_reduce_sum)
    got = sum_over_ranks(["loss", "acc"], torch.zeros(2, device="meta"), 4, World())
    assert sent == [("meta", torch.float64, (3,))]
    assert got == {"loss": 0.75, "acc": 0.25}


@pytest.mark.parametrize("backend, device", [("nccl", torch.device("cuda", 3)),
                                             ("gloo", torch.device("cpu"))])
def test_a_rank_that_saw_no_sample_makes_its_zeros_on_the_backends_device(
        monkeypatch, backend, device):
    """NCCL reduces only GPU tensors (the current one); gloo CPU ones. This host may have no
    GPU, so torch.zeros reports the device it is asked for and makes the zeros on the CPU."""
    asked, real_zeros = [], torch.zeros

    def zeros(*size, dtype=None, device=None):
        asked.append(device)
        return real_zeros(*size, dtype=dtype)

    def all_gather_object(out, obj):
        out[:] = [["loss"], obj]  # rank 0 saw samples; this rank (1) none

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(w, "all_reduce_sum", lambda t, world: t + torch.tensor([3.0, 4.0],
                                                                             dtype=t.dtype))
    got = sum_over_ranks([], None, 0, World(rank=1, size=2))
    assert asked == [device] and got == {"loss": 0.75}


def test_when_rank_0_saw_no_sample_the_names_come_from_a_rank_that_did(monkeypatch):
    """A rank with no sample says so (None), not with an empty list of names: rank 0 here saw
    none, and its empty names must not hide rank 1's."""
    sent = []

    def all_gather_object(out, obj):
        sent.append(obj)
        out[:] = [obj, ["loss"]]  # this rank is 0; rank 1 saw samples

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(w, "all_reduce_sum", lambda t, world: t + torch.tensor([3.0, 4.0],
                                                                             dtype=t.dtype))
    assert sum_over_ranks([], None, 0, World(rank=0, size=2)) == {"loss": 0.75}
    assert sent == [None]


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one, in this process (a test may destroy it)."""
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60),
                            store=dist.FileStore(str(tmp_path / "store"), 1))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _timeout() -> timedelta:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def test_rank_0_is_the_main_rank_and_more_than_one_rank_is_distributed():
    assert World().is_main and not World().distributed
    assert not World(rank=1, size=2).is_main and World(rank=1, size=2).distributed
    assert World(rank=0, size=2).is_main and not World(size=1).distributed


@pytest.mark.parametrize("size", [None, "1"])
def test_without_torchrun_or_with_one_process_no_group_is_joined(monkeypatch, size):
    if size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", size)
    assert w.init_from_env("cpu") == World()
    assert not dist.is_initialized()


def test_a_group_created_before_fit_is_joined_and_not_owned(monkeypatch, one_rank):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert w.init_from_env("cpu") == World(rank=0, local_rank=3, size=1, owns_group=False)


class _Joins:
    """dist.init_process_group as torchrun's ranks would see it, recorded: the group it makes
    is one of this process alone."""

    def __init__(self, monkeypatch, tmp_path):
        self.calls: list[dict] = []
        self.path = str(tmp_path / "joined")
        self.real = dist.init_process_group
        monkeypatch.setattr(dist, "init_process_group", self)
        # torchrun's store, as rank 0 reaches it through env://; the attempt's store is ours
        monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(dist.HashStore(), 0, 2)]))

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        self.real("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60),
                  store=dist.FileStore(self.path, 1))


@pytest.mark.parametrize("timeout_s, joining", [(60.0, 900.0), (1200.0, 1200.0)])
def test_joining_waits_the_rendezvous_timeout_or_the_collective_one_when_longer(
        monkeypatch, tmp_path, timeout_s, joining):
    for k, v in {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    joins = _Joins(monkeypatch, tmp_path)
    try:
        got = w.init_from_env("cpu", timeout_s)
    finally:
        dist.destroy_process_group()
    assert got == World(rank=0, local_rank=0, size=1, owns_group=True)
    assert [{k: c[k] for k in ("backend", "timeout")} for c in joins.calls] == \
        [{"backend": "gloo", "timeout": timedelta(seconds=joining)}]


def test_a_joined_rank_takes_its_rank_and_the_worlds_size_from_the_group(monkeypatch,
                                                                          tmp_path):
    for k, v in {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    _Joins(monkeypatch, tmp_path)
    try:
        with monkeypatch.context() as m:  # the group of two torchrun made, as seen by rank 1
            m.setattr(dist, "get_world_size", lambda *a, **k: 2)
            m.setattr(dist, "get_rank", lambda *a, **k: 1)
            got = w.init_from_env("cpu")
    finally:
        dist.destroy_process_group()
    assert got == World(rank=1, local_rank=0, size=2, owns_group=True) and got.distributed


def test_a_cuda_rank_joins_with_nccl_on_its_local_device(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    joins, devices = _Joins(monkeypatch, tmp_path), []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    try:
        got = w.init_from_env("cuda")
    finally:
        dist.destroy_process_group()
    assert [(c["backend"], c["timeout"]) for c in joins.calls] == \
        [("nccl", timedelta(seconds=900))]
    assert devices == [1] and got == World(rank=0, local_rank=1, size=1, owns_group=True)


def test_an_elastic_restart_joins_through_a_fresh_store(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    joins, agent, asked = _Joins(monkeypatch, tmp_path), dist.HashStore(), []

    def rendezvous(url, timeout):
        asked.append((url, timeout))
        return iter([(agent, 0, 1)])

    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    hosted, real_fresh = [], w._fresh_store

    def fresh_store(store, rank, size, timeout, meet_s, group):  # made for this world
        hosted.append((rank, size, timeout, meet_s))
        return real_fresh(store, rank, size, timeout, meet_s, group)

    monkeypatch.setattr(w, "_fresh_store", fresh_store)
    try:
        got = w.init_from_env("cpu", 30.0)
    finally:
        dist.destroy_process_group()
    assert hosted == [(0, 1, timedelta(seconds=900), 30.0)]  # whatever the restart count
    assert got.owns_group and asked == [("env://", timedelta(seconds=900))]
    (call,) = joins.calls
    store = call.pop("store")
    assert call == {"backend": "gloo", "timeout": timedelta(seconds=900), "rank": 0,
                    "world_size": 1}
    key = next(k for k in (f"ironloop/group_store/{n}" for n in range(100)) if agent.check([k]))
    host, port, _ = agent.get(key).decode().rsplit(":", 2)
    assert host == socket.gethostname()  # rank 0 hosts it
    assert isinstance(store, dist.TCPStore) and store.port == int(port)


def test_the_loops_collective_timeout_is_set_only_on_a_group_fit_created(one_rank):
    w.collective_timeout(World(), 7.0)
    assert _timeout() == timedelta(seconds=60)
    w.collective_timeout(World(owns_group=True), 7.0)
    assert _timeout() == timedelta(seconds=7)


def test_a_collectives_timeout_becomes_a_one_line_error_naming_dist_timeout_s(one_rank):
    @w.name_timeouts()
    def step(a, b=0):
        if a == "hang":
            raise RuntimeError("  [gloo] Timed out waiting 5000ms for recv operation\ntrace")
        if a == "long":
            raise RuntimeError("Timed out " + "x" * 200)
        if a == "other":
            raise RuntimeError("CUDA out of memory")
        if a == "empty":
            raise RuntimeError()
        return a + b

    assert step.__name__ == "step" and step(1, b=2) == 3
    with pytest.raises(w.CollectiveTimeout) as e:
        step("hang")
    assert str(e.value) == (
        "rank 0: a collective waited longer than dist.timeout_s for another rank, which "
        "stopped responding (hung, stopped, or its node is gone); this rank gives up. Check "
        "the other ranks' logs; if a step or a checkpoint legitimately takes that long, raise "
        "dist.timeout_s. ([gloo] Timed out waiting 5000ms for recv operation)")
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(w.CollectiveTimeout) as e:
        step("long")
    assert str(e.value).endswith(f"dist.timeout_s. ({'x' * 160})")
    for other in ("other", "empty"):
        with pytest.raises(RuntimeError) as e:
            step(other)
        assert type(e.value) is RuntimeError


def test_a_timeout_message_without_a_group_is_left_as_it_is():
    @w.name_timeouts()
    def step():
        raise RuntimeError("Timed out waiting 5000ms")

    with pytest.raises(RuntimeError, match="^Timed out waiting 5000ms$") as e:
        step()
    assert type(e.value) is RuntimeError


def test_shutdown_destroys_only_a_group_fit_created(one_rank):
    w.shutdown(World())
    assert dist.is_initialized()
    w.shutdown(World(owns_group=True))
    assert not dist.is_initialized()
    w.shutdown(World(owns_group=True))  # nothing left to destroy: nothing happens


def test_one_process_needs_no_group_for_its_collectives():
    t = torch.tensor([2.0])
    assert w.all_reduce_sum(t, World()) is t and t.tolist() == [2.0]
    assert w.gather_objects("x", World()) == ["x"]
    w.barrier(World())
    assert w.sum_over_ranks(["loss", "acc"], torch.tensor([3.0, 1.0]), 4, World()) == \
        {"loss": 0.75, "acc": 0.25}
    assert w.sum_over_ranks([], None, 0, World()) == {}


def test_collectives_over_a_group_have_one_slot_per_rank_in_rank_order(one_rank):
    two = World(rank=0, size=2)  # a group of this process alone: the other slot stays empty
    assert w.gather_objects({"step": 3}, two) == [{"step": 3}, None]
    w.barrier(two)
    t = torch.tensor([1.5, 2.0])
    assert w.all_reduce_sum(t, two) is t and t.tolist() == [1.5, 2.0]
    assert w.sum_over_ranks(["loss"], torch.tensor([3.0], dtype=torch.float16), 4, two) == \
        {"loss": 0.75}
    assert w.sum_over_ranks([], None, 0, two) == {}  # no rank saw a sample


def test_rank_zero_runs_the_function_and_its_user_error_stops_every_rank():
    calls = []
    assert w.rank_zero_first(lambda: calls.append(0) or "made", World()) == "made"
    assert w.rank_zero_first(lambda: calls.append(1), World(rank=1)) is None
    assert calls == [0]  # only rank 0 runs it
    refusal = ConfigError("run.dir exists")
    with pytest.raises(ConfigError) as e:
        w.rank_zero_first(lambda: (_ for _ in ()).throw(refusal), World())
    assert e.value is refusal
    with pytest.raises(ZeroDivisionError):  # not a user's mistake: a traceback
        w.rank_zero_first(lambda: 1 / 0, World())
    assert issubclass(w.CollectiveTimeout, UserError)


def test_a_lost_peer_becomes_one_line_naming_the_rank_and_the_restart(one_rank, monkeypatch):
    # gloo's two ways of saying the peer's process is gone (a broken collective mid-step)
    said = {"closed": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                      "closed by peer [127.0.0.1]:34191. This is typically caused by a remote "
                      "worker crashing.\nmore",
            "reset": "[../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.7]:5512: "
                     "Connection reset by peer"}

    @w.name_timeouts()
    def step(how):
        raise RuntimeError(said[how])

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)  # one_rank's group, seen as two
    with pytest.raises(w.RankLost) as e:
        step("closed")
    assert str(e.value).startswith("rank 0: lost rank 1 (at 127.0.0.1:34191) mid-collective")
    assert "torchrun restarts the group" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, UserError) and e.value.exit_code == 1
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)  # gloo names an address, no rank
    with pytest.raises(w.RankLost, match=r"^rank 0: lost a rank \(at 10\.0\.0\.7:5512\) "):
        step("reset")
