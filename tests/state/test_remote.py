"""checkpoint.remote: the background mirror to object storage (fsspec) and resume from it.

The fast cases use ``file://`` and an in-memory filesystem; the S3 cases run against moto's
standalone server, started here on 127.0.0.1 (no other network is needed), through s3fs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from safetensors.torch import load_file

from ironloop import fit
from ironloop.callbacks import Callback
from ironloop.errors import UserError
from ironloop.outputs.readers import read_jsonl
from ironloop.state import dcp as sharded
from ironloop.state.export import export_run
from ironloop.state.io import file_digest, save_atomic
from ironloop.state.remote import mirror as remote_module
from ironloop.state.remote.fetch import fetch_newest
from ironloop.state.remote.manifest import LOGS
from ironloop.state.remote.mirror import Mirror
from ironloop.state.remote.store import open_remote
from ironloop.state.run_dir import OUTPUTS as RUN_OUTPUTS
from tests.conftest import REPO, StopAt, blobs, cfg, logged_step, tiny_mlp

pytestmark = pytest.mark.usefixtures("quick_lease")

STEPS = 28  # 4 epochs of ceil(200 / 32) = 7 steps


def _config(tmp_path: Path, run: str = "run", **more) -> dict:
    base = {"run__dir": str(tmp_path / run), "train__epochs": 4,
            "checkpoint__every_steps": 5, "checkpoint__keep_last": 3}
    return cfg(tmp_path, **{**base, **more})


def _fit(config: dict, **kw):
    return fit(tiny_mlp(), blobs(), blobs(64, seed=1), config, **kw).model.state_dict()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# what the logs' rows must repeat across a resume (wall-clock fields such as time differ)
ROW_KEYS = {"metrics": ("step", "epoch", "loss", "lr"), "evals": ("step", "val_loss", "val_acc"),
            "epochs": ("epoch", "step", "train_loss", "val_loss", "val_acc", "lr"),
            "scalars": ("step", "epoch", "n"), "events": ("event", "step", "epoch")}


def _rows(run_dir: Path, name: str) -> list[tuple]:
    return [tuple(row.get(k) for k in ROW_KEYS[name])
            for row in read_jsonl(run_dir / f"{name}.jsonl")]


class Scalars(Callback):
    """One scalars.jsonl line per step, so that log is part of the history too."""

    def on_step_end(self, run, metrics: dict) -> None:
        run.log_scalars({"n": run.step})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The uninterrupted run's final weights: one run for every test of the module that
    compares a resumed run with it (they only read it)."""
    return _fit(_config(tmp_path_factory.mktemp("uninterrupted"), "plain"))


# -------------------------------------------------------------------------------- file:// --
def test_each_checkpoint_lands_remotely_with_the_same_bytes_and_a_manifest(tmp_path):
    url = f"file://{tmp_path}/remote"
    _fit(_config(tmp_path, checkpoint__remote=url, checkpoint__keep_last=2))
    remote = open_remote(url)
    steps = remote.manifests()
    assert steps[-1] == STEPS
    older = steps[:-2]  # past keep_last: only the newest best save may stay
    assert len(older) <= 1 and all(remote.manifest(s)["best"] for s in older)
    local = tmp_path / "run" / "checkpoints"
    for step in steps:
        manifest = remote.manifest(step)
        name = f"step-{step:08d}.pt"
        assert list(manifest["files"]) == [name] and manifest["kind"] == "file"
        ours = tmp_path / "remote" / name
        if (local / name).exists() or step in older:
            mine = local / name if (local / name).exists() else local / "best.pt"  # older best
            assert ours.read_bytes() == mine.read_bytes()
        else:  # the upload after it was superseded (dropped): keep_last deleted it only here
            assert file_digest(ours) == manifest["files"][name]["blake2b"]
    assert not list((local / ".remote-staging").rglob("*.pt"))  # the upload's links are gone


