"""A fetch that does not fit run.dir's disk: a remote checkpoint larger than the free space
(its manifest's sizes, logs included) is skipped with one line naming the shortfall and an
older one resumes; a local disk error during the download is run.dir's, not the store's."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from ironloop.errors import UserError
from ironloop.state.remote.fetch import FETCH_MARGIN, fetch_newest
from ironloop.state.remote.store import open_remote
from tests.state.test_remote import StopAt, _config, _fit

Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free: int) -> None:
    """run.dir's disk, as shutil.disk_usage reports it, with ``free`` bytes left."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(free * 2, free, free))


def _need(remote, step: int) -> int:
    manifest = remote.manifest(step)
    return sum(w["size"] for part in ("files", "logs") for w in manifest[part].values())


def _stopped_at_12(tmp_path: Path) -> tuple[dict, str]:
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    assert open_remote(url).manifests()[-2:] == [10, 12]
    return config, url


def test_a_newest_remote_checkpoint_too_large_for_run_dir_falls_back_to_one_that_fits(
        tmp_path, monkeypatch):
    _, url = _stopped_at_12(tmp_path)
    remote = open_remote(url)
    rel = "manifests/step-00000012.json"  # a 64 MB checkpoint, as its manifest declares
    manifest = json.loads(remote.read(rel))
    manifest["files"]["step-00000012.pt"]["size"] = 64 << 20
    remote.write(rel, json.dumps(manifest).encode())
    _free(monkeypatch, 8 << 20)
    lines: list[str] = []
    into = tmp_path / "new-node" / "checkpoints"
    got = fetch_newest(remote, into, -1, lines.append)
    assert got == into / "step-00000010.pt" and got.is_file()
    assert lines == [f"remote checkpoint {url}/step-00000012 does not fit: step-12 needs "
                     f"64.0 MB, run.dir has 8.0 MB free ({into.parent}); falling back to an "
                     f"older one (free space there to resume from it)"]


def test_a_new_node_with_room_for_the_older_checkpoint_only_resumes_from_it(
        tmp_path, monkeypatch, capsys):
    config, url = _stopped_at_12(tmp_path)
    remote = open_remote(url)
    assert _need(remote, 10) < _need(remote, 12)  # the logs grew by two steps' rows
    shutil.rmtree(tmp_path / "run")  # a new node
    _free(monkeypatch, _need(remote, 12) + FETCH_MARGIN - 1)
    _fit(config, resume=True, callbacks=[StopAt(13)])
    out = capsys.readouterr().out
    assert out.count("does not fit: step-12 needs") == 1, out
    assert f"fetched {url}/step-00000010.pt" in out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [10]


def test_a_local_disk_error_during_the_download_is_one_line_naming_run_dir_not_the_store(
        tmp_path, monkeypatch):
    config, url = _stopped_at_12(tmp_path)
    shutil.rmtree(tmp_path / "run")
    code = errno.ENOSPC

    def full(*args, **kw):  # the local disk filling up, as the copy into run.dir meets it
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "sendfile", full)
    with pytest.raises(UserError) as caught:
        _fit(config, resume=True, callbacks=[StopAt(13)])
    line = str(caught.value)
    assert type(caught.value) is UserError and "\n" not in line
    assert line.startswith(f"run.dir {tmp_path / 'run'} could not take {url}/step-00000012 "
                           f"({os.strerror(code)})"), line
    assert "free space in" in line and "cannot be used" not in line and "network" not in line
    assert not list((tmp_path / "run" / "checkpoints").glob(".remote-step-*"))  # cleaned


def test_a_new_node_with_room_for_no_remote_checkpoint_is_refused_naming_the_space(
        tmp_path, monkeypatch):
    from ironloop.errors import CheckpointError

    config, url = _stopped_at_12(tmp_path)
    shutil.rmtree(tmp_path / "run")  # a new node, and a disk with room for none of them
    _free(monkeypatch, FETCH_MARGIN)
    with pytest.raises(CheckpointError) as caught:
        _fit(config, resume=True, callbacks=[StopAt(13)])
    line = str(caught.value)
    assert line.startswith(f"every checkpoint in checkpoint.remote {url} is damaged or too "
                           f"large for run.dir's free space"), line
    assert "Free space in run.dir" in line
    assert sorted(open_remote(url).manifests())[-2:] == [10, 12]  # nothing was deleted
