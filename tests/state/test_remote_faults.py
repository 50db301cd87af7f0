"""checkpoint.remote as untrusted input: a tampered, garbled or damaged store never writes or
deletes outside the fetch folder, never loses the store's objects, and the resume falls back
past damage, newest to oldest, as it does on disk. Outages at the start are one line.

The runs are the tiny ones of test_remote.py (an MLP on blobs, 28 steps); the CLI cases use
configs/digits.yaml with a few steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch

from ironloop.errors import CheckpointError, UserError
from ironloop.outputs.readers import read_jsonl
from ironloop.state import dcp as sharded
from ironloop.state.export import export_run
from ironloop.state.io import file_digest
from ironloop.state.remote import lease as remote_lease
from ironloop.state.remote.fetch import fetch_newest
from ironloop.state.remote.mirror import Mirror
from ironloop.state.remote.store import Remote, StoreUnavailable, open_remote, short_error
from tests.conftest import HANG_S, REPO, tiny_mlp
from tests.state.test_remote import StopAt, _config, _equal, _fit, s3, s3_server, uninterrupted

__all__ = ["s3", "s3_server", "uninterrupted"]  # fixtures shared with test_remote.py


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative name -> digest): what must not change."""
    return {p.relative_to(root).as_posix(): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}



def test_a_stores_error_is_told_in_its_own_first_line_cut_to_160_characters():
    botocore = "An error occurred (SlowDown) when calling the PutObject operation: " + "x" * 200
    try:
        try:
            raise OSError(botocore + "\nRetries exhausted")
        except OSError as e:
            raise StoreUnavailable("the store did not answer") from e
    except StoreUnavailable as e:
        told = short_error(e)
    assert told == botocore[:157] + "..."

def _stopped_at_12(tmp_path: Path) -> tuple[str, dict, int]:
    """A run mirrored to file:// and stopped at step 12; (url, config, the step before 12)."""
    url = f"file://{tmp_path}/remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    steps = open_remote(url).manifests()
    assert steps[-1] == 12 and len(steps) >= 2
    return url, config, steps[-2]


def _new_node(tmp_path: Path) -> tuple[Path, Path]:
    """run.dir wiped, holding only the user's own files; a sentinel tree outside it."""
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("my notes\n")
    (tmp_path / "run" / "doctor.json").write_text('{"mine": true}\n')
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "victim.bin").write_bytes(b"precious")
    (outside / "deep" / "x").write_bytes(b"also precious")
    return tmp_path / "run", outside


def _resumed_step(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]


def _tamper(url: str, step: int, change) -> None:
    remote = open_remote(url)
    rel = f"manifests/step-{step:08d}.json"
    remote.write(rel, json.dumps(change(json.loads(remote.read(rel)))).encode())


# ------------------------------------------------------ a tampered manifest writes nothing --
def _abs(outside: Path):
    return lambda m: {**m, "files": {str(outside / "victim.bin"): m["files"]["step-00000012.pt"]}}