@pytest.mark.parametrize("async_write", [False, True])
def test_resume_into_an_empty_run_dir_fetches_the_newest_and_is_bit_exact(tmp_path, capsys,
                                                                          uninterrupted,
                                                                          async_write):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url, checkpoint__async=async_write)
    _fit(config, callbacks=[StopAt(12)])
    assert open_remote(url).manifests()[-1] == 12
    shutil.rmtree(tmp_path / "run")  # a new node: run.dir is empty
    resumed = _fit(config, resume=True)
    out = capsys.readouterr().out
    assert f"fetched {url}/step-00000012.pt" in out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [12]
    assert _equal(resumed, uninterrupted)


def test_each_checkpoint_carries_the_logs_of_its_step_and_retention_deletes_them(tmp_path):
    url = f"file://{tmp_path}/remote"
    _fit(_config(tmp_path, checkpoint__remote=url, checkpoint__keep_last=2))
    remote = open_remote(url)
    steps = remote.manifests()
    assert sorted(remote.step_objects()) == steps  # retention took the logs with their step
    assert remote.names("logs") == [f"step-{s:08d}" for s in steps]
    for step in steps:
        logs = remote.manifest(step)["logs"]
        names = [rel.rsplit("/", 1)[1] for rel in logs]
        assert {"metrics.jsonl", "epochs.jsonl", "events.jsonl", "run.json"} <= set(names)
        assert all(rel == f"logs/step-{step:08d}/{n}" for rel, n in zip(logs, names))
        metrics = read_jsonl(tmp_path / "remote" / "logs" / f"step-{step:08d}" / "metrics.jsonl")
        assert metrics[-1]["step"] == step  # copied at the save: none of the later rows
    assert set(LOGS) <= set(RUN_OUTPUTS)  # --overwrite removes what a resume restores


@pytest.fixture(scope="module")
def plain_with_scalars(tmp_path_factory) -> Path:
    """An uninterrupted run that logs scalars.jsonl too (both parameters read its logs)."""
    root = tmp_path_factory.mktemp("scalars")
    _fit(_config(root, "plain"), callbacks=[Scalars()])
    return root / "plain"


