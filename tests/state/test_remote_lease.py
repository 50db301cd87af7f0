"""state.remote.lease in-process, on memory:// (no training run): taking, waiting out, refreshing
and releasing a checkpoint.remote's lease. The end-to-end runs are in test_remote*.py."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid

import pytest

from ironloop.errors import CheckpointError, UserError
from ironloop.state.remote import lease as remote_lease
from ironloop.state.remote.lease import Holder, Lease
from ironloop.state.remote.store import StoreUnavailable, open_remote


@pytest.fixture
def remote():
    return open_remote(f"memory://units-{uuid.uuid4().hex}/prefix")


def test_a_lease_held_by_a_live_process_on_this_host_is_refused_at_once(remote):
    found = Lease("lineage", host=socket.gethostname(), pid=12345)
    with pytest.raises(UserError) as e:
        remote_lease._wait_out(remote, found, say=pytest.fail)
    assert str(e.value) == (
        f"checkpoint.remote {remote.url} is in use by {found.who()}, which runs on this host; "
        f"a second writer would delete its checkpoints: wait for it to end (or stop it), or "
        f"choose another checkpoint.remote")


def test_a_lease_not_refreshed_is_waited_out_until_it_expires(remote, monkeypatch):
    monkeypatch.setattr(remote_lease, "TTL_S", 0.6)
    monkeypatch.setattr(remote_lease, "_POLL_S", 0.05)
    found = Lease("lineage", host="another-node", refreshed=time.time())
    remote_lease._write(remote, found)
    said: list[str] = []
    start = time.time()
    remote_lease._wait_out(remote, found, said.append)
    assert time.time() >= found.refreshed + 0.6 and time.time() - start < 5
    assert said == [f"notice: checkpoint.remote {remote.url} is leased to {found.who()}; "
                    f"waiting up to 1 s for the lease to expire, as a killed run's does"]


def test_a_lease_is_live_up_to_exactly_ttl_s_after_its_last_refresh(monkeypatch):
    found = Lease("lineage", host="another-node", refreshed=1000.0)
    now = [1000.0 + remote_lease.TTL_S]
    monkeypatch.setattr(remote_lease.time, "time", lambda: now[0])
    assert found.live()  # at TTL_S exactly: not yet expired
    now[0] += 0.001
    assert not found.live()


def _a_pid_that_is_gone() -> int:
    """A pid no process has: one above the kernel's pid_max (a killed run's, in effect)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid = int(f.read()) + 1
    except OSError:
        pid = 2**22 + 1
    assert not remote_lease.alive(pid)
    return pid


@pytest.mark.usefixtures("quick_lease")
def test_a_lease_on_this_host_is_live_while_its_process_lives_or_this_process_holds_it(remote):
    here = socket.gethostname()
    killed = Lease("lineage", host=here, pid=_a_pid_that_is_gone())
    assert not killed.live()  # its process is gone: nobody refreshes it any more
    assert Lease("lineage", host=here, pid=os.getppid()).live()  # another live process's
    ours = Lease("lineage", host=here)  # this process's pid, a run it no longer holds
    assert not ours.live()
    holder = Holder(remote, ours)  # this process holds it: live, though its pid is ours
    try:
        assert ours.live()
    finally:
        holder.release(wait_s=5)
    assert not ours.live()
    # the killed run's prefix is taken over at once by its restart, without waiting TTL_S
    remote_lease._write(remote, killed)
    restarted = remote_lease.claim(remote, resume=True, say=pytest.fail)
    try:
        assert remote_lease.read(remote).run == restarted.lease.run != killed.run
        assert restarted.lease.lineage == "lineage"
    finally:
        restarted.release(wait_s=5)


@pytest.mark.parametrize(("ago", "said"), [(0.4, "0"), (-2.0, "0"), (7.6, "8")],
                         ids=["just-now", "clock-ahead", "seconds-ago"])
