"""The checkpointer: the one owner of where a run's checkpoints live, how they are written,
found, loaded and rolled back to. A resume, a guard rollback, ``ironloop export`` and the
doctor's resume check all come through here.

    ckpt = Checkpointer(RunDir(cfg.run.dir), cfg.checkpoint, world, model, optimizer)
    found = ckpt.latest()            # the newest valid checkpoint (run.dir's, else the remote's)
    run.load_state_dict(ckpt.load(found), found.source)
    ckpt.open(run.progress.step)     # the writer, the remote mirror; the future past it dropped
    ckpt.save(run.state_dict(), step, best=True)
    ckpt.wait(); ckpt.close()

Two writers sit behind one ``save(state, step, best)``: ``FileWriter`` (file_writer.py: one
``.pt`` per save from rank 0) and, when the model is sharded by FSDP2, ``ShardedWriter``
(dcp.py: a DCP directory from every rank, loadable on any number of ranks). The remote mirror
(``checkpoint.remote``, state/remote/) is behind both: it uploads what they write, and
``latest`` fetches from it what is newer than run.dir's own.

``latest`` prefers neither kind: a run may hold both (an FSDP run resumed on one process goes on
with files), and the newest valid one by its progress step wins. Damaged checkpoints are
skipped with a warning; when every one is damaged, CheckpointError says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ironloop.config import CheckpointConfig
from ironloop.errors import CheckpointError, UserError
from ironloop.parallel.data_parallel import is_fsdp, is_sharded
from ironloop.parallel.world import World, rank_zero_first
from ironloop.state import dcp, remote
from ironloop.state.file_writer import BEST_FILE, FileWriter, has_checkpoints, latest_file
from ironloop.state.io import load_verified
from ironloop.state.remote import lease as remote_lease
from ironloop.state.run_dir import RunDir, step_entries

Warn = Callable[[str], object]


class Found(NamedTuple):
    """A valid checkpoint: where it is, and what it holds (for a sharded one, this rank's
    extras: its model and optimizer are read by ``Checkpointer.load``)."""

    path: Path
    state: dict

    @property
    def step(self) -> int:
        return int((self.state.get("progress") or {}).get("step", 0))

    @property
    def source(self) -> str:
        return str(self.path)


@dataclass
class Peeked:
    """One local read of what ``--resume`` names (``Checkpointer.peek``), kept so that a resume
    reads its checkpoint once: a ``.pt`` of several GB is loaded and its digest checked before
    the run is built, under run.dir's lock, and ``find`` resumes from the same read."""

    resume: bool | str | Path
    found: Found | None  # None: no checkpoint, or none readable (``error`` says why)
    said: tuple[str, ...]  # the damaged ones skipped, for ``find`` to say
    error: Exception | None  # the read's refusal, for ``find`` to raise
    listing: tuple  # the folder it read, before the read (``listing``)
    reader: tuple[int, int]  # (rank, world size) a sharded one's extras were read as
    spent: bool = False  # ``find`` took it (``spend``)

    @property
    def state(self) -> dict | None:
        return self.found.state if self.found is not None else None

    def spend(self) -> Peeked:
        """This read, for ``find``, once, leaving an empty one behind: the caller's reference
        lasts as long as the run trains, and must not keep the checkpoint's whole state (GBs
        of host memory) alive after the restore."""
        taken = dataclasses.replace(self)
        self.found, self.said, self.error, self.spent = None, (), None, True
        return taken

    def replay(self, warn: Warn) -> Found | None:
        """The read's outcome, as ``find`` would have given it: its warnings, then its
        refusal or its checkpoint."""
        for line in self.said:
            warn(line)
        if self.error is not None:
            raise self.error
        return self.found


def listing(path: Path) -> tuple:
    """A file's (inode, size, mtime), or a folder's entries with theirs (a link's target's),
    temp names (starting with '.') left out: a save, a fetch, a re-link or a replacement
    changes it; a read does not. () when it is not there."""
    try:
        own = os.stat(path)
        if not stat.S_ISDIR(own.st_mode):
            return ((own.st_ino, own.st_size, own.st_mtime_ns),)
        with os.scandir(path) as entries:
            return tuple(sorted(_entry(e) for e in entries if not e.name.startswith(".")))
    except OSError:
        return ()


def _entry(entry: os.DirEntry) -> tuple:
    try:
        st = entry.stat()
    except OSError:  # a dangling link
        return (entry.name,)
    return entry.name, st.st_ino, st.st_size, st.st_mtime_ns