@pytest.mark.parametrize("async_write", [False, True])
def test_a_new_node_resume_restores_the_logs_and_continues_them_as_a_local_resume(
        tmp_path, capsys, async_write, plain_with_scalars):
    plain = plain_with_scalars
    runs = {}
    for where in ("local", "node"):  # the same interruption; one node loses its disk
        config = _config(tmp_path, where, checkpoint__remote=f"file://{tmp_path}/r-{where}",
                         checkpoint__async=async_write)
        _fit(config, callbacks=[StopAt(12), Scalars()])
        if where == "node":
            shutil.rmtree(tmp_path / where)
        _fit(config, resume=True, callbacks=[Scalars()])
        runs[where] = tmp_path / where
    for name in ("metrics", "epochs", "scalars"):  # from step 1, each row once
        assert _rows(runs["node"], name) == _rows(plain, name), name
    for name in ROW_KEYS:  # evals holds the stop's final evaluation, as a local resume's does
        assert _rows(runs["node"], name) == _rows(runs["local"], name), name
    assert len(json.loads((runs["node"] / "run.json").read_text())["resumes"]) == 1
    assert (f"notice: restored metrics.jsonl, epochs.jsonl, evals.jsonl, scalars.jsonl, "
            f"events.jsonl, guard.jsonl, run.json from file://{tmp_path}/r-node/logs/"
            f"step-00000012: the run's logs up to step 12\n") in capsys.readouterr().out


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_remote_logs_are_skipped_with_a_warning_and_the_checkpoint_resumes(
        tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    _damage(tmp_path / "remote" / "logs" / "step-00000012" / "epochs.jsonl")
    shutil.rmtree(tmp_path / "run")
    _fit(config, resume=True)
    out = capsys.readouterr().out
    assert (f"\nwarning: the remote logs {url}/logs/step-00000012 are damaged (logs/"
            f"step-00000012/epochs.jsonl checksum mismatch); resuming without them: run.dir's "
            f"logs start at step 12\n") in out
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [12]  # that checkpoint
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["step"] == 13  # none restored


def test_a_manifest_without_logs_still_resumes_without_them(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    remote = open_remote(url)
    for step in remote.manifests():  # what an older ironloop wrote: no logs at all
        old = {k: v for k, v in remote.manifest(step).items() if k != "logs"}
        remote.write(f"manifests/step-{step:08d}.json", json.dumps(old).encode())
    remote.delete("logs")
    shutil.rmtree(tmp_path / "run")
    _fit(config, resume=True)
    out = capsys.readouterr().out
    assert (f"fetched {url}/step-00000012.pt" in out and "notice: the remote checkpoint of "
            "step 12 holds no logs (an older ironloop wrote it): run.dir's logs start at step "
            "12\n") in out
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["step"] == 13
    assert open_remote(url).manifest(STEPS)["logs"]  # its own checkpoints carry them again


def test_logs_already_in_run_dir_are_kept_with_a_notice(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(7)])
    shutil.copytree(tmp_path / "run", tmp_path / "old")
    _fit(config, resume=True, callbacks=[StopAt(12)])  # on another node
    shutil.rmtree(tmp_path / "run")  # back on this node, whose disk still holds step 7
    shutil.copytree(tmp_path / "old", tmp_path / "run")
    _fit(config, resume=True, callbacks=[StopAt(13)])
    out = capsys.readouterr().out
    assert f"fetched {url}/step-00000012.pt" in out
    assert (f"notice: kept run.dir's own metrics.jsonl, epochs.jsonl, evals.jsonl, "
            f"scalars.jsonl, events.jsonl, guard.jsonl, run.json; the remote's logs at step 12 "
            f"({url}/logs/step-00000012) were not downloaded (delete the local ones to take "
            f"them)\n") in out
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [*range(1, 8), 13]  # its own, then the run's


@pytest.mark.parametrize("validates", [True, False])
def test_a_new_node_resume_fetches_the_best_save_even_at_step_1_and_needs_none(tmp_path,
                                                                             validates):
    """One step, saved as the best (with validation) or as no best (without): a new node's
    resume brings best.pt back, the first step's included, or resumes without one."""
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url, train__max_steps=1)
    val = blobs(64, seed=1) if validates else None
    fit(tiny_mlp(), blobs(), val, config)
    assert open_remote(url).manifests() == [1]
    shutil.rmtree(tmp_path / "run")  # a new node: run.dir is empty
    fit(tiny_mlp(), blobs(), val, config, resume=True)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    assert best.exists() is validates
    if validates:
        assert best.read_bytes() == (tmp_path / "remote" / "step-00000001.pt").read_bytes()


def test_a_newer_local_checkpoint_wins_over_an_older_remote_one(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    open_remote(url).remove_checkpoint(12)  # the remote lags one checkpoint behind
    _fit(config, resume=True, callbacks=[StopAt(13)])
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [12]
    assert "fetched" not in capsys.readouterr().out


def test_a_newer_remote_checkpoint_wins_over_an_older_local_one(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(7)])
    shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "old")
    _fit(config, resume=True, callbacks=[StopAt(12)])
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # this node still holds step 7 only
    shutil.copytree(tmp_path / "old", tmp_path / "run" / "checkpoints")
    _fit(config, resume=True, callbacks=[StopAt(13)])
    assert f"fetched {url}/step-00000012.pt" in capsys.readouterr().out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"][-1] == 12