TAMPERED = {
    "an absolute name": _abs,
    "a ../ name": lambda outside: lambda m: {**m, "files": {"../x": m["files"][
        "step-00000012.pt"]}},
    "a ../ name in a dcp": lambda outside: lambda m: {**m, "kind": "dcp", "files": {
        "step-00000012.dcp/../../outside/victim.bin": m["files"]["step-00000012.pt"]}},
    "a log named ../": lambda outside: lambda m: {**m, "logs": {
        "logs/step-00000012/../../../outside/run.json": next(iter(m["logs"].values()))}},
    "files a list": lambda outside: lambda m: {**m, "files": list(m["files"])},
    "an entry a string": lambda outside: lambda m: {**m, "files": {
        "step-00000012.pt": "step-00000012.pt"}},
    "the manifest a list": lambda outside: lambda m: [m],
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_manifest_changes_no_byte_outside_the_fetch_and_the_resume_falls_back(
        tmp_path, capsys, uninterrupted, case):
    url, config, before = _stopped_at_12(tmp_path)
    run_dir, outside = _new_node(tmp_path)
    if case == "an absolute name":  # the object it names is there too, with a matching digest
        planted = tmp_path / "remote" / str(outside / "victim.bin").lstrip("/")
        planted.parent.mkdir(parents=True)
        shutil.copyfile(tmp_path / "remote" / "step-00000012.pt", planted)
    _tamper(url, 12, TAMPERED[case](outside))
    kept, mine = _tree(outside), _tree(run_dir)
    resumed = _fit(config, resume=True)
    out = capsys.readouterr().out
    assert _tree(outside) == kept
    assert {k: v for k, v in _tree(run_dir).items() if k in mine} == mine
    assert not (tmp_path / "x").exists()
    lines = [line for line in out.splitlines() if "step-00000012 is damaged" in line]
    assert len(lines) == 1 and "its manifest" in lines[0], out
    assert _resumed_step(run_dir) == [before]
    assert _equal(resumed, uninterrupted)


# --------------------------------------------------- garbled manifests lose no remote object --
def _store(root: Path) -> dict[str, str]:
    """Every checkpoint object of a file:// store; not lease.json, each run's claim on it."""
    return {p.relative_to(root).as_posix(): file_digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lease.json"}


@pytest.mark.parametrize("garble", [b"{\"step\": ", b"[]", b"\x00" * 64])
def test_every_manifest_garbled_refuses_and_keeps_every_remote_object(tmp_path, garble):
    url, config, _ = _stopped_at_12(tmp_path)
    remote = open_remote(url)
    for step in remote.manifests():
        remote.write(f"manifests/step-{step:08d}.json", garble)
    held = _store(tmp_path / "remote")
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"every checkpoint in checkpoint\.remote .* is "
                                              r"damaged .* nothing was deleted"):
        _fit(config, resume=True)
    assert _store(tmp_path / "remote") == held
    with pytest.raises(UserError, match=r"already holds a run's checkpoints"):
        _fit(config)  # a fresh run is refused too; nothing deleted without --overwrite
    assert _store(tmp_path / "remote") == held


def test_a_garbled_manifest_past_the_local_checkpoint_is_kept_not_discarded(tmp_path, capsys):
    url, config, before = _stopped_at_12(tmp_path)
    remote = open_remote(url)
    remote.write("manifests/step-00000012.json", b"garbled")
    for name in ("step-00000012.pt", "last.pt"):  # this node holds `before` as its newest
        (tmp_path / "run" / "checkpoints" / name).unlink()
    held = _store(tmp_path / "remote")
    _fit(config, resume=True, callbacks=[StopAt(before + 1)])
    assert _resumed_step(tmp_path / "run") == [before]
    after = _store(tmp_path / "remote")
    assert after["manifests/step-00000012.json"] == held["manifests/step-00000012.json"]
    assert after["step-00000012.pt"] == held["step-00000012.pt"]
    assert "deletes no checkpoint it cannot read" in capsys.readouterr().out


# ------------------------------------------------------- fallback past every kind of damage --
def _rewrite_object(url: str, root: Path, name: str, data: bytes) -> None:
    """Replace a stored object and update its manifest to match: damage the digest misses."""
    (root / name).write_bytes(data)
    entry = {"blake2b": file_digest(root / name), "size": len(data)}
    _tamper(url, 12, lambda m: {**m, "files": {name: entry}})


class _Payload:
    def __reduce__(self):
        return (print, ("PAYLOAD RAN",))


def _flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def _rotted(path: Path) -> bytes:
    """The checkpoint with one weight changed and its own digest not: what a flipped bit in
    memory or on the local disk before the upload gives."""
    state = torch.load(path, weights_only=True)
    first = next(iter(state["model"].values()))
    first.view(-1)[0] += 1.0
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


DAMAGE = {
    "a garbled manifest": lambda url, root: (root / "manifests" / "step-00000012.json")
    .write_bytes(b"\x00garbled"),
    "a missing object": lambda url, root: (root / "step-00000012.pt").unlink(),
    "a digest mismatch": lambda url, root: (root / "step-00000012.pt").write_bytes(
        _flip((root / "step-00000012.pt").read_bytes())),
    "bit rot before the upload": lambda url, root: _rewrite_object(
        url, root, "step-00000012.pt", _rotted(root / "step-00000012.pt")),
    "a pickle payload": lambda url, root: _rewrite_object(
        url, root, "step-00000012.pt", pickle.dumps(_Payload())),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_remote_checkpoint_resumes_from_the_older_intact_one(
        tmp_path, capsys, uninterrupted, damage):
    url, config, before = _stopped_at_12(tmp_path)
    DAMAGE[damage](url, tmp_path / "remote")
    shutil.rmtree(tmp_path / "run")
    resumed = _fit(config, resume=True)
    out = capsys.readouterr().out
    assert f"remote checkpoint {url}/step-00000012 is damaged" in out
    assert f"fetched {url}/step-{before:08d}.pt" in out and "PAYLOAD RAN" not in out
    assert _resumed_step(tmp_path / "run") == [before]
    assert _equal(resumed, uninterrupted)  # as a resume from step `before` is


# ------------------------------------------------------------------- leftovers of a fetch --
def test_a_killed_fetchs_temp_folders_are_removed_at_the_next_run(tmp_path, capsys):
    _, config, _ = _stopped_at_12(tmp_path)
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").mkdir()  # the lock file a killed process leaves
    (tmp_path / "run" / ".ironloop.lock").write_text(
        '{"pid": 4242, "host": "gone", "started": "2026-01-01 00:00:00 UTC"}\n')
    left = [tmp_path / "run" / "checkpoints" / ".remote-step-00000012.tmp-4242",
            tmp_path / "run" / ".remote-logs.tmp-4242"]
    for path in left:
        path.mkdir(parents=True)
        (path / "half").write_bytes(b"half a download")
    _fit(config, resume=True, callbacks=[StopAt(13)])
    assert not any(p.exists() for p in left)
    out = capsys.readouterr().out
    assert all(f"notice: removed {p}: a fetch that was killed left it\n" in out for p in left)
    assert not list((tmp_path / "run").rglob(".remote-*.tmp-*"))


# ------------------------------------------------------------------------- the CLI: one line --
CLI = ["configs/digits.yaml", "model.name=mlp", "train.max_steps=6", "checkpoint.every_steps=3",
       "log.progress=off", "doctor.preflight=false"]


def _cli(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """``ironloop *args`` in this process (cli.main, what ``python -m ironloop`` runs before its
    exit): its exit code and stderr. In-process, no interpreter start: the contract under test is
    the code and the one line, which no signal or kill is needed for."""
    from ironloop.cli import main

    monkeypatch.chdir(REPO)  # configs/digits.yaml, as from the repository
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_cli_every_manifest_garbled_is_one_line_exit_2_and_the_store_keeps_everything(
        tmp_path, capsys, monkeypatch):
    url = f"file://{tmp_path}/remote"
    run = ["train", *CLI, f"run.dir={tmp_path / 'run'}", f"checkpoint.remote={url}"]
    code, err = _cli(capsys, monkeypatch, *run)
    assert code == 0, err
    remote = open_remote(url)
    for step in remote.manifests():
        remote.write(f"manifests/step-{step:08d}.json", b'{"files": ["../x"]}')
    held = _store(tmp_path / "remote")
    shutil.rmtree(tmp_path / "run")
    code, err = _cli(capsys, monkeypatch, *run, "--resume")
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "every checkpoint in checkpoint.remote" in err
    assert _store(tmp_path / "remote") == held


# ------------------------------------------------------------------------------- outages --
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outage(kind: str, monkeypatch) -> None:
    """The store as a run meets it after the environment changed: nothing listens at the
    endpoint, or no credentials anywhere."""
    if kind == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries: a second, not five
    else:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    fsspec.get_filesystem_class("s3").clear_instance_cache()


OUTAGES = ["unreachable", "no credentials"]
SETTLE_S = remote_lease.SETTLE_S
pytestmark = pytest.mark.usefixtures("quick_lease")


@pytest.fixture(autouse=True)
def _fresh_s3_clients():
    """s3fs keeps one client per set of options: a test's outage must not outlive it."""
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    yield
    fsspec.get_filesystem_class("s3").clear_instance_cache()


@pytest.mark.parametrize("outage", OUTAGES)
def test_an_outage_with_good_local_checkpoints_resumes_from_them_and_says_so(
        tmp_path, s3, monkeypatch, capsys, uninterrupted, outage):
    url, _ = s3
    config = _config(tmp_path, checkpoint__remote=url, checkpoint__remote_retries=0,
                     checkpoint__remote_wait_s=0.5)
    _fit(config, callbacks=[StopAt(12)])
    _outage(outage, monkeypatch)
    resumed = _fit(config, resume=True)
    out = capsys.readouterr().out
    assert f"warning: checkpoint.remote {url} cannot be used (" in out
    assert f"resuming from run.dir's own {tmp_path / 'run' / 'checkpoints'}" in out
    assert "uploads retry in the background" in out
    assert _resumed_step(tmp_path / "run") == [12]
    assert _equal(resumed, uninterrupted)


@pytest.mark.parametrize("outage", OUTAGES)
def test_an_outage_with_nothing_local_refuses_naming_the_store(tmp_path, s3, monkeypatch,
                                                               outage):
    url, _ = s3
    config = _config(tmp_path, checkpoint__remote=url)
    _outage(outage, monkeypatch)
    with pytest.raises(UserError, match=rf"checkpoint\.remote {url} cannot be used .*check its "
                                        r"endpoint, credentials and network: run\.dir .* holds "
                                        r"no checkpoint"):
        _fit(config, resume=True)
    with pytest.raises(UserError, match=rf"checkpoint\.remote {url} cannot be used"):
        _fit(config)  # a fresh run cannot check that no other run holds the store
    with pytest.raises(UserError, match=rf"checkpoint\.remote {url} cannot be used"):
        export_run(url, tmp_path / "m.safetensors", "last")
    assert not (tmp_path / "run").exists()


def test_a_bucket_that_does_not_exist_is_named_and_never_created(tmp_path, s3):
    url, fs = s3
    typo = url.replace("s3://b-", "s3://typo-b-")
    with pytest.raises(UserError, match=r"the bucket 'typo-b-.*' does not exist .* never "
                                        r"creates one"):
        _fit(_config(tmp_path, checkpoint__remote=typo))
    assert not fs.exists(typo.removeprefix("s3://").split("/")[0])


@pytest.mark.parametrize("outage", OUTAGES)
@pytest.mark.parametrize("command", ["train", "train --resume", "export"])
def test_cli_an_outage_at_the_start_is_one_line_exit_2(tmp_path, s3, capsys, monkeypatch,
                                                       outage, command):
    url, _ = s3
    _outage(outage, monkeypatch)
    args = ["export", url, "--out", str(tmp_path / "m.safetensors")] if command == "export" \
        else ["train", *CLI, f"run.dir={tmp_path / 'run'}", f"checkpoint.remote={url}",
              *command.split()[1:]]
    code, err = _cli(capsys, monkeypatch, *args)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"checkpoint.remote {url} cannot be used" in err


# ------------------------------------------------------------------ one writer per prefix --
def _lease_of(url: str, **fields) -> None:
    """Another node's lease on ``url``, refreshed just now unless ``fields`` say otherwise."""
    lease = {"lineage": "l" * 32, "run": "r" * 32, "host": "node-b", "pid": 77,
             "refreshed": time.time(), "released": False, **fields}
    open_remote(url).write(remote_lease.LEASE, json.dumps(lease).encode())


def test_a_fresh_run_refuses_a_prefix_another_node_holds_a_live_lease_on(tmp_path):
    url = f"file://{tmp_path}/remote"
    _lease_of(url)
    with pytest.raises(UserError, match=r"checkpoint\.remote .* is in use by run rrrrrrrr "
                                        r"\(pid 77 on node-b\), whose lease was refreshed"):
        _fit(_config(tmp_path, checkpoint__remote=url))
    assert open_remote(url).manifests() == [] and not (tmp_path / "run").exists()
    assert remote_lease.read(open_remote(url)).host == "node-b"  # its lease stays


def test_a_resume_waits_out_a_lease_that_is_not_refreshed_then_takes_it_over(
        tmp_path, monkeypatch, capsys):
    url, config, _ = _stopped_at_12(tmp_path)
    lineage = remote_lease.read(open_remote(url)).lineage
    monkeypatch.setattr(remote_lease, "TTL_S", 1.5)  # a killed node's lease, soon to expire
    monkeypatch.setattr(remote_lease, "_POLL_S", 0.1)
    _lease_of(url, lineage=lineage)
    _fit(config, resume=True, callbacks=[StopAt(13)])
    assert "is leased to run rrrrrrrr (pid 77 on node-b); waiting up to" in \
        capsys.readouterr().out
    lease = remote_lease.read(open_remote(url))
    assert (lease.lineage, lease.released) == (lineage, True)  # the same lineage, ended
    assert lease.run != "r" * 32 and _resumed_step(tmp_path / "run") == [12]


def test_a_resume_is_refused_while_a_process_on_this_host_holds_the_lease(tmp_path):
    import os

    url = f"file://{tmp_path}/remote"
    _lease_of(url, host=socket.gethostname(), pid=os.getppid())  # a live process, not us
    with pytest.raises(UserError, match=r"is in use by run rrrrrrrr \(pid \d+ on .*\), which "
                                        r"runs on this host; a second writer would delete"):
        remote_lease.claim(open_remote(url), resume=True, say=pytest.fail)
    assert remote_lease.read(open_remote(url)).run == "r" * 32  # its lease stays


def test_a_resume_is_refused_while_another_node_refreshes_its_lease(tmp_path, monkeypatch):
    url, config, _ = _stopped_at_12(tmp_path)
    monkeypatch.setattr(remote_lease, "_POLL_S", 0.05)
    _lease_of(url)
    real_read = remote_lease.read

    def refreshed_elsewhere(remote):  # node-b refreshes between two looks
        _lease_of(url)
        return real_read(remote)

    monkeypatch.setattr(remote_lease, "read", refreshed_elsewhere)
    held = _store(tmp_path / "remote")
    with pytest.raises(UserError, match=r"in use by run rrrrrrrr .* which refreshed its lease "
                                        r"just now; a second writer would delete"):
        _fit(config, resume=True)
    assert _store(tmp_path / "remote") == held


@pytest.mark.parametrize("outage_at_start", [False, True], ids=["store-up", "outage-at-start"])
def test_a_resume_onto_a_prefix_another_run_took_over_is_refused_and_deletes_nothing(
        tmp_path, monkeypatch, outage_at_start):
    """Run A stopped at step 12; run B then took A's prefix with --overwrite and saved up to
    step 20. Resuming A's run.dir would delete B's steps past 12 (an abandoned future, as it
    seemed): refused for the other lineage, at the start (its claim), or, when the store did
    not answer then, when its mirror claims the prefix before its first delete."""
    url, config, _ = _stopped_at_12(tmp_path)
    _fit(_config(tmp_path, "b", checkpoint__remote=url), overwrite=True, callbacks=[StopAt(20)])
    held = _store(tmp_path / "remote")
    assert max(open_remote(url).manifests()) == 20
    if outage_at_start:  # the resume's first look at the store fails: no claim made there
        calls = []
        real = Remote.require_bucket

        def down_once(self):
            calls.append(1)
            if len(calls) == 1:
                raise StoreUnavailable(f"checkpoint.remote {url} cannot be used (timed out)")
            return real(self)

        monkeypatch.setattr(Remote, "require_bucket", down_once)
    with pytest.raises(UserError, match=r"holds the checkpoints of another run \(lineage "
                                        r"[0-9a-f]{8}, last written by run .*\), not of the run "
                                        r"this run\.dir resumes"):
        _fit(config, resume=True)
    assert _store(tmp_path / "remote") == held  # B's steps 13..20 are all there


def test_a_new_node_adopts_the_prefixs_lineage_and_records_it(tmp_path):
    url, config, _ = _stopped_at_12(tmp_path)
    lineage = remote_lease.read(open_remote(url)).lineage
    assert remote_lease.recorded(tmp_path / "run" / "checkpoints") == lineage
    _new_node(tmp_path)
    _fit(config, resume=True, callbacks=[StopAt(13)])
    assert remote_lease.recorded(tmp_path / "run" / "checkpoints") == lineage
    assert remote_lease.read(open_remote(url)).lineage == lineage


LONG = ["configs/digits.yaml", "model.name=mlp", "train.epochs=50", "checkpoint.every_steps=5",
        "log.progress=off", "doctor.preflight=false"]


def _popen(run_dir: Path, *extra: str) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, "-m", "ironloop", "train", *LONG,
                             f"run.dir={run_dir}", *extra], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_two_fresh_runs_started_together_on_one_prefix_one_is_refused(tmp_path):
    """Both runs train far longer than the test lasts, so the one that goes on is still alive
    (its lease live) when the other decides, however late a loaded machine starts it: the
    other is refused for the live lease, never for a finished run's checkpoints."""
    url = f"file://{tmp_path}/remote"
    runs = [_popen(tmp_path / f"run{i}", f"checkpoint.remote={url}", "train.epochs=100000")
            for i in range(2)]
    deadline = time.monotonic() + HANG_S
    while all(p.poll() is None for p in runs):
        if time.monotonic() > deadline:  # both claimed the prefix (or both hung)
            for p in runs:
                p.kill()
            pytest.fail(f"neither run was refused in {HANG_S:.0f} s:\n"
                        + "\n".join(p.communicate(timeout=60)[1][-3000:] for p in runs))
        with contextlib.suppress(subprocess.TimeoutExpired):
            runs[0].wait(timeout=0.2)
    refused, going = (runs[0], runs[1]) if runs[0].poll() is not None else (runs[1], runs[0])
    alive_then = going.poll() is None
    going.kill()
    going.wait(timeout=60)
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and alive_then, err
    assert err.count("\n") == 1 and ("is in use by run" in err or "at the same moment" in err), err


@pytest.mark.slow
def test_a_live_run_on_this_host_keeps_its_prefix_until_it_is_killed(tmp_path):
    url = f"file://{tmp_path}/remote"
    live = _popen(tmp_path / "run", f"checkpoint.remote={url}")
    try:
        deadline = time.monotonic() + 300
        while not open_remote(url).manifests():  # it is writing there now
            assert live.poll() is None, live.communicate()
            assert time.monotonic() < deadline, "no checkpoint reached the remote"
            time.sleep(0.05)
        config = _config(tmp_path, "stray", checkpoint__remote=url)
        for resume in (False, True):  # a stray fresh run, a stray resume on another run.dir
            with pytest.raises(UserError, match=rf"in use by run .* \(pid {live.pid} on "):
                _fit(config, resume=resume)
    finally:
        live.kill()
        live.communicate(timeout=60)
    held = open_remote(url).manifests()
    # the requeue trains the rest of the 50 epochs: a checkpoint (and an upload) every 5 steps
    # there was most of this test's time, and the takeover it proves happens at the start
    requeued = _popen(tmp_path / "run", f"checkpoint.remote={url}", "--resume",
                      "checkpoint.every_steps=100000")
    out, err = requeued.communicate(timeout=300)
    assert requeued.returncode == 0, err
    assert held and "is leased to" not in out  # its pid is gone: taken over at once


def test_a_sharded_checkpoint_with_a_pickle_in_its_extras_falls_back_to_the_older_one(
        tmp_path, capsys):
    """A .dcp whose extras-rank0.pt holds a pickle payload, its manifest updated to match:
    refused by its own load check on the fetched copy, and the older one fetched instead."""
    url = f"file://{tmp_path}/remote"
    mirror = Mirror(open_remote(url), tmp_path / "ckpt" / ".remote-staging", keep_last=2)
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = sharded.ShardedWriter(tmp_path / "ckpt", keep_last=2, mirror=mirror, model=model,
                                    optimizer=opt)
    for step in (3, 6):
        manager.save({"format_version": 1, "progress": {"step": step, "epoch": 0,
                                                        "offset": 0}}, step)
    manager.close()
    root = tmp_path / "remote"
    name = "step-00000006.dcp/extras-rank0.pt"
    (root / name).write_bytes(pickle.dumps(_Payload()))
    inner = root / "step-00000006.dcp" / "manifest.json"  # its own digests updated too
    own = json.loads(inner.read_text())
    own["files"]["extras-rank0.pt"] = file_digest(root / name)
    inner.write_text(json.dumps(own))
    files = {**open_remote(url).manifest(6)["files"],
             **{str(p.relative_to(root)): {"blake2b": file_digest(p), "size": p.stat().st_size}
                for p in (root / name, inner)}}
    _tamper(url, 6, lambda m: {**m, "files": files})
    got = fetch_newest(open_remote(url), tmp_path / "new", -1, print, check=sharded.check_any)
    out = capsys.readouterr().out
    assert got is not None and sharded.verify(got) == 3
    assert f"remote checkpoint {url}/step-00000006 is damaged" in out
    assert "PAYLOAD RAN" not in out and not (tmp_path / "new" / "step-00000006.dcp").exists()


def test_two_claims_that_both_found_the_prefix_free_end_with_one_writer(tmp_path, monkeypatch):
    """The race no look-before-write can close: both runs read "no lease", both write theirs;
    each reads its own back after SETTLE_S, and only the write that landed last goes on."""
    monkeypatch.setattr(remote_lease, "SETTLE_S", SETTLE_S)  # the product's, not quick_lease's
    remote = open_remote(f"file://{tmp_path}/remote")
    both_looked = threading.Barrier(2)
    first_look = threading.local()
    real_read = remote_lease.read

    def read(store):  # each thread's first look waits for the other's: both see it free
        found = real_read(store)
        if not getattr(first_look, "done", False):
            first_look.done = True
            both_looked.wait(timeout=60)
        return found

    monkeypatch.setattr(remote_lease, "read", read)
    results: list = []

    def start() -> None:
        try:
            results.append(remote_lease.claim(remote, resume=False))
        except UserError as e:
            results.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    holders = [r for r in results if isinstance(r, remote_lease.Holder)]
    refused = [str(r) for r in results if isinstance(r, UserError)]
    assert len(holders) == 1 and len(refused) == 1, results
    assert "at the same moment as this run; one writer per prefix" in refused[0]
    assert real_read(remote).run == holders[0].lease.run
    holders[0].release()


def test_orphaned_remote_objects_of_this_run_are_removed_by_its_next_upload(tmp_path):
    url, config, _ = _stopped_at_12(tmp_path)
    remote = open_remote(url)
    # what a killed upload of step 3 left (no manifest), and a step whose manifest is garbled
    remote.put(tmp_path / "run" / "checkpoints" / "step-00000012.pt", "step-00000003.pt")
    remote.put(tmp_path / "run" / "metrics.jsonl", "logs/step-00000003/metrics.jsonl")
    remote.put(tmp_path / "run" / "checkpoints" / "step-00000012.pt", "step-00000004.pt")
    remote.write("manifests/step-00000004.json", b"garbled")
    _fit(config, resume=True, callbacks=[StopAt(13)])
    assert 3 not in remote.step_objects() and "step-00000003" not in remote.names("logs")
    assert 4 in remote.step_objects() and 4 in remote.manifests()  # unread: never deleted
    assert remote.manifests()[-1] == 13


def test_a_mirror_that_started_without_a_claim_claims_before_uploading_or_refuses(tmp_path):
    """The upload thread of a run whose start met an outage: the store answers again, and the
    prefix now holds another lineage's checkpoints (its run ended): nothing is uploaded or
    deleted there, the warning says so once, and the run's last line too."""
    url, _, _ = _stopped_at_12(tmp_path)
    _lease_of(url, released=True)  # lineage "l...": another run's, ended
    held = _store(tmp_path / "remote")
    run_dir = tmp_path / "run"
    warnings: list[str] = []
    mirror = Mirror(open_remote(url), run_dir / "checkpoints" / ".remote-staging", keep_last=1,
                    wait_s=30.0, warn=warnings.append, logs_from=run_dir)
    assert mirror.lease is None  # this process never claimed the prefix
    for step in (13, 14):
        mirror.push(step, {"step-00000012.pt": run_dir / "checkpoints" / "step-00000012.pt"},
                    "file", best=False)
    line = mirror.close()
    assert _store(tmp_path / "remote") == held
    assert len([w for w in warnings if "uploads nothing to" in w]) == 1, warnings
    assert line is not None and "none went there: checkpoint.remote" in line
    assert "holds the checkpoints of another run (lineage llllllll" in line
