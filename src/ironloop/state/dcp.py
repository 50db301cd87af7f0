"""The sharded writer behind the checkpointer (checkpointer.py): one
``torch.distributed.checkpoint`` (DCP) directory per save, and reading one back.

Under FSDP2 no rank holds the whole model, so every rank writes its own shards. A checkpoint is
a directory ``step-{N:08d}.dcp`` holding:

* DCP's files (``*.distcp`` and ``.metadata``) for ``{"model", "optimizer"}``, taken with
  ``get_state_dict`` so that they load on any number of ranks (DCP reshards on load);
* ``extras-rank{r}.pt``: everything else ``Run.state_dict`` returns on rank r (sampler,
  progress, meter, tracker, scheduler, any key added there later, and rank r's RNG), written with
  ``save_atomic`` so it carries its own digest;
* ``manifest.json``, written LAST by rank 0: the step, the world size and a blake2b digest of
  every other file. It is the integrity marker: a directory without a matching manifest is
  damaged and ``--resume`` falls back past it, exactly as for a damaged ``.pt`` file.

The atomic-commit rules of ``io.py`` carry over to directories: everything is written into a
hidden temp directory, fsynced, and only then renamed into place; ``last.dcp`` and ``best.dcp``
are directories of hard links to the step directory's files (no bytes copied), swapped in by
rename; old step directories are deleted only once the new one is durable under every name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ironloop.errors import CheckpointError, option
from ironloop.state.dcp_safe import (
    SafePlanner,
    SafeReader,
    UnsafeMetadata,
    read_metadata,
    refused_item,
)

from .file_writer import retention_victims
from .io import (
    LoadFailure,
    file_digest,
    fsync_dir,
    load_checked,
    load_verified,
    save_atomic,
    write_failed,
)
from .remote import Mirror
from .run_dir import BEST, LAST, step_entries, step_name

MANIFEST = "manifest.json"
LAST_DIR, BEST_DIR = f"{LAST}.dcp", f"{BEST}.dcp"
_SHARDED = ("model", "optimizer")  # the keys DCP holds; the rest of the state is per-rank extras


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (complete or not)."""
    path = Path(path)
    return path.is_dir() and (path.suffix == ".dcp" or (path / MANIFEST).exists()
                              or (path / ".metadata").exists())


def has_sharded(directory: Path) -> bool:
    directory = Path(directory)
    return directory.is_dir() and any(p.suffix == ".dcp" for p in directory.iterdir()
                                      if not p.name.startswith("."))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def reader() -> tuple[int, int]:
    """(rank, world size) as this process reads a directory's extras now (``read_extras``):
    (0, 1) before the process group is joined."""
    return _rank(), dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _step_dirs(directory: Path) -> dict[int, Path]:
    return {s: p for s, p in step_entries(directory, "dcp").items() if p.is_dir()}