def test_an_incomplete_remote_checkpoint_does_not_count_and_is_cleaned(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    remote = open_remote(url)
    # what a kill mid-upload leaves: the next checkpoint's file, no manifest
    remote.put(tmp_path / "run" / "checkpoints" / "step-00000012.pt", "step-00000015.pt")
    remote.put(tmp_path / "run" / "metrics.jsonl", "logs/step-00000015/metrics.jsonl")
    shutil.rmtree(tmp_path / "run")
    _fit(config, resume=True, callbacks=[StopAt(13)])
    assert "fetched" in capsys.readouterr().out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [12]
    assert 15 not in remote.step_objects()  # removed: past the step this run resumed from
    assert "step-00000015" not in remote.names("logs")


def test_a_fresh_run_into_a_remote_holding_checkpoints_is_refused_then_overwritten(tmp_path):
    url = f"file://{tmp_path}/remote"
    _fit(_config(tmp_path, checkpoint__remote=url), callbacks=[StopAt(5)])
    with pytest.raises(UserError, match=r"checkpoint\.remote .* already holds .* resume=True"):
        _fit(_config(tmp_path, "other", checkpoint__remote=url))
    assert open_remote(url).manifests() == [5]
    _fit(_config(tmp_path, "other", checkpoint__remote=url), overwrite=True,
         callbacks=[StopAt(3)])
    assert open_remote(url).manifests() == [3]


def test_export_reads_a_remote_run(tmp_path):
    url = f"file://{tmp_path}/remote"
    weights = _fit(_config(tmp_path, checkpoint__remote=url), callbacks=[StopAt(12)])
    out = export_run(url, tmp_path / "m.safetensors", "last")
    exported = load_file(out)
    assert all(torch.equal(exported[k], weights[k]) for k in weights)


def test_export_from_a_remote_replaces_with_force_and_names_the_fix_when_it_finds_none(
        tmp_path):
    url = f"file://{tmp_path}/remote"
    fit(tiny_mlp(), blobs(), None, _config(tmp_path, checkpoint__remote=url,
                                          train__max_steps=5))  # no validation: no best save
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"an older export")
    with pytest.raises(UserError, match="already exists; pass --force"):
        export_run(url, out, "last")
    assert export_run(url, out, "last", force=True) == out and load_file(out)
    with pytest.raises(UserError, match=r"holds no complete best checkpoint: pass --which last"):
        export_run(url, out, "best", force=True)
    empty = f"file://{tmp_path}/empty"
    with pytest.raises(UserError, match=r"no complete best checkpoint; is it a checkpoint\.remote"):
        export_run(empty, out, "best", force=True)


def test_remote_options_reach_the_fsspec_filesystem(tmp_path):
    # checkpoint.remote_options: an S3 endpoint, credentials, ... here a local filesystem's own
    url = f"file://{tmp_path}/remote"
    assert open_remote(url, {"auto_mkdir": True}).fs.auto_mkdir is True
    assert open_remote(url).fs.auto_mkdir is False


def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(UserError, match=r"pip install 'ironloop\[remote\]'"):
        _fit(_config(tmp_path, checkpoint__remote="s3://bucket/run"))
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "s3fs", None)
    # fsspec keeps the class of every protocol it has opened: an S3 test that ran before this
    # one in the same process would otherwise hand back the class without importing s3fs
    import fsspec  # noqa: F401 - fsspec.registry is its mapping; the module is in sys.modules
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    with pytest.raises(UserError, match=r"s3fs.*pip install 'ironloop\[remote\]'"):
        open_remote("s3://bucket/run")


# ------------------------------------------------------------- a store that fails or stalls --
class Flaky(MemoryFileSystem):
    """memory:// that fails the next ``fails`` uploads, and holds each upload until ``gate``
    is set (when there is one)."""

    protocol = "flaky"
    fails = 0
    gate: threading.Event | None = None
    refuse_manifests = False  # every manifest write fails (the files still land)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("flaky://"))

    def put_file(self, lpath, rpath, **kwargs):
        if Flaky.gate is not None:
            Flaky.gate.wait(120)
        if Flaky.fails > 0:
            Flaky.fails -= 1
            raise ConnectionResetError("injected: connection reset by peer")
        return super().put_file(lpath, rpath, **kwargs)

    def pipe_file(self, path, value, *args, **kwargs):
        if Flaky.refuse_manifests and "/manifests/step-" in path:
            raise ConnectionResetError("injected: manifest write refused")
        return super().pipe_file(path, value, *args, **kwargs)


fsspec.register_implementation("flaky", Flaky, clobber=True)


@pytest.fixture
def flaky(tmp_path):
    yield f"flaky://{tmp_path.name}"
    Flaky.fails, Flaky.gate, Flaky.refuse_manifests = 0, None, False


