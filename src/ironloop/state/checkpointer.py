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

import functools
import os
from collections.abc import Callable
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
        warn = warn or self._warn()
        if not (fetch and self.cfg.remote):
            return _newest(self.directory, warn)
        local, error = None, None
        try:
            local = _newest(self.directory, warn)
        except CheckpointError as e:  # every local one is damaged: the remote may hold one
            error = e
        fetched = rank_zero_first(functools.partial(self._fetch, local, warn), self.world)
        if fetched is not None or self.world.distributed:  # the fetched one is the newest
            return _newest(self.directory, lambda msg: None)
        if error is not None:
            raise error
        return local

    def find(self, resume: bool | str | Path, fetch: bool = True,
             warn: Warn | None = None) -> Found | None:
        """What ``--resume`` names: True, the newest in run.dir (``latest``); a checkpoint file
        or a ``.dcp`` directory, that one; another run.dir or checkpoints folder, the newest
        there (never the remote: it mirrors this run's own checkpoints)."""
        path = Path(resume) if isinstance(resume, (str, Path)) else None
        if path is None:
            return self.latest(fetch, warn)
        if dcp.is_sharded(path):
            return Found(path, dcp.load_extras(path))
        if not path.is_dir():
            return Found(path, load_verified(path))
        folder = RunDir(path).checkpoints
        return _newest(folder if folder.is_dir() else path, warn or self._warn())

    def peek(self, resume: bool | str | Path) -> Found | None:
        """What ``find`` would resume from, read before the run is built (the global batch a
        resume keeps, state/global_batch.py): local checkpoints only, nothing fetched, nothing
        said. None when there is none or it cannot be read: ``find`` says why, later."""
        try:
            return self.find(resume, fetch=False, warn=lambda msg: None)
        except (CheckpointError, OSError):
            return None

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