# ------------------------------------------------------------------------------------ write --
class ShardedWriter:
    """The sharded twin of ``FileWriter``: same names (step-N, last, best), same ``keep_last``,
    same ``save(state, step, best)``; every rank calls ``save`` (it is a collective) and writes
    its own shards of ``model`` and ``optimizer``, given here once.

    With ``async_write=True`` the shards are written by ``dcp.async_save`` in the background
    (over a process group of its own, so its collectives never interleave with training's); the
    directory is committed (manifest, rename, links) when that write is done, at the next save
    or at ``close``.

    With a ``mirror`` (``checkpoint.remote``), each rank hands its own files of a committed
    checkpoint to its mirror, which uploads them in the background; rank 0 writes the manifest.
    """

    def __init__(self, directory: Path, keep_last: int, async_write: bool = False,
                 mirror: Mirror | None = None, model: torch.nn.Module | None = None,
                 optimizer=None):
        self.directory = Path(directory)
        self.model, self.optimizer = model, optimizer
        self.keep_last = keep_last
        self.async_write = async_write
        self.mirror = mirror
        # (the async_save future, its directory, step, best, the log copies); async_save's
        # return is typed as a Future or an AsyncSaveResponse, which only a staging
        # checkpointer returns.
        self._pending: tuple[Any, Path, int, bool, Path | None] | None = None
        self._group = dist.new_group(backend="gloo") if async_write and dist.is_initialized() \
            else None
        if _rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        _barrier()

    def discard_after(self, step: int) -> list[Path]:
        """Rank 0: remove temp directories of killed writers and step directories newer than
        ``step``; returns the step directories removed."""
        if _rank() != 0:
            return []
        for tmp in self.directory.glob(".*.tmp*"):
            if tmp.is_dir():
                _rmtree(tmp)
            else:
                tmp.unlink(missing_ok=True)
        newer = [p for s, p in sorted(_step_dirs(self.directory).items()) if s > step]
        for p in newer:
            _rmtree(p)
        return newer

    def save(self, state: dict, step: int, best: bool = False) -> None:
        """Write ``state`` (``Run.state_dict``) for ``step``; every rank must call this."""
        self.wait()
        # rank 0's logs as they are at this step: an async write commits at the next save
        logs = self.mirror.snapshot_logs(step) if self.mirror is not None else None
        tmp = self.directory / f".{step_name(step, 'dcp')}.tmp"
        if _rank() == 0:
            _rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        extras = {k: v for k, v in state.items() if k not in _SHARDED}
        assert self.model is not None, "a sharded save needs the model it shards"
        msd, osd = get_state_dict(self.model, self.optimizer)
        try:
            save_atomic(extras, tmp / f"extras-rank{_rank()}.pt")
            if self.async_write:
                future = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp),
                                        process_group=self._group)
                self._pending = (future, tmp, step, best, logs)
                return
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))
        except OSError as e:
            raise write_failed(tmp, e) from e
        self._commit(tmp, step, best, logs)

    def wait(self) -> None:
        """Finish an async write: wait for every rank's shards, then commit the directory."""
        if self._pending is None:
            return
        future, tmp, step, best, logs = self._pending
        self._pending = None
        future.result()  # on rank 0 this returns once .metadata is written, after every rank's
        self._commit(tmp, step, best, logs)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            line = self.mirror.close() if self.mirror is not None else None
            if line:  # rank 0's: what is remote
                print(line)

    def _commit(self, tmp: Path, step: int, best: bool, logs: Path | None) -> None:
        _barrier()  # every rank's extras and shards are in tmp
        if _rank() == 0:
            self._publish(tmp, step, best)
        _barrier()  # no rank runs ahead to a resume point that is not on disk yet
        if self.mirror is not None:  # last.dcp: the step directory is gone with keep_last=0
            own = own_files(self.directory / LAST_DIR, _rank())
            self.mirror.push(step, {f"{step_name(step, 'dcp')}/{p.name}": p for p in own}, "dcp",
                             best, logs)

    def _publish(self, tmp: Path, step: int, best: bool) -> None:
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        for p in files:
            _fsync_file(p)
        manifest = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized()
                    else 1, "files": {p.name: file_digest(p) for p in files}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        primary = self.directory / step_name(step, "dcp")
        _swap(tmp, primary)
        for name in [LAST_DIR] + ([BEST_DIR] if best else []):
            _link_tree(primary, self.directory / name)
        fsync_dir(self.directory)
        # Only now, with the new checkpoint durable under every name, may old ones go.
        steps = _step_dirs(self.directory)
        for victim in retention_victims(list(steps), self.keep_last):
            if victim != step or self.keep_last == 0:  # keep 0: last.dcp holds its links
                _rmtree(steps[victim])


def own_files(path: Path, rank: int) -> list[Path]:
    """The files of a sharded checkpoint that ``rank`` wrote: its extras and its DCP shards
    (``__{rank}_*.distcp``); rank 0 also owns ``.metadata``, the manifest and anything else."""
    def owner(name: str) -> int:
        m = re.match(r"^(?:extras-rank(\d+)\.pt|__(\d+)_.*\.distcp)$", name)
        return int(m.group(1) or m.group(2)) if m else 0

    return sorted(p for p in path.iterdir() if p.is_file() and owner(p.name) == rank)


def _swap(new: Path, target: Path) -> None:
    """Rename directory ``new`` to ``target``, replacing any old ``target`` (rename cannot
    replace a non-empty directory, so the old one is moved aside first, then deleted)."""
    old = target.with_name(f".{target.name}.old.tmp")
    _rmtree(old)
    try:
        if target.exists():
            os.rename(target, old)
        os.rename(new, target)
    except OSError as e:
        raise write_failed(target, e) from e
    _rmtree(old)


def _link_tree(primary: Path, target: Path) -> None:
    """``target`` becomes a directory of hard links to ``primary``'s files (copies where the
    filesystem has no hard links), swapped in by rename."""
    tmp = target.with_name(f".{target.name}.tmp")
    _rmtree(tmp)
    tmp.mkdir()
    for p in primary.iterdir():
        try:
            os.link(p, tmp / p.name)
        except OSError:
            shutil.copy2(p, tmp / p.name)
            _fsync_file(tmp / p.name)
    fsync_dir(tmp)
    _swap(tmp, target)


# ------------------------------------------------------------------------------------- read --
def verify(path: Path) -> int:
    """The step of a complete, undamaged sharded checkpoint; LoadFailure otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise LoadFailure(path, "no manifest: the save never finished",
                          f"{path} is incomplete (no {MANIFEST}); resume from another checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], manifest["step"]
    except (ValueError, KeyError, TypeError):
        raise LoadFailure(path, "unreadable manifest", f"{path}/{MANIFEST} is damaged") from None
    for name, digest in files.items():
        p = path / name
        if not p.is_file() or file_digest(p) != digest:
            raise LoadFailure(path, f"{name} {'missing' if not p.is_file() else 'changed'}",
                              f"{path} is damaged: {name} does not match its manifest digest; "
                              "resume from another checkpoint")
    check_metadata(path)
    return step


def check_metadata(path: Path) -> None:
    """Refuse (LoadFailure) a ``.metadata`` that names anything but DCP's own metadata classes:
    checked before DCP reads it, since DCP's own reader would unpickle anything."""
    try:
        read_metadata(path)
    except UnsafeMetadata as e:
        raise LoadFailure(path, "unsafe .metadata",
                          f"refused to load {path}: its .metadata names {e}, which DCP never "
                          "writes there (a pickle that would run code); ironloop loads only "
                          "DCP's own metadata classes. Resume from another checkpoint") from None
    except Exception as e:  # noqa: BLE001 - truncated, not a pickle at all, ...
        raise LoadFailure(path, "unreadable .metadata",
                          f"{path}/.metadata is damaged ({type(e).__name__}); resume from "
                          "another checkpoint") from None


