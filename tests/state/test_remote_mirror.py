"""state.remote.mirror, fetch and store in-process, on memory:// (no training run): the store's
names, the mirror's uploads, fetches, retries and retention. The end-to-end runs are in
test_remote*.py."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from ironloop.errors import UserError
from ironloop.state.io import file_digest
from ironloop.state.remote import (
    fetch as fetch_module,
    lease as remote_lease,
    mirror as remote_module,
)
from ironloop.state.remote.fetch import fetch_newest, restore_logs
from ironloop.state.remote.mirror import Mirror
from ironloop.state.remote.store import StoreUnavailable, open_remote


@pytest.fixture
def remote():
    return open_remote(f"memory://units-{uuid.uuid4().hex}/prefix")


def test_a_local_remote_makes_the_folders_its_objects_go_in(tmp_path):
    store = open_remote(str(tmp_path / "remote"))
    store.write("manifests/step-00000001.json", b"{}")
    (tmp_path / "up.pt").write_bytes(b"weights")
    store.put(tmp_path / "up.pt", "logs/step-00000001/metrics.jsonl")
    assert (tmp_path / "remote" / "manifests" / "step-00000001.json").read_bytes() == b"{}"
    assert store.read("logs/step-00000001/metrics.jsonl") == b"weights"
    assert store.url == str(tmp_path / "remote") and store.names() == ["logs", "manifests"]


def test_removing_a_checkpoint_removes_its_manifest_rank_markers_folders_and_logs(remote):
    for rel in ("manifests/step-00000003.json", "manifests/step-00000003.rank1.json",
                "step-00000003.dcp/__0_0.distcp", "step-00000003.dcp/.metadata",
                "logs/step-00000003/metrics.jsonl", "manifests/step-00000004.json",
                "step-00000004.pt", "logs/step-00000004/metrics.jsonl"):
        remote.write(rel, b"x")
    assert remote.step_objects() == {3: ["step-00000003.dcp", "logs/step-00000003"],
                                     4: ["step-00000004.pt", "logs/step-00000004"]}
    assert remote.manifests() == [3, 4]
    remote.remove_checkpoint(3)
    assert remote.manifests() == [4]
    assert remote.names("manifests") == ["step-00000004.json"]
    assert remote.step_objects() == {4: ["step-00000004.pt", "logs/step-00000004"]}
    assert remote.names("step-00000003.dcp") == []


def test_removing_a_checkpoint_whose_objects_are_gone_removes_its_manifest(remote):
    remote.write("manifests/step-00000003.json", b"{}")
    remote.write("manifests/step-00000004.json", b"{}")
    remote.write("step-00000004.pt", b"x")
    remote.remove_checkpoint(3)  # a manifest alone: its objects were deleted before
    assert remote.manifests() == [4] and remote.step_objects() == {4: ["step-00000004.pt"]}


def test_run_dir_records_its_lineage_and_reads_back_only_a_well_formed_one(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    assert remote_lease.recorded(ckpts) is None  # none recorded
    lineage = uuid.uuid4().hex
    remote_lease.record(ckpts, lineage)
    assert (ckpts / remote_lease.RECORD).read_text() == lineage + "\n"
    assert remote_lease.recorded(ckpts) == lineage
    for garbled in ("short", lineage.upper(), lineage[:-1] + "g"):
        (ckpts / remote_lease.RECORD).write_text(garbled)
        assert remote_lease.recorded(ckpts) is None


# ---------------------------------------------------------------------------------- mirror --
def _checkpoint(folder, step: int, data: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    path.write_bytes(data)
    return path


def _landed(mirror, step: int) -> None:
    deadline = time.monotonic() + 10
    while step not in mirror.uploaded + mirror.failed and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.usefixtures("quick_lease")
def test_the_mirror_uploads_each_checkpoint_with_its_manifest_and_keeps_the_newest(
        remote, tmp_path):
    said: list[str] = []
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror = Mirror(remote, tmp_path / "staging", keep_last=2, warn=said.append,
                    logs_from=run_dir)
    for step, best in [(1, True), (2, False), (3, False), (4, False)]:
        path = _checkpoint(tmp_path / "ck", step, f"weights {step}".encode())
        mirror.push(step, {path.name: path}, "file", best, mirror.snapshot_logs(step))
        _landed(mirror, step)
    assert mirror.close() == f"remote: 4 checkpoint(s) uploaded to {remote.url}, the newest step 4"
    assert said == []
    # keep_last=2: steps 3 and 4, and step 1, the newest best save; step 2 is deleted
    assert remote.manifests() == [1, 3, 4]
    assert sorted(remote.step_objects()) == [1, 3, 4]
    manifest = remote.manifest(4)
    path = tmp_path / "ck" / "step-00000004.pt"
    assert {k: manifest[k] for k in ("format", "step", "kind", "best", "world_size")} == \
        {"format": 1, "step": 4, "kind": "file", "best": False, "world_size": 1}
    assert manifest["files"] == {"step-00000004.pt": {"blake2b": file_digest(path),
                                                      "size": len(b"weights 4")}}
    assert list(manifest["logs"]) == ["logs/step-00000004/metrics.jsonl"]
    assert remote_lease.read(remote).released  # the run's end lets the prefix go
    assert not (tmp_path / "staging").exists() or not any((tmp_path / "staging").iterdir())


@pytest.mark.usefixtures("quick_lease")
def test_a_managers_save_hands_the_mirror_the_checkpoint_and_the_logs_up_to_it(
        remote, tmp_path):
    from ironloop.state.file_writer import FileWriter

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror = Mirror(remote, tmp_path / "staging", keep_last=2, warn=pytest.fail,
                    logs_from=run_dir)
    manager = FileWriter(run_dir / "checkpoints", keep_last=1, mirror=mirror)
    manager.save({"progress": {"step": 1}}, 1)
    _landed(mirror, 1)
    mirror.close()
    assert list(remote.manifest(1)["logs"]) == ["logs/step-00000001/metrics.jsonl"]
    assert remote.read("logs/step-00000001/metrics.jsonl") == b'{"step": 1}\n'


@pytest.mark.usefixtures("quick_lease")
def test_a_new_node_fetches_the_newest_checkpoint_and_its_logs(remote, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    mirror = Mirror(remote, tmp_path / "staging", keep_last=3, warn=pytest.fail,
                    logs_from=run_dir)
    for step in (1, 2):
        path = _checkpoint(tmp_path / "ck", step, f"weights {step}".encode())
        mirror.push(step, {path.name: path}, "file", step == 1, mirror.snapshot_logs(step))
        _landed(mirror, step)
    mirror.close()
    new = tmp_path / "new"
    new.mkdir()
    checked, seen = [], []
    got = fetch_newest(remote, new / "checkpoints", -1, pytest.fail, verified=seen.append,
                       check=checked.append)
    assert got == new / "checkpoints" / "step-00000002.pt"
    assert got.read_bytes() == b"weights 2" and [p.name for p in checked] == [got.name]
    assert checked[0].parent.name.startswith(".remote-step-00000002.tmp-")  # checked in place
    assert [m["step"] for m in seen] == [2]
    assert [p.name for p in (new / "checkpoints").iterdir()] == ["step-00000002.pt"]
    assert fetch_newest(remote, new / "checkpoints", 2, pytest.fail) is None  # none newer
    best = fetch_newest(remote, new / "best", -1, pytest.fail, best=True)
    assert best.read_bytes() == b"weights 1"
    where = remote.show("logs/step-00000002")
    assert restore_logs(remote, seen[0], new) == (
        f"notice: restored metrics.jsonl from {where}: the run's logs up to step 2")
    assert (new / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in new.iterdir() if p.name.startswith(".")] == []  # no temp folder
    assert restore_logs(remote, seen[0], new) == (  # run.dir's own logs are never replaced
        f"notice: kept run.dir's own metrics.jsonl; the remote's logs at step 2 ({where}) were "
        f"not downloaded (delete the local ones to take them)")


@pytest.mark.usefixtures("quick_lease")
def test_after_an_outage_at_the_start_the_first_upload_claims_the_prefix_and_cleans_up_once(
        remote, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_module, "_BACKOFF_S", 0.001)
    first = Mirror(remote, tmp_path / "staging", keep_last=3, warn=pytest.fail)
    for step in (1, 2, 3):  # the run, killed after step 3: it resumes from step 1
        path = _checkpoint(tmp_path / "old", step, f"old {step}".encode())
        first.push(step, {path.name: path}, "file", False)
        _landed(first, step)
    first.close()
    read = remote.fs.cat_file
    down = [2]  # the resume's claim at its start, and the first upload's first try

    def cat_file(path, *args, **kwargs):
        if down[0]:
            down[0] -= 1
            raise ConnectionError("connection refused")
        return read(path, *args, **kwargs)

    monkeypatch.setattr(remote.fs, "cat_file", cat_file)
    said: list[str] = []
    mirror = Mirror(remote, tmp_path / "staging", keep_last=3, warn=said.append)
    assert mirror.discard_after(1) == []  # the store is down: deferred to the upload thread
    for step in (2, 3):
        path = _checkpoint(tmp_path / "new", step, f"new {step}".encode())
        mirror.push(step, {path.name: path}, "file", False)
        _landed(mirror, step)
    mirror.close()
    assert mirror.uploaded == [2, 3] and mirror.failed == []
    down_says = (f"checkpoint.remote {remote.url} cannot be used (ConnectionError: connection "
                 f"refused); check its endpoint, credentials and network")
    assert said == [
        f"warning: {down_says}; training goes on from run.dir and uploads retry in the "
        f"background",
        f"warning: uploading the prefix's lease to {remote.url} failed (connection refused); "
        f"retry 1 of 5 in 0.001 s",
        *(f"notice: removed {remote.show(f'step-0000000{s}')} from the remote: it is past the "
          f"step this run resumed from" for s in (2, 3))]  # once: at the first upload only
    assert remote.manifests() == [1, 2, 3]  # the second upload deleted nothing of the first's
    assert [remote.read(f"step-0000000{s}.pt") for s in (1, 2, 3)] == [b"old 1", b"new 2",
                                                                      b"new 3"]


def _push_two(remote, tmp_path) -> None:
    """Steps 1 and 2 on the remote, each landed, the mirror closed."""
    mirror = Mirror(remote, tmp_path / "staging", keep_last=3, warn=pytest.fail)
    for step in (1, 2):
        path = _checkpoint(tmp_path / "ck", step, f"weights {step}".encode())
        mirror.push(step, {path.name: path}, "file", False)
        _landed(mirror, step)
    mirror.close()


@pytest.mark.usefixtures("quick_lease")
def test_a_damaged_remote_checkpoint_is_skipped_for_the_older_one(remote, tmp_path):
    _push_two(remote, tmp_path)
    remote.write("step-00000002.pt", b"weights X")  # same size, other bytes
    said: list[str] = []
    got = fetch_newest(remote, tmp_path / "new", -1, said.append)
    assert got.read_bytes() == b"weights 1"
    assert said == [f"remote checkpoint {remote.show('step-00000002')} is damaged "
                    f"(step-00000002.pt checksum mismatch); falling back to an older one"]
    remote.delete("step-00000001.pt")
    said.clear()
    assert fetch_newest(remote, tmp_path / "newer", 0, said.append) is None
    assert said[-1] == (f"remote checkpoint {remote.show('step-00000001')} is damaged "
                        f"(step-00000001.pt missing); falling back to an older one")


def test_an_upload_that_fails_is_retried_with_a_growing_wait_and_each_try_is_told(
        remote, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_module, "_BACKOFF_S", 0.01)
    said: list[str] = []
    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, retries=3, warn=said.append)
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise OSError("connection reset\nby peer")
        return "landed"

    assert mirror._retry("step-00000001.pt", flaky) == "landed"
    assert said == [
        f"warning: uploading step-00000001.pt to {remote.url} failed (connection reset); "
        f"retry 1 of 3 in 0.01 s",
        f"warning: uploading step-00000001.pt to {remote.url} failed (connection reset); "
        f"retry 2 of 3 in 0.02 s"]
    tries.clear()

    def down():
        tries.append(1)
        raise OSError("connection refused")

    with pytest.raises(OSError):  # one more failure than retries: given up
        mirror._retry("x", down)
    assert len(tries) == 4
    refused = UserError("checkpoint.remote is in use by another run")
    said.clear()
    with pytest.raises(UserError):  # another run's prefix: retrying cannot help
        mirror._retry("x", lambda: (_ for _ in ()).throw(refused))
    assert said == []


def test_rank_0_waits_for_the_other_ranks_files_unless_a_newer_checkpoint_supersedes_it(
        remote, tmp_path, monkeypatch):
    from ironloop.state.remote.mirror import _Job

    monkeypatch.setattr(remote_module, "_POLL_S", 0.01)
    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, world_size=2, warn=pytest.fail)
    dcp = "step-00000005.dcp"
    files = {f"{dcp}/__1_0.distcp": {"blake2b": "ab" * 64, "size": 3}}
    newer = _Job(6, "dcp", False, tmp_path / "s6", world_size=2)
    mirror._pending = [newer]  # a newer checkpoint waits behind this one
    job = _Job(5, "dcp", False, tmp_path / "s5", world_size=2)
    with pytest.raises(TimeoutError, match="^superseded while rank 1 uploads$"):
        mirror._other_ranks(job)
    best = _Job(5, "dcp", True, tmp_path / "s5", world_size=2)  # a best save is never dropped
    marker = threading.Timer(0.2, lambda: remote.write(
        "manifests/step-00000005.rank1.json", json.dumps({"rank": 1, "files": files}).encode()))
    marker.start()
    try:
        assert mirror._other_ranks(best) == files
    finally:
        marker.join()


@pytest.mark.usefixtures("quick_lease")
def test_a_queued_checkpoint_is_dropped_for_a_newer_one_unless_it_is_a_best_save(
        remote, tmp_path, monkeypatch):
    from ironloop.state.remote.mirror import _Job

    class Drained(BaseException):
        pass

    mirror = Mirror(remote, tmp_path / "staging", keep_last=3, warn=pytest.fail)
    uploaded: list[int] = []

    def upload(job):
        uploaded.append(job.step)
        if not mirror._pending:
            raise Drained  # ends the worker loop once the queue is empty

    monkeypatch.setattr(mirror, "_upload", upload)
    staged = {step: tmp_path / f"s{step}" for step in (1, 2, 3, 4, 5)}
    for path in staged.values():
        path.mkdir()
    mirror._pending = [_Job(1, "file", False, staged[1]), _Job(2, "file", True, staged[2]),
                       _Job(3, "file", False, staged[3]), _Job(4, "file", False, staged[4]),
                       _Job(5, "file", False, staged[5])]
    with pytest.raises(Drained):
        mirror._work()
    # 1 is superseded by 2; 2, a best save, is uploaded; 3 and 4 are superseded by 5
    assert uploaded == [2, 5]
    assert not any(path.exists() for path in staged.values())
    mirror.close()


@pytest.mark.usefixtures("quick_lease")
def test_a_fetch_whose_temp_folder_is_already_gone_at_its_clean_up_still_succeeds(
        remote, tmp_path, monkeypatch):
    # The temp folder's removal is a best effort: one removed under the fetch (remove_leftovers
    # of another process) must not turn a checkpoint and logs already in place into an error.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror = Mirror(remote, tmp_path / "staging", keep_last=3, warn=pytest.fail,
                    logs_from=run_dir)
    path = _checkpoint(tmp_path / "ck", 1, b"weights 1")
    mirror.push(1, {path.name: path}, "file", False, mirror.snapshot_logs(1))
    _landed(mirror, 1)
    mirror.close()
    real = fetch_module.fsync_dir

    def fsync_then_lose_the_temp_folders(directory):
        real(directory)
        fetch_module.remove_leftovers(new)

    monkeypatch.setattr(fetch_module, "fsync_dir", fsync_then_lose_the_temp_folders)
    new = tmp_path / "new"
    seen: list[dict] = []
    got = fetch_newest(remote, new / "checkpoints", -1, pytest.fail, verified=seen.append)
    assert got == new / "checkpoints" / "step-00000001.pt" and got.read_bytes() == b"weights 1"
    assert restore_logs(remote, seen[0], new).startswith("notice: restored metrics.jsonl from ")
    assert (new / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.usefixtures("quick_lease")
def test_a_local_os_error_in_a_fetch_is_warned_in_one_short_line_and_falls_back(
        remote, tmp_path):
    _push_two(remote, tmp_path)

    def check(path):  # the checkpoint's own load check meets an I/O error on step 2
        if path.name == "step-00000002.pt":
            raise OSError("disk read failed\n" + "x" * 200)

    said: list[str] = []
    got = fetch_newest(remote, tmp_path / "new", -1, said.append, check=check)
    assert got.read_bytes() == b"weights 1"
    assert said == [f"remote checkpoint {remote.show('step-00000002')} is damaged "
                    f"(disk read failed); falling back to an older one"]
    said.clear()
    assert fetch_newest(remote, tmp_path / "newer", 1, said.append,
                        check=lambda path: _raise(OSError())) is None
    assert said == [f"remote checkpoint {remote.show('step-00000002')} is damaged "
                    f"(OSError); falling back to an older one"]


def _raise(e: BaseException):
    raise e


def test_rank_0s_manifest_takes_the_files_of_every_other_rank(remote, tmp_path):
    from ironloop.state.remote.mirror import _Job

    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, world_size=3, warn=pytest.fail)
    dcp = "step-00000005.dcp"
    files = {r: {f"{dcp}/__{r}_0.distcp": {"blake2b": f"{r}a" * 64, "size": r}} for r in (1, 2)}
    for r in (1, 2):
        remote.write(f"manifests/step-00000005.rank{r}.json",
                     json.dumps({"rank": r, "files": files[r]}).encode())
    job = _Job(5, "dcp", False, tmp_path / "s5", world_size=3)
    assert mirror._other_ranks(job) == {**files[1], **files[2]}
    mirror.close()


@pytest.mark.usefixtures("quick_lease")
def test_an_os_error_restoring_the_logs_is_warned_in_one_short_line_and_restores_nothing(
        remote, tmp_path):
    manifest = {"step": 1, "logs": {"logs/step-00000001/metrics.jsonl": {
        "blake2b": "ab" * 64, "size": 3}}}

    def get(rel, local, size=None):  # the new node's disk fails under the download
        raise OSError("No space left on device\n" + "x" * 200)

    remote.get = get
    run_dir = tmp_path / "new"
    run_dir.mkdir()
    where = remote.show("logs/step-00000001")
    assert restore_logs(remote, manifest, run_dir) == (
        f"warning: the remote logs {where} are damaged (No space left on device); resuming "
        f"without them: run.dir's logs start at step 1")
    assert list(run_dir.iterdir()) == []  # neither a log nor a temp folder


def test_the_upload_thread_is_a_daemon_named_for_ironloop_that_never_holds_the_exit(
        remote, tmp_path):
    gate = threading.Event()
    real = remote.put

    def held(local, rel):  # the upload waits until the thread was looked at
        gate.wait(10)
        real(local, rel)

    remote.put = held
    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, world_size=2, rank=1,
                    warn=pytest.fail)
    before = set(threading.enumerate())
    path = _checkpoint(tmp_path / "ck", 1, b"weights 1")
    mirror.push(1, {path.name: path}, "file", False)
    started = [t for t in threading.enumerate() if t not in before]
    gate.set()
    _landed(mirror, 1)
    mirror.close()
    assert [(t.name, t.daemon) for t in started] == [("ironloop-remote", True)]


@pytest.mark.usefixtures("quick_lease")
def test_a_mirror_that_claims_at_its_first_upload_records_the_prefixs_lineage_in_run_dir(
        remote, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, warn=pytest.fail,
                    logs_from=run_dir)
    assert mirror.lease is None  # the start made no claim (the store was down then)
    path = _checkpoint(tmp_path / "ck", 1, b"weights 1")
    mirror.push(1, {path.name: path}, "file", False)
    _landed(mirror, 1)
    mirror.close()
    assert mirror.uploaded == [1]
    lineage = remote_lease.read(remote).lineage
    assert remote_lease.recorded(run_dir / "checkpoints") == lineage


@pytest.mark.parametrize("rel", ["lease.json", "manifests/step-00000012.json"])
def test_a_file_system_write_cut_halfway_leaves_the_object_whole_and_no_temp_file(
        tmp_path, monkeypatch, rel):
    """A file system's write truncates first: written in place, a write cut off (a kill, an I/O
    error), or a second writer's, left half an object. It is written beside and renamed."""
    store = open_remote(f"file://{tmp_path}/remote")
    store.write(rel, b'{"old": 1}')

    def cut(path, value, **kwargs):  # half the bytes land, then the disk fails
        with open(path, "wb") as f:
            f.write(value[: len(value) // 2])
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.fs, "pipe_file", cut)
    with pytest.raises(StoreUnavailable, match="Input/output error"):
        store.write(rel, b'{"new": 2222222222}')
    monkeypatch.undo()
    assert store.read(rel) == b'{"old": 1}'
    folder = (tmp_path / "remote" / rel).parent
    assert [p.name for p in folder.iterdir()] == [rel.rsplit("/", 1)[-1]]  # no temp file left
    store.write(rel, b'{"new": 3}')
    assert store.read(rel) == b'{"new": 3}' and len(list(folder.iterdir())) == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0s_mirror_takes_the_lease_its_process_claimed_and_refreshes_it(
        remote, tmp_path, rank):
    """The claim is rank 0's (the only rank that deletes there): its mirror takes that lease
    and starts its refresher; another rank's mirror holds none (seed 8's Mirror.__init___31)."""
    holder = remote_lease.claim(remote, resume=False, say=pytest.fail)
    try:
        mirror = Mirror(remote, tmp_path / "staging", keep_last=2, rank=rank, warn=pytest.fail)
        assert mirror.lease is (holder if rank == 0 else None)
        assert holder.started is (rank == 0)
    finally:
        holder.release(wait_s=5)


@pytest.mark.usefixtures("quick_lease")
def test_an_upload_close_stopped_waiting_for_writes_no_manifest_after_it_and_its_thread_ends(
        remote, tmp_path, monkeypatch):
    """close() releases the prefix's lease after remote_wait_s: the upload still in flight must
    not commit a manifest (nor run retention) into a prefix a new node may have claimed."""
    entered, release = threading.Event(), threading.Event()
    put = remote.put

    def stalled_put(local, rel):
        entered.set()
        release.wait(timeout=60)  # a store that answers only after the run's end
        put(local, rel)

    monkeypatch.setattr(remote, "put", stalled_put)
    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, wait_s=0.05, warn=pytest.fail)
    path = _checkpoint(tmp_path / "ck", 1, b"weights 1")
    mirror.push(1, {path.name: path}, "file", False)
    assert entered.wait(timeout=60)
    line = mirror.close()
    assert line is not None and "1 upload(s) unfinished after 0.05 s" in line
    thread = mirror._thread
    assert thread is not None
    release.set()  # the stalled request returns: the upload must stop there
    thread.join(timeout=60)
    assert not thread.is_alive()  # nothing pending: the thread ended
    assert remote.manifests() == [] and mirror.uploaded == []
    # a push after close (a writer closed and used again) starts a thread and lands
    path = _checkpoint(tmp_path / "ck", 2, b"weights 2")
    mirror.wait_s = 60.0
    mirror.push(2, {path.name: path}, "file", False)
    assert mirror.close() == f"remote: 1 checkpoint(s) uploaded to {remote.url}, the newest step 2"
    assert remote.manifests() == [2]