def test_a_fresh_run_refused_a_live_prefix_is_told_how_long_ago_its_lease_was_refreshed(
        remote, monkeypatch, ago, said):
    now = 1_000_000.0
    monkeypatch.setattr(remote_lease.time, "time", lambda: now)
    found = Lease("lineage", host="another-node", pid=77, refreshed=now - ago)
    remote_lease._write(remote, found)
    with pytest.raises(UserError) as e:
        remote_lease.claim(remote, resume=False, say=pytest.fail)
    assert str(e.value) == (
        f"checkpoint.remote {remote.url} is in use by {found.who()}, whose lease was refreshed "
        f"{said} s ago; wait for that run to end, or choose another checkpoint.remote")
    assert remote_lease.read(remote) == found  # its lease stays


@pytest.mark.parametrize("then", ["released", "deleted"])
def test_a_lease_released_or_gone_while_waiting_ends_the_wait(remote, monkeypatch, then):
    monkeypatch.setattr(remote_lease, "_POLL_S", 0.01)
    found = Lease("lineage", host="another-node")
    remote_lease._write(remote, found)
    if then == "released":
        remote_lease._write(remote, Lease("lineage", run=found.run, host="another-node",
                                          pid=found.pid, refreshed=found.refreshed,
                                          released=True))
    else:
        remote.delete(remote_lease.LEASE)
    start = time.time()
    remote_lease._wait_out(remote, found, lambda _: None)
    assert time.time() - start < 5  # not the 30 s of TTL_S


def test_a_lease_refreshed_while_waiting_is_refused_naming_its_run(remote, monkeypatch):
    monkeypatch.setattr(remote_lease, "_POLL_S", 0.01)
    found = Lease("lineage", host="another-node", refreshed=time.time() - 5)
    newer = Lease("lineage", run=found.run, host="another-node", pid=found.pid)
    remote_lease._write(remote, newer)
    with pytest.raises(UserError, match=re.escape(f"is in use by {newer.who()}, which "
                                                  f"refreshed its lease just now;")):
        remote_lease._wait_out(remote, found, lambda _: None)


def test_a_claim_whose_lease_reads_back_as_nobodys_is_refused_as_taken_by_another_run(
        remote, monkeypatch):
    """The other run's write landed last, garbled or not yet readable: no run can be named."""
    monkeypatch.setattr(remote_lease, "SETTLE_S", 0)
    monkeypatch.setattr(remote_lease, "read", lambda _remote: None)
    with pytest.raises(UserError) as e:
        remote_lease.claim(remote, resume=False)
    assert str(e.value) == (
        f"checkpoint.remote {remote.url} was claimed by another run at the same moment as this "
        f"run; one writer per prefix: choose another checkpoint.remote, or resume that one")


def test_the_lease_read_back_has_every_field_and_a_garbled_one_names_nobody(remote):
    mine = Lease("abc", run="r" * 32, host="h", pid=7, refreshed=12.5, released=True)
    remote_lease._write(remote, mine)
    assert remote_lease.read(remote) == mine
    remote.write(remote_lease.LEASE, b'{"lineage": "abc"}')
    assert remote_lease.read(remote) is None
    remote.write(remote_lease.LEASE, b"not json")
    assert remote_lease.read(remote) is None


def test_release_marks_the_lease_released_without_waiting_on_a_stalled_store(remote):
    holder = Holder(remote, Lease("lineage"))
    gate, wrote = threading.Event(), []
    real = remote.write

    def stalled(rel, data):
        gate.wait(10)
        wrote.append(rel)
        real(rel, data)

    remote.write = stalled
    start = time.monotonic()
    holder.release(wait_s=0.0)
    assert time.monotonic() - start < 0.5  # the store's stall is not the run's end's
    assert holder.lease.released and remote_lease.held(remote.url) is None
    stalled_writers = [t for t in threading.enumerate() if t.name == "ironloop-remote-lease"]
    assert stalled_writers and all(t.daemon for t in stalled_writers)  # never holds the exit
    gate.set()
    deadline = time.monotonic() + 5
    while not wrote and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote_lease.read(remote).released


