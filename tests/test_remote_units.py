"""checkpoint.remote's parts in-process, on memory:// (no training run): the lease, the store's
names, the mirror's retries and retention. The end-to-end runs are in tests/test_remote*.py."""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid

import pytest

from ironloop.errors import UserError
from ironloop.state import remote_lease
from ironloop.state.remote_lease import Holder, Lease
from ironloop.state.remote_store import open_remote


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
    gate.set()
    deadline = time.monotonic() + 5
    while not wrote and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote_lease.read(remote).released
