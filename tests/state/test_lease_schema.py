"""lease.json as untrusted input: a lease of the wrong shape names nobody (one line, and the
prefix is free), one from this host's future is expired, and no wait is longer than TTL_S (the
30 s the docs promise). Claims on a file:// store; the resumes are the tiny runs of
test_remote.py."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from ironloop.state.remote import lease as remote_lease
from ironloop.state.remote.store import open_remote
from tests.state.test_remote import StopAt, _config, _fit


def _planted(url: str, **fields) -> None:
    lease = {"lineage": "l" * 32, "run": "r" * 32, "host": "node-b", "pid": 77,
             "refreshed": time.time(), "released": False, **fields}
    open_remote(url).write(remote_lease.LEASE, json.dumps(lease).encode())


GARBLED = {
    "refreshed yesterday": {"refreshed": "yesterday"},
    "pid a string on this host": {"pid": "4242", "host": socket.gethostname()},
    "lineage a number": {"lineage": 12345},
    "pid zero on this host": {"pid": 0, "host": socket.gethostname()},
    "released a string": {"released": "no"},
    "run missing": {"run": None},
}


@pytest.mark.parametrize("case", sorted(GARBLED))
def test_a_garbled_lease_names_nobody_in_one_line_and_the_claim_takes_the_prefix(tmp_path,
                                                                               case):
    url = f"file://{tmp_path}/remote"
    _planted(url, **GARBLED[case])
    said: list[str] = []
    holder = remote_lease.claim(open_remote(url), resume=True, say=said.append)
    try:
        key = next(iter(GARBLED[case]))
        assert said == [f"notice: {url}/lease.json names no run (its {key} is "
                        f"{str(GARBLED[case][key])!r}): the prefix is taken as free"]
        assert remote_lease.read(open_remote(url)).run == holder.lease.run
    finally:
        holder.release()


@pytest.mark.parametrize("ahead", [86400.0, "inf", "nan"])
def test_a_lease_from_the_future_is_expired_saying_so_and_never_waited_for(tmp_path, ahead):
    url = f"file://{tmp_path}/remote"
    store = open_remote(url)
    refreshed = time.time() + ahead if isinstance(ahead, float) else float(ahead)
    # json.dumps writes inf and nan as Infinity and NaN, which json.loads reads back
    store.write(remote_lease.LEASE, json.dumps({
        "lineage": "l" * 32, "run": "r" * 32, "host": "node-b", "pid": 77,
        "refreshed": refreshed, "released": False}).encode())
    said: list[str] = []
    holder = remote_lease.claim(store, resume=True, say=said.append)
    try:
        assert len(said) == 1 and "waiting" not in said[0], said
        assert ("ahead of this host's clock" in said[0] if isinstance(ahead, float)
                else "names no run (its refreshed is" in said[0])
    finally:
        holder.release()


def test_a_lease_a_few_seconds_ahead_is_waited_for_at_most_ttl_s(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_lease, "TTL_S", 0.5)
    monkeypatch.setattr(remote_lease, "_POLL_S", 0.05)
    url = f"file://{tmp_path}/remote"
    _planted(url, refreshed=time.time() + 3.0)  # within SKEW_S: maybe a live run's
    said: list[str] = []
    holder = remote_lease.claim(open_remote(url), resume=True, say=said.append)
    holder.release()
    waits = [float(m) for line in said for m in re.findall(r"waiting up to (\S+) s", line)]
    assert len(waits) == 1 and waits[0] <= remote_lease.TTL_S, said  # the bound it states


@pytest.mark.parametrize("case", ["pid a string on this host", "refreshed yesterday",
                                  "lineage a number"])
def test_a_resume_past_a_garbled_lease_goes_on(tmp_path, capsys, case):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(7)])
    _planted(url, **GARBLED[case])
    _fit(config, resume=True, callbacks=[StopAt(9)])
    out = capsys.readouterr().out
    assert out.count("lease.json names no run") == 1, out
    assert remote_lease.read(open_remote(url)).released  # this run's, ended


def test_a_lease_larger_than_any_lease_names_nobody(tmp_path):
    url = f"file://{tmp_path}/remote"
    Path(tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "lease.json").write_bytes(b" " * (remote_lease.LEASE_CAP + 1))
    lease, why = remote_lease.look(open_remote(url))
    assert lease is None and "is larger than" in why
