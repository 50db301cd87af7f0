"""Checkpoints that outlive the node: a mirror of ``run.dir/checkpoints`` in object storage.

``checkpoint.remote`` is an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``file:///...``).
The local run.dir stays the working copy; each checkpoint that lands there is uploaded by a
background thread (``Mirror``), so the loop never waits on the network. The remote holds:

* the checkpoint's files under their local names and with the same bytes: ``step-N.pt``, or
  the files of ``step-N.dcp/`` (a sharded checkpoint, each rank uploading its own);
* ``logs/step-N/<name>``: copies of the run's append-only logs (``LOGS``: metrics.jsonl,
  epochs.jsonl, evals.jsonl, scalars.jsonl, events.jsonl, guard.jsonl, run.json) as they were
  at that save, taken on the training thread (``Mirror.snapshot_logs``), rank 0 only;
* ``manifests/step-N.json``, written LAST: the step, the kind, whether it was a best save, and
  the blake2b digest and size of every file: the checkpoint's under ``files``, the logs' under
  ``logs`` (a key of its own, so ``files`` still names one checkpoint; a manifest without it, as
  older versions wrote, is a checkpoint without logs). An object store has no rename, so the
  manifest is the commit: a checkpoint without one (an upload cut short by a kill) does not
  exist.

Retention follows ``keep_last`` (at least the newest is kept) plus the newest best save; older
checkpoints are deleted with their logs, manifest first, only after the newer manifest landed.
A failed upload is retried with backoff and warned about, never raised: training goes on with
its local copy. ``--resume`` fetches a checkpoint and its logs back: ``fetch.py``.
The store's operations are ``store.py``; one writer per prefix, ``lease.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ironloop.errors import CheckpointError, UserError
from ironloop.state.io import file_digest
from ironloop.state.run_dir import RunDir

from . import lease as remote_lease
from .manifest import LOGS, checked_files
from .store import LOGS_DIR, MANIFESTS, Remote, StoreLink, StoreUnavailable, short_error

FORMAT = 1  # "logs" is an optional key: older manifests (and older readers) still work
STAGING = ".remote-staging"  # hard links to what waits for upload, in run.dir/checkpoints
_BACKOFF_S, _BACKOFF_MAX_S, _POLL_S = 0.5, 30.0, 0.5


@dataclass
class _Job:
    step: int
    kind: str  # "file" or "dcp"
    best: bool
    staged: Path  # a folder of hard links, named as on the remote
    rank: int = 0
    world_size: int = 1
    files: dict[str, dict] = field(default_factory=dict)
    logs: dict[str, dict] = field(default_factory=dict)  # logs/step-N/<name>: digest, size
    abandoned: bool = False  # close stopped waiting for it: its next request is not made


class _Abandoned(Exception):
    """An upload that ``close`` stopped waiting for: its next request is not made."""


class Mirror:
    """Uploads checkpoints in a background thread; ``push`` only hard-links the files.

    A checkpoint may be deleted locally (retention) before its upload starts, so ``push`` keeps
    hard links to it in ``staging``. When uploads fall behind, a pending checkpoint that a newer
    one supersedes is dropped, unless it is a best save. ``close`` gives what is pending a
    bounded time and returns the line that says what is remote.

    With ``logs_from`` (run.dir, on rank 0), ``snapshot_logs`` copies the run's ``LOGS`` at each
    save, and they are uploaded under ``logs/step-N/`` with the checkpoint.
    """

    def __init__(self, remote: Remote, staging: Path, keep_last: int, *, rank: int = 0,
                 world_size: int = 1, retries: int = 5, wait_s: float = 120.0,
                 warn: Callable[[str], object] = print, logs_from: Path | None = None):
        self.remote, self.staging, self.keep = remote, Path(staging), max(keep_last, 1)
        self.logs_from = None if logs_from is None else Path(logs_from)
        self.rank, self.world_size, self.retries, self.wait_s = rank, world_size, retries, wait_s
        self._warn = warn
        self._pending: list[_Job] = []
        self._busy = False
        # close: the upload in flight stops at its next request (_Job.abandoned), so nothing
        # lands in the store (no manifest, no retention) after close released the lease; an
        # idle thread ends, and a later push starts another
        self._closed = False
        self._current: _Job | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.uploaded: list[int] = []  # steps whose manifest (or rank marker) landed
        self.failed: list[int] = []
        self._deferred: int | None = None  # discard_after's step, while the store is down
        # rank 0's claim on the prefix (remote_lease), made at the start of the run; a run
        # whose start met an outage claims it before its first delete or upload (_claim)
        self.lease = remote_lease.held(remote.url) if rank == 0 else None
        self.refused: str | None = None  # another run holds the prefix: nothing goes there
        if self.lease is not None:
            self.lease.start(warn)
        shutil.rmtree(self.staging, ignore_errors=True)  # links left by a killed run

    # -- the training side: never touches the network ------------------------------------
    def snapshot_logs(self, step: int) -> Path | None:
        """Copies of run.dir's logs as they are now, for the checkpoint of ``step``: called on
        the training thread at the save, so they hold its rows (the loop keeps appending to
        the originals, so not hard links). Returns the folder to hand to ``push``, or None
        (no ``logs_from``: ranks > 0)."""
        if self.logs_from is None:
            return None
        staged = self.staging / f"step-{step:08d}-{time.monotonic_ns()}"
        into = staged / LOGS_DIR / f"step-{step:08d}"
        into.mkdir(parents=True)
        for name in LOGS:
            with contextlib.suppress(FileNotFoundError):  # a run without evals, a guard, ...
                shutil.copyfile(self.logs_from / name, into / name)
        return staged

    def push(self, step: int, files: dict[str, Path], kind: str, best: bool,
             staged: Path | None = None) -> None:
        """Queue ``files`` (remote name -> local path) as the checkpoint of ``step``, with the
        log copies ``snapshot_logs`` put in ``staged``."""
        staged = staged or self.staging / f"step-{step:08d}-{time.monotonic_ns()}"
        for name, src in files.items():
            dst = staged / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # no hard links on this filesystem: a copy
                shutil.copyfile(src, dst)
        job = _Job(step, kind, best, staged, self.rank, self.world_size)
        with self._cond:
            self._pending.append(job)
            self._closed = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ironloop-remote",
                                                daemon=True)  # a bounded wait, then abandoned
                self._thread.start()
            self._cond.notify_all()

    def close(self) -> str | None:
        """Wait up to ``wait_s`` for pending uploads; the final line (None on ranks > 0)."""
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            unfinished = [j.step for j in self._pending] + ([-1] if self._busy else [])
            for job in self._pending:  # not started: dropped (the one in flight is abandoned)
                shutil.rmtree(job.staged, ignore_errors=True)
            self._pending.clear()
            if self._current is not None:
                self._current.abandoned = True
            self._closed = True
            self._cond.notify_all()
        if self.lease is not None:  # within the same bounded wait
            self.lease.release(deadline - time.monotonic())
        return self._summary(unfinished) if self.rank == 0 else None

    def _summary(self, unfinished: list[int]) -> str:
        where = self.remote.url
        done = sorted(set(self.uploaded))
        head = (f"remote: {len(done)} checkpoint(s) uploaded to {where}, the newest step "
                f"{done[-1]}" if done else f"remote: no checkpoint uploaded to {where}")
        if self.refused:
            head += f"; none went there: {self.refused}"
        elif self.failed:
            head += f"; failed after {self.retries} retries: steps {sorted(set(self.failed))}"
        if unfinished:
            head += (f"; {len(unfinished)} upload(s) unfinished after {self.wait_s:g} s "
                     f"(checkpoint.remote_wait_s): the local copies in run.dir are complete")
        return head

    # -- the background thread ------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    if self._closed:  # under the lock: a push after this starts a new thread
                        self._thread = None
                        return
                    self._cond.wait()
                # superseded: a newer checkpoint waits behind it and it is not a best save
                while len(self._pending) > 1 and not self._pending[0].best:
                    shutil.rmtree(self._pending.pop(0).staged, ignore_errors=True)
                job = self._current = self._pending.pop(0)
                self._busy = True
            try:
                self._upload(job)
            except _Abandoned:  # close gave up on it
                continue
            except Exception as e:  # noqa: BLE001 - an upload never stops training
                self.failed.append(job.step)
                if _refusal(e):
                    if self.refused is None:
                        self.refused = str(e)
                        self._warn(f"warning: this run uploads nothing to {self.remote.url}: "
                                   f"{e}; its local checkpoints in run.dir are complete")
                    continue
                self._warn(f"warning: remote checkpoint step {job.step} was not uploaded to "
                           f"{self.remote.url} ({short_error(e)}); the local copy is intact and "
                           f"training goes on")
            finally:
                shutil.rmtree(job.staged, ignore_errors=True)
                with self._cond:
                    self._busy, self._current = False, None
                    self._cond.notify_all()

    def _retry(self, what: str, fn: Callable[[], object]) -> Any:
        delay = _BACKOFF_S
        for attempt in range(self.retries + 1):
            if self._current is not None and self._current.abandoned:
                raise _Abandoned(what)
            try:
                return fn()
            except Exception as e:  # any store or network error is retried
                if attempt == self.retries or _refusal(e) or isinstance(e, StoreLink):
                    raise  # a link planted in the store stays there: retrying cannot help
                self._warn(f"warning: uploading {what} to {self.remote.url} failed "
                           f"({short_error(e)}); retry {attempt + 1} of {self.retries} in "
                           f"{delay:g} s")
                time.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
        return None

    def _claim(self) -> None:
        """Rank 0 deletes and uploads only in a prefix it claimed (remote_lease). A run whose
        start met an outage resumed without a claim: it claims here, once the store answers,
        as its start would have (refused for a live run's or another lineage's prefix)."""
        if self.rank != 0 or self.lease is not None:
            return
        if self.refused is not None:
            raise UserError(self.refused)
        ckpt_dir = RunDir(self.logs_from).checkpoints if self.logs_from is not None else None
        lease = remote_lease.claim(self.remote, resume=True, say=self._warn,
                                   lineage=remote_lease.recorded(ckpt_dir) if ckpt_dir else None)
        if ckpt_dir is not None:
            remote_lease.record(ckpt_dir, lease.lease.lineage)
        self.lease = lease
        lease.start(self._warn)

    def _upload(self, job: _Job) -> None:
        self._retry("the prefix's lease", self._claim)
        deferred = self._deferred
        if deferred is not None:  # the store did not answer at the start
            for url in self._retry("the start's clean-up", lambda: self._discard_after(deferred)):
                self._warn(f"notice: removed {url} from the remote: it is past the step this "
                           f"run resumed from")
            self._deferred = None
        for local in sorted(p for p in job.staged.rglob("*") if p.is_file()):
            name = local.relative_to(job.staged).as_posix()
            # the logs apart: "files" must name one checkpoint (older readers check that)
            listed = job.logs if name.startswith(f"{LOGS_DIR}/") else job.files
            listed[name] = {"blake2b": file_digest(local), "size": local.stat().st_size}
            self._retry(name, functools.partial(self.remote.put, local, name))
        marker = f"{MANIFESTS}/step-{job.step:08d}"
        if job.rank > 0:  # rank 0 writes the manifest once every rank's marker is there
            body = json.dumps({"rank": job.rank, "files": job.files}).encode()
            self._retry(f"{marker}.rank{job.rank}.json",
                        lambda: self.remote.write(f"{marker}.rank{job.rank}.json", body))
            self.uploaded.append(job.step)
            return
        files = {**job.files, **self._other_ranks(job)}
        manifest = {"format": FORMAT, "step": job.step, "kind": job.kind, "best": job.best,
                    "world_size": job.world_size, "files": files, "logs": job.logs,
                    "time": time.time()}
        body = json.dumps(manifest, indent=1).encode()
        self._retry(f"{marker}.json", lambda: self.remote.write(f"{marker}.json", body))
        self.uploaded.append(job.step)
        try:
            self._retry("retention", lambda: self._retain(job.step))
        except Exception as e:  # the step is in the store: not "was not uploaded"
            if _refusal(e):
                raise
            self._warn(f"warning: remote checkpoint step {job.step} was uploaded to "
                       f"{self.remote.url}, but removing older ones failed ({short_error(e)}); "
                       f"they stay there until a later save's retention removes them")

    def _other_ranks(self, job: _Job) -> dict[str, dict]:
        """The files ranks 1.. uploaded for this step, from their markers (polled: no
        collective may run in a background thread)."""
        files: dict[str, dict] = {}
        deadline = time.monotonic() + max(self.wait_s, 60.0)
        for r in range(1, job.world_size):
            rel = f"{MANIFESTS}/step-{job.step:08d}.rank{r}.json"
            while True:
                try:
                    files.update(_marker_files(self.remote.read(rel), job.step))
                    break
                except FileNotFoundError:
                    if job.abandoned:
                        raise _Abandoned(rel) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {r} never uploaded its files") from None
                    if self._pending and not job.best:  # rank r may have dropped it too
                        raise TimeoutError(f"superseded while rank {r} uploads") from None
                    time.sleep(_POLL_S)
        return files

    def _retain(self, newest: int) -> None:
        """Delete remote checkpoints past ``keep_last`` (never the newest best save), each
        manifest first; only checkpoints older than the one that just landed, and only those
        whose manifest reads back well-formed: one that does not is kept, never deleted
        unread. Orphaned objects older than it (no manifest) go too. Nothing once another run
        took the prefix over."""
        if not self._owner():
            return
        manifests = self.remote.manifests()
        # objects of steps with no manifest at all, older than the one that just landed: this
        # run's uploads that a kill cut short or that a newer checkpoint superseded mid-way
        for step in sorted(set(self.remote.step_objects()) - set(manifests)):
            if step < newest:
                self.remote.remove_checkpoint(step)
        readable = {s: m for s in manifests if s <= newest
                    for m in [self._readable(s)] if m is not None}
        steps = sorted(readable)
        best = [s for s in reversed(steps) if readable[s].get("best")][:1]
        for step in steps[: max(len(steps) - self.keep, 0)]:
            if step not in best:
                self.remote.remove_checkpoint(step)

    def _readable(self, step: int) -> dict | None:
        try:
            return self.remote.manifest(step)
        except (CheckpointError, FileNotFoundError) as e:  # gone since the listing: kept too
            self._warn(f"warning: kept {self.remote.show(f'step-{step:08d}')}: its manifest is "
                       f"unreadable ({e}); ironloop deletes no checkpoint it cannot read")
            return None

    def discard_after(self, step: int) -> list[str]:
        """At the start of a run: remove remote checkpoints past ``step`` (an abandoned future
        whose manifest reads back well-formed, or uploads a kill cut short: no manifest at
        all). Returns their URLs. A store that does not answer now is warned about and this
        is done by the upload thread before its first upload."""
        try:
            self._claim()
            return self._discard_after(step)
        except StoreUnavailable as e:
            self._deferred = step
            self._warn(f"warning: {e}; training goes on from run.dir and uploads retry in the "
                       f"background")
            return []

    def _owner(self) -> bool:
        """Whether this run may delete in the prefix: only once claimed, and not once another
        run took it over."""
        return self.lease is not None and self.lease.owned

    def _discard_after(self, step: int) -> list[str]:
        if not self._owner():
            return []
        manifests = {s for s in self.remote.manifests() if s > step}
        orphans = {s for s in self.remote.step_objects() if s > step} - manifests
        gone = sorted(orphans | {s for s in manifests if self._readable(s) is not None})
        for s in gone:
            self.remote.remove_checkpoint(s)
        return [self.remote.show(f"step-{s:08d}") for s in gone]


def _refusal(e: Exception) -> bool:
    """A UserError that is not the store failing: the prefix is another run's
    (remote_lease). Retrying cannot change it. A link planted in a file:// store fails only
    the upload that met it."""
    return isinstance(e, UserError) and not isinstance(e, (StoreUnavailable, StoreLink))


def _marker_files(data: bytes, step: int) -> dict:
    """The files a rank's marker (``manifests/step-N.rankR.json``) names, checked as a
    manifest's are."""
    try:
        marker = json.loads(data)
    except ValueError:
        marker = None
    if not isinstance(marker, dict):
        raise CheckpointError(f"the rank marker of step {step} is not a JSON object")
    return checked_files(marker.get("files"), step, "dcp")
