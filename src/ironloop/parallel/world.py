"""torch.distributed wiring for torchrun: init from the environment, rank-0 helpers."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from ironloop.errors import RankZeroError, UserError

T = TypeVar("T")

RENDEZVOUS_TIMEOUT_S = 900.0  # seconds every rank may take to join the process group
STORE_KEY = "ironloop/group_store/{}"  # in torchrun's store: the n-th group's host:port:token
TOKEN_KEY = "ironloop/token"  # in the attempt's own store: rank 0's token
_GROUPS = itertools.count()  # the groups this process joined, in order
MEET_TRY_S = 5.0  # seconds one try to reach rank 0's store may take (a dead address fails)


class CollectiveTimeout(UserError):
    """Another rank did not answer within dist.timeout_s."""


class RankLost(UserError):
    """Another rank's process (or its node) is gone mid-collective: not the user's mistake, but
    one line and no traceback; exit 1, which torchrun answers with a restart of the group."""

    exit_code = 1


#: what gloo says when the peer of a collective is gone (its process killed, its node down)
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    owns_group: bool = False  # fit() created the process group, so fit() destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def env_world_size() -> int:
    """The number of ranks torchrun starts (WORLD_SIZE), known before the group is joined."""
    return env_int("WORLD_SIZE", 1)


def env_int(name: str, default: int) -> int:
    """A rank variable torchrun (or SLURM, engine/slurm.py) sets, read as a whole number >= 0;
    anything else is one line naming it, not int()'s traceback."""
    raw = os.environ.get(name, str(default))
    if not (raw.isascii() and raw.strip().isdigit()):
        raise UserError(f"environment variable {name}={raw!r}: must be a whole number >= 0 "
                        f"(torchrun sets it); unset it to train in one process, or start the "
                        f"run with torchrun")
    return int(raw)


# What dist.rendezvous("env://") reads: without one, a traceback from inside torch.
RENDEZVOUS_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def check_env() -> None:
    """The rank variables refused before anything is built (``engine.resolved``), not when the
    group is joined after the preflight."""
    size, _ = env_world_size(), env_int("LOCAL_RANK", 0)
    if size > 1 and not dist.is_initialized():
        _refuse_partial_env(size)


def _refuse_partial_env(size: int) -> None:
    """WORLD_SIZE > 1 set by hand, without the rest of what torchrun sets."""
    missing = [v for v in RENDEZVOUS_VARS if not os.environ.get(v)]
    if missing:
        raise UserError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: a run over "
                        f"several processes needs the variables torchrun sets; start it with "
                        f"torchrun --nproc-per-node={size}, or unset WORLD_SIZE for one process")
    env_int("RANK", 0)


def init_from_env(device_type: str, timeout_s: float = 600.0) -> World:
    """Join the process group that torchrun describes in WORLD_SIZE/RANK/LOCAL_RANK, if any.

    ``timeout_s`` bounds every collective of the training loop (``collective_timeout``): a rank
    that stops answering (stopped, hung, its node gone) makes the others fail after that long
    instead of waiting forever. Meeting rank 0 of this attempt waits up to ``timeout_s``
    (``_fresh_store``); the setup before the loop waits up to ``RENDEZVOUS_TIMEOUT_S`` (or
    ``timeout_s`` when longer) for the other ranks.
    """
    size = env_world_size()
    if size <= 1:
        return World()
    owns = not dist.is_initialized()
    local = env_int("LOCAL_RANK", 0)
    if owns:  # the env's rank variables were checked before anything was built (check_env)
        # Joining and setting up get their own, generous timeout: ranks start seconds to minutes
        # apart (imports on a busy node, a slow filesystem) and rank 0 alone prepares run.dir,
        # which says nothing about a hung collective. The loop sets dist.timeout_s
        # (collective_timeout below).
        joining = timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
        backend = "nccl" if device_type == "cuda" else "gloo"
        # Every attempt (the first and each elastic restart) meets in a store of its own: the
        # agents' restart counts differ after one worker's crash, so nothing per-agent names it.
        store, rank, size = next(dist.rendezvous("env://", timeout=joining))
        dist.init_process_group(backend=backend, timeout=joining, rank=rank, world_size=size,
                                store=_fresh_store(store, rank, size, joining, timeout_s,
                                                   next(_GROUPS)))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    return World(rank=dist.get_rank(), local_rank=local, size=dist.get_world_size(),
                 owns_group=owns)


def collective_timeout(world: World, timeout_s: float) -> None:
    """Every collective from here on (the training loop) gives up after ``timeout_s``."""
    if world.owns_group and dist.is_initialized():
        # private in torch, but the one way to change a live group's timeout (gloo and NCCL)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))