def holds_any(path: Path) -> bool:
    """A checkpoint in ``path`` or in its checkpoints/ folder, file or sharded."""
    dirs = (path, RunDir(path).checkpoints)
    return any(has_checkpoints(d) or bool(step_entries(d, "dcp")) for d in dirs)


class Checkpointer:
    """A run's checkpoints, for every rank: under FSDP2 each rank writes its shards, else rank
    0 writes the files (``writes``). Reading needs no model: ``Checkpointer(RunDir(path))``
    finds and exports."""

    def __init__(self, run_dir: RunDir, cfg: CheckpointConfig | None = None,
                 world: World | None = None, model: nn.Module | None = None, optimizer=None):
        self.run_dir, self.cfg = run_dir, cfg or CheckpointConfig()
        self.directory = run_dir.checkpoints
        self.world = world or World()
        self.model, self.optimizer = model, optimizer
        #: FSDP2: no rank holds the whole model, so every rank writes and reads its shards
        self.sharded = model is not None and (
            is_fsdp(model) or any(is_sharded(p) for p in model.parameters()))
        self.writer: FileWriter | dcp.ShardedWriter | None = None  # from ``open``

    @property
    def writes(self) -> bool:
        """Whether this process writes checkpoints (checkpoint.enabled; every rank's shards,
        else rank 0's files)."""
        return self.cfg.enabled and (self.sharded or self.world.is_main)

    @property
    def async_write(self) -> bool:
        return self.cfg.async_write

    # ---------------------------------------------------------------- finding --------------
    def latest(self, fetch: bool = True, warn: Warn | None = None) -> Found | None:
        """The newest valid checkpoint to resume or roll back from, or None. With
        ``checkpoint.remote`` and ``fetch``, a newer complete one there (a new node, an emptied
        disk) is fetched into run.dir first, with the run's logs as they were at its step
        when run.dir has none of its own. Rank 0 fetches; a refusal there (the store
        unreachable with nothing local, every remote checkpoint damaged) stops every rank with
        the same line. ``warn``: where a damaged one is reported (rank 0 prints)."""
        return self.find(True, fetch, warn)

    def find(self, resume: bool | str | Path, fetch: bool = True, warn: Warn | None = None,
             peeked: Peeked | None = None) -> Found | None:
        """What ``--resume`` names: True, the newest in run.dir (``latest``); a checkpoint file
        or a ``.dcp`` directory, that one; another run.dir or checkpoints folder, the newest
        there (never the remote: it mirrors this run's own checkpoints). ``peeked``: what
        ``peek`` read for the same ``resume``, used instead of reading again while the folder
        it read is as it was (its warnings said and its refusal raised here)."""
        warn = warn or self._warn()
        local = self._reuse(peeked, resume) or self.peek(resume)
        if isinstance(resume, (str, Path)) or not (fetch and self.cfg.remote):
            return local.replay(warn)
        for line in local.said:
            warn(line)
        if isinstance(local.error, OSError):  # unreadable here: no fetch can help
            raise local.error
        # a CheckpointError (every local one damaged) waits: the remote may hold a good one
        fetched = rank_zero_first(functools.partial(self._fetch, local.found, warn),
                                  self.world)
        # rank 0 knows whether it fetched; the others see it in the folder's listing
        if fetched is not None or local.listing != self._listing(resume):
            return _newest(self.directory, lambda msg: None)
        if local.error is not None:
            raise local.error
        return local.found

    def peek(self, resume: bool | str | Path) -> Peeked:
        """What ``find`` would resume from, read once, without fetching and without a word:
        ``resolved`` keeps the global batch from its config and world size
        (state/global_batch.py) before the run is built, and ``find`` resumes from it later.
        The warnings and the refusal of the read are kept for ``find`` to say."""
        said: list[str] = []
        listing = self._listing(resume)  # before the read: a write during it shows
        try:
            found, error = self._read(resume, said.append), None
        except (CheckpointError, OSError) as e:
            found, error = None, e
        return Peeked(resume, found, tuple(said), error, listing, dcp.reader())

    def _read(self, resume: bool | str | Path, warn: Warn) -> Found | None:
        path = Path(resume) if isinstance(resume, (str, Path)) else None
        if path is None:
            return _newest(self.directory, warn)
        if dcp.is_sharded(path):
            return Found(path, dcp.load_extras(path))
        if not path.is_dir():
            return Found(path, load_verified(path))
        folder = RunDir(path).checkpoints
        return _newest(folder if folder.is_dir() else path, warn)

    def _reuse(self, peeked: Peeked | None, resume: bool | str | Path) -> Peeked | None:
        """``peeked`` when it read ``resume`` in a folder unchanged since (a rank that read
        before rank 0 held run.dir reads again if a writer came between), with a sharded
        one's extras read again when this process is now another rank of a group."""
        if peeked is None or peeked.spent:
            return None
        taken = peeked.spend()  # stale or not, the caller holds it no longer
        if taken.resume != resume or taken.listing != self._listing(resume):
            return None
        found = taken.found
        if found is not None and dcp.is_sharded(found.path) and taken.reader != dcp.reader():
            taken.found, taken.reader = Found(found.path, dcp.read_extras(found.path)), \
                dcp.reader()
        return taken

    def _listing(self, resume: bool | str | Path) -> tuple:
        """What a find reads, as the file system lists it (``listing``): run.dir's checkpoints
        folder, or what --resume names."""
        path = Path(resume) if isinstance(resume, (str, Path)) else None
        if path is not None and path.is_dir() and not dcp.is_sharded(path):
            folder = RunDir(path).checkpoints
            path = folder if folder.is_dir() else path
        return listing(self.directory if path is None else path)

    def holds_newer(self, step: int) -> int | None:
        """The newest step of run.dir's own checkpoints past ``step``, or None."""
        newer = [s for kind in ("file", "dcp") for s in step_entries(self.directory, kind)
                 if s > step]
        return max(newer) if newer else None

    # ---------------------------------------------------------------- loading --------------
    def load(self, found: Found) -> dict:
        """The whole checkpoint dict of ``found``, for ``Run.load_state_dict``: a sharded one's
        model and optimizer are read into this run's (resharded to however many ranks it has,
        a collective), and come back as their state_dicts."""
        if dcp.is_sharded(found.path):
            if self.model is None:
                raise CheckpointError(f"{found.path} is sharded: load it into a model")
            dcp.load_sharded(found.path, self.model, self.optimizer)
            return {**found.state, "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict() if self.optimizer else None}
        if self.sharded:
            raise CheckpointError(f"{found.path} is a single-file checkpoint (from ddp or one "
                                  f"process); dist.strategy=fsdp resumes only sharded .dcp "
                                  f"checkpoints. Resume it with dist.strategy=ddp")
        return found.state

    def best_weights(self) -> dict | None:
        """The model's weights in best.pt (early stopping's final restore, the test split's
        best weights), or None without one."""
        best = self.directory / BEST_FILE
        return load_verified(best)["model"] if best.exists() else None

    def model_weights(self, which: str) -> dict[str, torch.Tensor]:
        """The whole model's weights in ``best`` or ``last``, a file or a sharded directory
        (consolidated here, in one process): for ``ironloop export``."""
        path = self.named(which)
        return dcp.consolidate_model(path) if path.is_dir() else load_verified(path)["model"]

    def named(self, which: str) -> Path:
        """``best``/``last``: its .pt, else its .dcp; a UserError naming what the run has."""
        for suffix in (".pt", ".dcp"):
            if (self.directory / f"{which}{suffix}").exists():
                return self.directory / f"{which}{suffix}"
        found = sorted(p.name for p in self.directory.iterdir()
                       if p.suffix in (".pt", ".dcp") and not p.name.startswith(".")) \
            if self.directory.is_dir() else []
        other = "last" if which == "best" else "best"
        raise UserError(f"no {self.directory / (which + '.pt')}; " + (
            f"this run has {', '.join(found)}: pass --which {other}" if found else
            "is it an ironloop run.dir with checkpoint.enabled=true?"))

    # ---------------------------------------------------------------- writing --------------
    def open(self, step: int) -> None:
        """Ready to write, from ``step`` on (after any restore): the writer and the remote
        mirror. Checkpoints past ``step`` belong to a future that did not happen (a rewind, or
        damaged ones the fallback skipped): they are dropped, saying so."""
        if not self.writes:
            return
        c, mirror = self.cfg, self._mirror(step)
        if self.sharded:
            self.writer = dcp.ShardedWriter(self.directory, c.keep_last, c.async_write, mirror,
                                            model=self.model, optimizer=self.optimizer)
        else:
            self.writer = FileWriter(self.directory, c.keep_last, c.async_write, mirror=mirror)
        for path in self.discard_after(step):
            print(f"notice: removed {path}: it is past the step this run resumed from")

    def save(self, state: dict, step: int, best: bool = False) -> None:
        """Write ``state`` (``Run.state_dict``) as the checkpoint of ``step``, also as the best
        one if ``best``. Under FSDP2 a collective: every rank calls it at the same step."""
        if self.writer is not None:
            self.writer.save(state, step, best)

    def discard_after(self, step: int) -> list[Path]:
        return self.writer.discard_after(step) if self.writer is not None else []

    def wait(self) -> None:
        """Until the in-flight async write is on disk (under FSDP2, on every rank); its error,
        if it failed."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ---------------------------------------------------------------- the remote -----------
    def _mirror(self, step: int) -> remote.Mirror | None:
        """checkpoint.remote's uploader (rank 0's also mirrors the logs); rank 0 first drops
        remote checkpoints past ``step``."""
        c, world = self.cfg, self.world
        if not c.remote:
            return None
        mirror = remote.Mirror(remote.open_remote(c.remote, c.remote_options),
                               self.directory / remote.STAGING / f"rank{world.rank}",
                               c.keep_last, rank=world.rank, world_size=world.size,
                               retries=c.remote_retries, wait_s=c.remote_wait_s,
                               logs_from=self.run_dir.path if world.is_main else None)
        if world.is_main:
            for url in mirror.discard_after(step):
                print(f"notice: removed {url} from the remote: it is past the step this run "
                      f"resumed from")
        return mirror

    def _fetch(self, local: Found | None, warn: Warn) -> Path | None:
        """Rank 0: the remote checkpoint newer than ``local``, fetched and checked, or None.
        With a good local checkpoint, a store that does not answer is a warning (the run
        resumes from it and uploads retry in the background); without one, the refusal."""
        for path in remote.remove_leftovers(self.run_dir.path):
            print(f"notice: removed {path}: a fetch that was killed left it")
        warn = functools.partial(_once, warn, set())  # the best save's fetch meets it again
        store = remote.open_remote(self.cfg.remote, self.cfg.remote_options)
        above = local.step if local is not None else -1
        logs = functools.partial(_restore_logs, store, self.run_dir.path)
        try:
            store.require_bucket()
            # before the run deletes anything there; refused for another run's checkpoints
            remote_lease.claim(store, resume=True,
                               lineage=remote_lease.recorded(self.directory))
            fetched = remote.fetch_newest(store, self.directory, above, warn, verified=logs,
                                          check=dcp.check_any)
            held = store.manifests() if fetched is None and local is None else []
        except remote.StoreUnavailable as e:
            if local is None:
                raise UserError(f"{e}: run.dir {self.run_dir.path} holds no checkpoint to "
                                f"resume from without it") from None
            warn(f"{e}; resuming from run.dir's own {local.path}")
            return None
        if held:  # nothing local and nothing remote passed: refused as a local resume is
            raise CheckpointError(f"every checkpoint in checkpoint.remote {store.url} is "
                                  f"damaged or too large for run.dir's free space (steps "
                                  f"{held[0]}..{held[-1]}, the warnings above say which) and "
                                  f"run.dir has none; nothing was deleted. Free space in run.dir, "
                                  f"repair or remove them yourself, or choose another "
                                  f"checkpoint.remote")
        if fetched is not None:
            print(f"notice: fetched {store.show(fetched.name)} into {fetched}: it is newer "
                  f"than anything in run.dir")
            if not (self.directory / BEST_FILE).exists():  # the final restore reads best.pt
                self._fetch_best(store, warn)
        return fetched

    def _fetch_best(self, store: remote.Remote, warn: Warn) -> None:
        best = remote.fetch_newest(store, self.directory, -1, warn, best=True,
                                   check=dcp.check_any)
        if best is not None and best.suffix == ".pt":
            tmp = best.with_name(f".{BEST_FILE}.tmp-fetch")
            tmp.unlink(missing_ok=True)
            os.link(best, tmp)
            os.replace(tmp, self.directory / BEST_FILE)

    def _warn(self) -> Warn:
        return (lambda msg: print(f"warning: {msg}")) if self.world.is_main else \
            (lambda msg: None)


def _newest(directory: Path, warn: Warn) -> Found | None:
    """The newest valid checkpoint in ``directory``, file or sharded, by its progress step."""
    found: list[tuple[Path, dict]] = []
    errors: list[CheckpointError] = []
    for pick in (latest_file, dcp.latest_sharded):
        try:
            hit = pick(directory, warn)
        except CheckpointError as e:
            errors.append(e)
            continue
        if hit is not None:
            found.append(hit)
    if not found:
        if errors:
            raise errors[0]
        return None
    return Found(*max(found, key=lambda hit: hit[1]["progress"]["step"]))


def _once(warn: Warn, said: set[str], line: str) -> None:
    if line not in said:
        said.add(line)
        warn(line)


def _restore_logs(store: remote.Remote, run_dir: Path, manifest: dict[str, Any]) -> None:
    """Before the fetched checkpoint takes its place, so that a kill in between never leaves
    it without its logs (the next attempt fetches it again and finds them)."""
    line = remote.restore_logs(store, manifest, run_dir)
    if line:
        print(line)