def load_extras(path: Path) -> dict:
    """The non-sharded state for this rank. On the world size that wrote it, each rank gets its
    own file back (RNG and the meter's running sums are per rank). On another world size, every
    rank gets rank 0's (the counters and the data position are the same on every rank), with
    its own RNG where that rank existed."""
    path = Path(path)
    try:
        verify(path)
    except LoadFailure as e:
        raise CheckpointError(str(e)) from None
    return read_extras(path)


def read_extras(path: Path) -> dict:
    """``load_extras`` of a directory already verified (its shards' digests are not read
    again): a resume found it before the process group was joined, when every rank read rank
    0's, and reads its own once the group is there (``Checkpointer.find``)."""
    path = Path(path)
    world = reader()[1]
    try:
        written_by = json.loads((path / MANIFEST).read_text()).get("world_size")
        own = path / f"extras-rank{_rank()}.pt"
        if written_by == world and own.exists():
            return load_checked(own, "cpu")
        state = load_checked(path / "extras-rank0.pt", "cpu")
        if _rank() != 0 and own.exists():
            state["rng"] = load_checked(own, "cpu")["rng"]
    except LoadFailure as e:
        raise CheckpointError(str(e)) from None
    return state


def latest_sharded(directory: Path, warn: Callable[[str], object]) -> tuple[Path, dict] | None:
    """As ``file_writer.latest_file``, for sharded directories: ``last.dcp``, then any newer
    step directory, newest first; damaged ones are reported through ``warn`` and skipped."""
    directory = Path(directory)
    last = directory / LAST_DIR
    candidates = [p for _, p in sorted(_step_dirs(directory).items(), reverse=True)]
    if last.is_dir():
        candidates.insert(0, last)
    if not candidates:
        return None
    damaged, best = [], None
    for path in candidates:
        try:
            step = verify(path)
        except LoadFailure as e:
            damaged.append(f"{path} ({e.reason})")
            warn(f"checkpoint {path} is damaged ({e.reason}); falling back to an older one")
            continue
        if best is None or step > best[1]:
            best = (path, step)
        if path != last:
            break  # step directories are tried newest first: the first good one is the newest
    if best is None:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged: {', '.join(damaged)}. Pass "
            f"{option('overwrite')} to start over, or {option('resume', 'PATH')} to pick one "
            f"(e.g. best.dcp) yourself.")
    return best[0], load_extras(best[0])


def load_sharded(path: Path, model: torch.nn.Module, optimizer) -> None:
    """Load the model and optimizer from a DCP directory into this run, resharding to however
    many ranks (and whatever wrapping) this run has; a collective."""
    msd, osd = get_state_dict(model, optimizer)
    sd: dict[str, Any] = {"model": msd, "optimizer": osd}
    try:
        check_metadata(Path(path))  # its digests were verified with the extras
        dcp.load(sd, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    except LoadFailure as e:
        raise CheckpointError(str(e)) from None
    except (Exception, CheckpointException) as e:  # the latter wraps each rank's error
        if refused_item(e):
            raise CheckpointError(f"refused to load {path}: its item {refused_item(e)} is a "
                                  "pickle that would run code; ironloop loads only tensors and "
                                  "plain values. Resume from another checkpoint") from None
        raise CheckpointError(f"{path} does not fit this model or optimizer ({str(e)[:300]}); "
                              "check that model.name, model.kwargs and optim.name match the "
                              "run that wrote it") from e
    set_state_dict(model, optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optimizer"])


def consolidate_model(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from a DCP directory, in one process (for export)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        verify(Path(path))
    except LoadFailure as e:
        raise CheckpointError(str(e)) from None
    meta = read_metadata(Path(path))  # verify() has refused an unsafe one
    model = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    sd = {"model": model}
    try:
        dcp.load(sd, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the latter is a BaseException
        what = f"its item {refused_item(e)} is a pickle that would run code" if refused_item(e) \
            else f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise CheckpointError(f"refused to load {path}: {what}") from None
    return sd["model"]


def check_any(path: Path) -> None:
    """A checkpoint's own load check, file or sharded (a fetched copy's, before it takes its
    place): a ``.pt``'s digest of its contents, read with weights_only; a ``.dcp``'s manifest,
    metadata and every rank's extras. CheckpointError naming what failed."""
    path = Path(path)
    if path.suffix != ".dcp":
        load_verified(path)
        return
    try:
        verify(path)
        for extras in sorted(path.glob("extras-rank*.pt")):
            load_checked(extras, "cpu")
    except LoadFailure as e:
        raise CheckpointError(str(e)) from None