def test_an_upload_that_fails_a_few_times_is_retried_and_lands(tmp_path, flaky, capsys,
                                                               uninterrupted):
    Flaky.fails = 2
    weights = _fit(_config(tmp_path, checkpoint__remote=flaky))
    out = capsys.readouterr().out
    assert "retry 1 of 5" in out and "retry 2 of 5" in out and "retry 3" not in out
    assert "injected: connection reset" in out
    assert open_remote(flaky).manifests()[-1] == STEPS
    assert _equal(weights, uninterrupted)  # training never noticed


def test_an_upload_that_never_lands_warns_and_training_finishes(tmp_path, flaky, capsys,
                                                                uninterrupted):
    Flaky.fails = 10**6
    weights = _fit(_config(tmp_path, checkpoint__remote=flaky,
                           checkpoint__remote_retries=1))
    out = capsys.readouterr().out
    assert "was not uploaded" in out and "the local copy is intact" in out
    assert "remote: no checkpoint uploaded" in out
    assert open_remote(flaky).manifests() == []
    assert _equal(weights, uninterrupted)
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_older_remote_checkpoints_are_deleted_only_after_a_newer_manifest_landed(
        tmp_path, flaky):
    config = _config(tmp_path, checkpoint__remote=flaky, checkpoint__keep_last=1,
                     checkpoint__remote_retries=0)
    _fit(config, callbacks=[StopAt(7)])
    remote = open_remote(flaky)
    assert remote.manifests()[-1] == 7
    kept = remote.manifests()
    Flaky.refuse_manifests = True  # newer files land, their manifests never do
    _fit(config, resume=True)
    assert remote.manifests() == kept  # keep_last=1, yet nothing complete was deleted
    assert all(f"step-{s:08d}.pt" in remote.names() for s in kept)


def test_the_run_ends_while_uploads_are_pending_and_says_so(tmp_path, flaky, capsys):
    Flaky.gate = threading.Event()  # every upload hangs until the test lets it go
    try:
        _fit(_config(tmp_path, checkpoint__remote=flaky, checkpoint__remote_wait_s=0.2))
        out = capsys.readouterr().out
        assert "upload(s) unfinished after 0.2 s" in out
        assert (tmp_path / "run" / "results.json").exists()  # fit() returned
    finally:
        Flaky.gate.set()


def test_pending_uploads_finish_within_the_wait_at_the_end(tmp_path, flaky, capsys):
    Flaky.gate = threading.Event()
    threading.Timer(0.5, Flaky.gate.set).start()  # the store is slow, not gone
    _fit(_config(tmp_path, checkpoint__remote=flaky))
    out = capsys.readouterr().out
    assert f"the newest step {STEPS}" in out and "unfinished" not in out
    assert open_remote(flaky).manifests()[-1] == STEPS


def test_a_staging_folder_that_cannot_be_deleted_never_stops_the_uploads(tmp_path, monkeypatch):
    # e.g. a busy file on NFS: the upload thread leaves the folder and takes the next job.
    def busy(path, ignore_errors=False, **kwargs):
        if not ignore_errors:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))

    monkeypatch.setattr(remote_module.shutil, "rmtree", busy)
    url = f"file://{tmp_path}/remote"
    mirror = Mirror(open_remote(url), tmp_path / "ckpt" / ".remote-staging", keep_last=5,
                    wait_s=3.0)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    for step in (1, 2):
        path = tmp_path / "ckpt" / f"step-{step:08d}.pt"
        save_atomic({"progress": {"step": step}}, path)
        mirror.push(step, {path.name: path}, "file", best=False)
        deadline = time.monotonic() + 3.0
        while step not in mirror.uploaded and time.monotonic() < deadline:
            time.sleep(0.01)  # one at a time: a queued older step would be superseded
    assert mirror.close() == f"remote: 2 checkpoint(s) uploaded to {url}, the newest step 2"