def test_a_lease_names_its_run_by_the_first_8_characters_of_its_id_its_pid_and_host():
    lease = Lease("lineage", run="0123456789abcdef", host="node7", pid=4242)
    assert lease.who() == "run 01234567 (pid 4242 on node7)"


def test_a_holder_is_this_processs_lease_on_its_url_until_released(remote):
    holder = Holder(remote, Lease("lineage"))
    assert remote_lease.held(remote.url) is holder
    assert remote_lease.held(remote.url + "/") is holder
    holder.release()
    assert remote_lease.held(remote.url) is None


def test_a_started_holder_refreshes_its_lease_in_the_store(remote, monkeypatch):
    monkeypatch.setattr(remote_lease, "TTL_S", 0.06)  # a refresh every 0.02 s
    lease = Lease("lineage", refreshed=0.0)
    holder = Holder(remote, lease)
    said: list[str] = []
    holder.start(said.append)
    deadline = time.monotonic() + 5
    while remote_lease.read(remote) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    holder.release(wait_s=5)
    back = remote_lease.read(remote)
    assert back is not None and back.run == lease.run and back.refreshed > 0.0 and said == []


class _Ticks:
    """A holder's stop event whose wait returns at once: ``ticks`` refreshes, then stopped.
    Records each wait's timeout, so the refresher runs in the test's own thread."""

    def __init__(self, ticks: int):
        self.ticks, self.waited = ticks, []

    def wait(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return len(self.waited) > self.ticks

    def set(self) -> None:
        pass


def test_the_refresher_rewrites_the_lease_every_third_of_ttl_s_until_stopped(remote):
    lease = Lease("lineage", refreshed=0.0)
    holder = Holder(remote, lease)
    holder._stop = _Ticks(2)
    said: list[str] = []
    before = time.time()
    holder._refresh(said.append)
    try:
        assert holder._stop.waited == [remote_lease.TTL_S / 3] * 3  # two ticks, then stopped
        back = remote_lease.read(remote)
        assert back == lease and back.refreshed >= before and not back.released
        assert holder.owned and said == []
    finally:
        holder.release(wait_s=5)


@pytest.mark.parametrize("error", [StoreUnavailable("checkpoint.remote x cannot be used"),
                                   CheckpointError("garbled")], ids=["outage", "damage"])
def test_the_refresher_rides_out_a_store_error_and_refreshes_at_the_next_tick(remote, error):
    lease = Lease("lineage", refreshed=0.0)
    holder = Holder(remote, lease)
    holder._stop = _Ticks(2)
    real, calls = remote.read, []

    def down_once(rel, **kw):
        calls.append(rel)
        if len(calls) == 1:
            raise error
        return real(rel, **kw)

    remote.read = down_once
    holder._refresh(pytest.fail)
    try:
        assert len(calls) == 2 and len(holder._stop.waited) == 3  # the first tick failed
        assert remote_lease.read(remote).refreshed > 0.0  # the second one refreshed it
    finally:
        holder.release(wait_s=5)


def test_a_lease_taken_over_stops_its_refresher_and_its_release_writes_nothing(remote):
    mine = Lease("lineage")
    holder = Holder(remote, mine)
    other = Lease("lineage", host="another-node", pid=77)
    remote_lease._write(remote, other)
    holder._stop = _Ticks(3)
    said: list[str] = []
    holder._refresh(said.append)
    assert len(holder._stop.waited) == 1 and not holder.owned  # stopped at the first tick
    assert said == [f"warning: checkpoint.remote {remote.url} was taken over by {other.who()}; "
                    f"this run uploads on but deletes nothing there"]
    holder.release(wait_s=5)
    assert remote_lease.read(remote) == other  # not marked released by the run it lost to


def test_the_lease_refresher_is_a_daemon_thread_that_never_holds_the_exit(remote):
    holder = Holder(remote, Lease("lineage"))
    before = set(threading.enumerate())
    holder.start(pytest.fail)
    try:
        started = [t for t in threading.enumerate() if t not in before]
        assert [(t.name, t.daemon) for t in started] == [("ironloop-remote-lease", True)]
        assert holder.started
    finally:
        holder.release(wait_s=5)