@contextlib.contextmanager
def name_timeouts() -> Iterator[None]:
    """Turn a collective's timeout (gloo raises a RuntimeError "Timed out waiting Nms ...") into
    a CollectiveTimeout that names ``dist.timeout_s``: the CLI prints it on one line and exits
    non-zero, instead of a traceback from deep inside DDP or FSDP. (NCCL's watchdog aborts the
    process itself, with its own message naming the timeout.) A ``with`` block around the run,
    so that a reader of the front door sees it; ``@name_timeouts()`` also decorates."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        if dist.is_initialized() and any(g in first.lower() for g in PEER_GONE):
            raise RankLost(lost_rank_line(dist.get_rank(), dist.get_world_size(), first)) from e
        if not dist.is_initialized() or "timed out" not in first.lower():
            raise
        rank = dist.get_rank()
        raise CollectiveTimeout(
            f"rank {rank}: a collective waited longer than dist.timeout_s for another rank, "
            f"which stopped responding (hung, stopped, or its node is gone); this rank gives "
            f"up. Check the other ranks' logs; if a step or a checkpoint legitimately takes "
            f"that long, raise dist.timeout_s. ({first[-160:]})") from e


def lost_rank_line(rank: int, size: int, said: str) -> str:
    """The one line for a collective whose peer is gone: which rank (in a group of two, the
    other; gloo names only the peer's address), and what happens next."""
    peer = re.search(r"\[([^\]]+)\]:(\d+)", said.split("]", 1)[-1])  # past gloo's [file:line]
    who = f"rank {1 - rank}" if size == 2 else "a rank"
    at = f" (at {peer[1]}:{peer[2]})" if peer else ""
    return (f"rank {rank}: lost {who}{at} mid-collective (its process or node is gone); this "
            f"rank stops and torchrun restarts the group with the ranks that are left (or "
            f"come back), from the newest checkpoint with --resume, while --max-restarts "
            f"remain. Without torchrun, restart the job with --resume")


def _fresh_store(agent_store, rank: int, size: int, timeout: timedelta, meet_s: float,
                 group: int):
    """A new, empty TCPStore for this attempt of the group, hosted by rank 0.

    torchrun's agent keeps one store for the whole job, so after a restart the previous
    attempt's addresses are still in it and gloo would connect to the dead ranks' ports
    ("connectFullMesh failed ... Connection refused"). Rank 0 publishes the new store's address
    and a token of its own under one key; the others take the address whose store holds that
    token, so a stale address (the previous attempt's rank 0, gone) is passed over whatever
    each agent's restart count says. The key counts the groups this process joined (a torchrun
    job that trains several runs, one after another, joins one per run: every rank in the same
    order). Waiting for rank 0 is bounded by ``meet_s``
    (dist.timeout_s), with one line. (Wrapping the agent's store in a PrefixStore instead made
    gloo's destructor deadlock on the GIL at exit, about half the time.)
    """
    key = STORE_KEY.format(group)
    if rank == 0:
        host = socket.gethostname()
        fresh = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout,
                              wait_for_workers=False)  # they learn the port only below
        token = uuid.uuid4().hex
        fresh.set(TOKEN_KEY, token)
        agent_store.set(key, f"{host}:{fresh.port}:{token}")
        return fresh
    deadline = time.monotonic() + meet_s
    agent_store.set_timeout(timedelta(seconds=meet_s))
    while time.monotonic() < deadline:
        try:
            host, port, token = agent_store.get(key).decode().rsplit(":", 2)
            # a plain connect first: a dead address is refused without TCPStore's C++ dump
            socket.create_connection((host, int(port)), timeout=MEET_TRY_S).close()
            fresh = dist.TCPStore(host, int(port), size, is_master=False,
                                  timeout=timedelta(seconds=MEET_TRY_S))
            if fresh.get(TOKEN_KEY).decode() == token:
                fresh.set_timeout(timeout)
                return fresh
        except (RuntimeError, ValueError, OSError):  # gone, refused, not there yet
            pass
        time.sleep(MEET_TRY_S / 10)  # rank 0 of this attempt has not published yet
    raise CollectiveTimeout(
        f"rank {rank}: rank 0 of this attempt did not publish its store within "
        f"dist.timeout_s={meet_s:g} s (still starting, or its node is gone); this rank gives "
        f"up and torchrun restarts the group, if restarts remain. Check rank 0's log; raise "
        f"dist.timeout_s if ranks legitimately start that far apart")


def shutdown(world: World) -> None:
    """Destroy a process group fit() created. Exiting with a live gloo group can abort the
    process ("terminate called without an active exception") after training succeeded."""
    if world.owns_group and dist.is_initialized():
        # A DDP wrapper freed after its process group hangs in gloo's destructor (or aborts the
        # process): fit() drops its run first, and a run still in a reference cycle (a
        # callback's view of it) is collected here, while the group lives.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj, world: World) -> list:
    """``obj`` from every rank, in rank order (a collective; ``[obj]`` in one process)."""
    if not world.distributed:
        return [obj]
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def rank_zero_first(fn: Callable[[], T], world: World) -> T | None:
    """``fn()`` on rank 0 (None on the others), then a collective: a UserError it raised stops
    every rank with the same line (a ``RankZeroError`` on the others). A rank left waiting in
    a barrier for a rank that stopped dies with gloo's "Connection closed by peer" traceback."""
    result, refusal = None, None
    if world.is_main:
        try:
            result = fn()
        except UserError as e:
            refusal = e
    said = gather_objects(None if refusal is None else str(refusal), world)[0]
    if refusal is not None:
        raise refusal
    if said is not None:
        raise RankZeroError(said)
    return result


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def sum_over_ranks(names: list[str], sums: torch.Tensor | None, count: int,
                   world: World) -> dict[str, float]:
    """{name: sum over ranks / sample count over ranks}, from each rank's sums of value * n.

    A rank that saw no sample (fewer samples than ranks) passes ``sums=None`` and no names; it
    still joins the all-reduce, with zeros, after learning the names from the others.
    Returns {} when no rank saw a sample.
    """
    if world.distributed:
        gathered: list = [None] * world.size
        dist.all_gather_object(gathered, names if sums is not None else None)
        names = next((g for g in gathered if g is not None), [])
        if not names:
            return {}
        if sums is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend() == "nccl" else torch.device("cpu")
            sums = torch.zeros(len(names), dtype=torch.float64, device=device)  # as evaluate's
    if sums is None:
        return {}
    # float64 over ranks: every rank sends the same dtype, whatever its local sums are in.
    sums = sums.double()
    counts = torch.as_tensor(count, dtype=sums.dtype, device=sums.device).reshape(1)
    totals = all_reduce_sum(torch.cat([sums, counts]), world).tolist()  # host sync, once per eval
    return {k: v / totals[-1] for k, v in zip(names, totals[:-1])}