def test_without_hard_links_a_checkpoint_is_copied_to_staging_and_lands_with_its_bytes(
        tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")  # e.g. a FUSE mount

    monkeypatch.setattr(remote_module.os, "link", no_links)
    url = f"file://{tmp_path}/remote"
    mirror = Mirror(open_remote(url), tmp_path / "ckpt" / ".remote-staging", keep_last=5,
                    wait_s=3.0)
    path = tmp_path / "ckpt" / "step-00000004.pt"
    path.parent.mkdir()
    save_atomic({"progress": {"step": 4}}, path)
    mirror.push(4, {path.name: path}, "file", best=False)
    assert mirror.close() == f"remote: 1 checkpoint(s) uploaded to {url}, the newest step 4"
    assert open_remote(url).read(path.name) == path.read_bytes()


def test_rank_0s_manifest_of_a_two_rank_checkpoint_names_the_files_rank_1_uploaded(tmp_path):
    # each rank's Mirror uploads its own shard; rank 0 waits for rank 1's marker and lists its
    # files in the one manifest a new node resumes from (two Mirrors, one process: no gloo)
    url = f"file://{tmp_path}/remote"
    dcp_dir = tmp_path / "ckpt" / "step-00000005.dcp"
    dcp_dir.mkdir(parents=True)
    for r in (0, 1):
        (dcp_dir / f"__{r}_0.distcp").write_bytes(bytes([r]) * 8)
    rank1 = Mirror(open_remote(url), tmp_path / "ckpt" / ".staging1", keep_last=2, rank=1,
                   world_size=2, wait_s=3.0)
    rank1.push(5, {"step-00000005.dcp/__1_0.distcp": dcp_dir / "__1_0.distcp"}, "dcp",
               best=False)
    assert rank1.close() is None and rank1.uploaded == [5]
    rank0 = Mirror(open_remote(url), tmp_path / "ckpt" / ".staging0", keep_last=2,
                   world_size=2, wait_s=3.0)
    rank0.push(5, {"step-00000005.dcp/__0_0.distcp": dcp_dir / "__0_0.distcp"}, "dcp",
               best=False)
    assert rank0.close() == f"remote: 1 checkpoint(s) uploaded to {url}, the newest step 5"
    assert set(open_remote(url).manifest(5)["files"]) == {"step-00000005.dcp/__0_0.distcp",
                                                          "step-00000005.dcp/__1_0.distcp"}


# ------------------------------------------------------------------------------- sharded --
def test_a_sharded_checkpoint_mirrors_and_comes_back_verified(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')  # the run's log, as rank 0 has it
    mirror = Mirror(open_remote(url), tmp_path / "ckpt" / ".remote-staging", keep_last=1,
                    logs_from=tmp_path)
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = sharded.ShardedWriter(tmp_path / "ckpt", keep_last=0, mirror=mirror, model=model,
                                    optimizer=opt)
    state = {"format_version": 1, "progress": {"step": 0, "epoch": 0, "offset": 0}}
    for step in (3, 6):
        manager.save({**state, "progress": {**state["progress"], "step": step}}, step,
                     best=step == 3)
    manager.close()
    # the run's last line says what reached the remote, as for a .pt run
    assert f"remote: 2 checkpoint(s) uploaded to {url}, the newest step 6\n" in \
        capsys.readouterr().out
    remote = open_remote(url)
    assert remote.manifests() == [3, 6]  # 6 the newest, 3 the newest best
    manifest = remote.manifest(6)
    assert manifest["kind"] == "dcp"
    assert {"step-00000006.dcp/.metadata", "step-00000006.dcp/manifest.json",
            "step-00000006.dcp/extras-rank0.pt"} <= set(manifest["files"])
    # a sharded run's logs travel with its checkpoint as a .pt run's do
    assert set(manifest["logs"]) == {"logs/step-00000006/metrics.jsonl"}
    got = fetch_newest(remote, tmp_path / "new" / "checkpoints", -1, print)
    assert got is not None and sharded.verify(got) == 6


# ------------------------------------------------------------------------------------- S3 --
@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """A fresh bucket on the loopback server; the environment a user would set."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    # A module that imports these fixtures gets its own server: a cached S3FileSystem from an
    # earlier module in this process would still point at that one's port, now closed.
    type(fs).clear_instance_cache()
    bucket = f"b-{tmp_path.name.lower().replace('_', '-')}"[:60].rstrip("-")
    fs.mkdir(bucket)
    return f"s3://{bucket}/run", fs


def test_s3_damaged_newest_checkpoint_is_skipped_and_the_one_before_resumes(
        tmp_path, s3, capsys, uninterrupted):
    url, fs = s3
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    steps = open_remote(url).manifests()  # which older ones stay depends on upload speed:
    assert steps[-1] == 12 and len(steps) >= 2  # a pending one a newer one supersedes is dropped
    before = steps[-2]
    key = f"{url}/step-00000012.pt"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the stored object
    fs.pipe_file(key, bytes(data))
    shutil.rmtree(tmp_path / "run")
    resumed = _fit(config, resume=True)
    out = capsys.readouterr().out
    assert (f"\nwarning: remote checkpoint {url}/step-00000012 is damaged (step-00000012.pt "
            "checksum mismatch); falling back to an older one\n") in out
    assert f"fetched {url}/step-{before:08d}.pt" in out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [before]
    assert _equal(resumed, uninterrupted)
    assert open_remote(url).manifests()[-1] == STEPS


# run.threads=1: the same math in the subprocesses and in the in-process reference run
CLI_ARGS = ["configs/digits.yaml", "model.name=mlp", "model.kwargs={hidden: [256, 256]}",
            "train.epochs=8", "checkpoint.every_steps=10", "checkpoint.keep_last=2",
            "log.progress=off", "doctor.preflight=false", "run.threads=1"]


def _cli(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ironloop", "train", *CLI_ARGS,
                             f"run.dir={run_dir}", *extra], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@pytest.mark.slow
def test_s3_kill_9_then_resume_on_an_empty_run_dir_equals_an_uninterrupted_run(
        tmp_path, s3, s3_server):
    url, _ = s3
    victim = _cli(tmp_path / "run", f"checkpoint.remote={url}", "--resume", env=s3_server)
    remote = open_remote(url)
    deadline = time.monotonic() + 300
    while not remote.manifests():  # the first checkpoint is remote: kill the node
        assert victim.poll() is None, victim.communicate()
        assert time.monotonic() < deadline, "no checkpoint reached the remote"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    killed_at = remote.manifests()[-1]
    shutil.rmtree(tmp_path / "run")  # a new node: nothing local
    # (its checkpoints at the epoch ends only: the resume this test proves is at its start, and
    # an upload every 10 steps was most of the run's time)
    again = _cli(tmp_path / "run", f"checkpoint.remote={url}", "--resume",
                 "checkpoint.every_steps=0", env=s3_server)
    # the uninterrupted reference, meanwhile: in this process (cli.main), the same arguments
    from ironloop.cli import main

    with contextlib.chdir(REPO):
        assert main(["train", *CLI_ARGS, f"run.dir={tmp_path / 'plain'}"]) == 0
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"fetched {url}/" in out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [killed_at]
    a = load_file(tmp_path / "plain" / "final.safetensors")
    b = load_file(tmp_path / "run" / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("metrics", "epochs", "evals"):  # the history from step 1, each row once
        assert _rows(tmp_path / "run", name) == _rows(tmp_path / "plain", name), name
    assert "notice: restored metrics.jsonl, " in out  # they came back with the checkpoint


@pytest.mark.slow
def test_s3_sigterm_uploads_the_preemption_checkpoint_before_the_exit(tmp_path, s3, s3_server):
    url, _ = s3
    proc = _cli(tmp_path / "run", f"checkpoint.remote={url}", "log.every_steps=1",
                env=s3_server)
    deadline = time.monotonic() + 300
    while logged_step(tmp_path / "run") < 5:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached step 5"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    step = next(e["step"] for e in events if e["event"] == "preempted")
    assert open_remote(url).manifests()[-1] == step  # landed within checkpoint.remote_wait_s
    assert f"the newest step {step}" in out
