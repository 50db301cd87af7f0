"""The resume side of ``checkpoint.remote``: a checkpoint and its logs fetched back from the
mirror (``mirror.py`` says what the remote holds and how it got there).

``--resume`` (``fetch_newest``) downloads the newest complete remote checkpoint newer than the
local one, its manifest checked first (``manifest.py``: every byte from the store is
untrusted), into a fresh temp folder in run.dir; it checks every digest and the checkpoint's
own load check, and falls back past damaged ones with a one-line reason each.
When run.dir holds no logs of its own (a new node), ``restore_logs`` puts that
checkpoint's logs there first, checked the same way; a damaged log snapshot is skipped with a
warning and the checkpoint resumes without it. The resume then truncates them as any resume
does (``outputs/runlog.py``), so the history continues from step 1 with each row once.
``remove_leftovers`` deletes the temp folders of fetches a kill cut short.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ironloop.errors import CheckpointError, UserError
from ironloop.state.io import file_digest, fsync_dir
from ironloop.state.run_dir import RunDir

from .manifest import LOGS
from .store import LOCAL_DISK_ERRNOS, LOGS_DIR, Remote, short_error

#: what a fetch leaves free on run.dir's disk beyond the manifest's sizes (the filesystem's
#: blocks, the run's next log rows): a checkpoint that does not fit with it is not fetched
FETCH_MARGIN = 1 << 20


def fetch_newest(remote: Remote, directory: Path, above: int,
                 warn: Callable[[str], object], best: bool = False,
                 verified: Callable[[dict], object] | None = None,
                 check: Callable[[Path], object] | None = None) -> Path | None:
    """Download the newest complete remote checkpoint with a step above ``above`` into
    ``directory`` (a best save with ``best``). Newest to oldest, as on disk, each is skipped
    with a one-line reason when its manifest is malformed (``remote_manifest.checked``, before
    anything is fetched), an object is missing or does not match its digest, or the copy fails
    ``check``, the checkpoint's own load check (a CheckpointError). Returns its local path, or
    None when there is none. ``verified`` gets its manifest once it passed and before the
    checkpoint takes its place (a kill in between leaves no checkpoint). One whose manifest's
    sizes (logs included) do not fit in run.dir's free space is skipped the same way, before
    a byte is fetched. A store that cannot be reached raises StoreUnavailable: that is not
    damage to fall back past; nor is run.dir's disk failing a write (full, over quota,
    read-only), a UserError naming run.dir."""
    steps = [s for s in reversed(remote.manifests()) if s > above]
    for step in steps:
        try:
            manifest = remote.manifest(step)
            if best and not manifest.get("best"):
                continue
            short = _shortfall(manifest, directory)
            if short is not None:
                warn(f"remote checkpoint {remote.show(f'step-{step:08d}')} does not "
                     f"fit: {short}; falling back to an older one (free space there to "
                     f"resume from it)")
                continue
            return _download(remote, manifest, directory, verified, check)
        except (CheckpointError, OSError) as e:
            if isinstance(e, OSError) and e.errno in LOCAL_DISK_ERRNOS:  # not the store's
                raise _local_disk(e, directory, remote.show(f"step-{step:08d}")) from None
            reason = str(e) if isinstance(e, CheckpointError) else short_error(e)
            warn(f"remote checkpoint {remote.show(f'step-{step:08d}')} is damaged "
                 f"({reason}); falling back to an older one")
    return None


def _shortfall(manifest: dict, directory: Path) -> str | None:
    """Why ``manifest``'s checkpoint and logs (their declared sizes) do not fit on the disk of
    ``directory`` (run.dir/checkpoints, or its nearest folder that exists), or None."""
    need = sum(int(want["size"]) for part in ("files", "logs")
               for want in (manifest.get(part) or {}).values())
    disk = next(p for p in (directory, *directory.parents) if p.exists())
    free = shutil.disk_usage(disk).free
    if need + FETCH_MARGIN <= free:
        return None
    return (f"step-{manifest['step']} needs {need / 2**20:.1f} MB, run.dir has "
            f"{free / 2**20:.1f} MB free ({directory.parent})")  # one line, said once


def _local_disk(e: OSError, directory: Path, what: str) -> UserError:
    """A local write that failed during a fetch (run.dir's disk full, over quota, read-only):
    run.dir's problem, not the store's, and no older checkpoint would land either."""
    return UserError(f"run.dir {directory.parent} could not take {what} "
                     f"({os.strerror(e.errno or 0)}); its disk failed, not the store: free "
                     f"space in {directory.parent} (or make it writable), then resume again")


def _download(remote: Remote, manifest: dict, directory: Path,
              verified: Callable[[dict], object] | None,
              check: Callable[[Path], object] | None) -> Path:
    step, files = manifest["step"], manifest["files"]
    directory.mkdir(parents=True, exist_ok=True)  # only now: an empty run.dir stays empty
    # a folder of its own, never one a killed fetch left (remove_leftovers deletes those)
    tmp = Path(tempfile.mkdtemp(prefix=f".remote-step-{step:08d}.tmp-{os.getpid()}-",
                                dir=directory))
    try:
        for name, want in files.items():
            local = _inside(tmp, name)
            local.parent.mkdir(parents=True, exist_ok=True)
            _get_checked(remote, name, local, want)
        name = next(iter(files)).split("/", 1)[0]  # checked(): step-N.pt or step-N.dcp only
        if check is not None:
            check(tmp / name)
        if verified is not None:
            verified(manifest)
        target = directory / name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(tmp / name, target)
        fsync_dir(directory)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _inside(folder: Path, rel: str) -> Path:
    """``folder / rel``, refused unless it stays in ``folder``: ``checked`` lets only plain
    names through, and this is the one place a remote name becomes a local path."""
    path = folder / rel
    if not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{rel[:120]!r} would be written outside the fetch folder")
    return path


def _get_checked(remote: Remote, rel: str, local: Path, want: dict) -> None:
    try:
        remote.get(rel, local, want["size"])
    except FileNotFoundError:
        raise CheckpointError(f"{rel} missing") from None
    if local.stat().st_size != want["size"] or file_digest(local) != want["blake2b"]:
        raise CheckpointError(f"{rel} checksum mismatch")


def remove_leftovers(run_dir: Path) -> list[Path]:
    """The temp folders of fetches a kill cut short (``.remote-step-N.tmp-*`` in checkpoints/,
    ``.remote-logs.tmp-*`` in run.dir): called under run.dir's lock, so no live fetch owns
    them. Returns what was removed."""
    found = [*RunDir(run_dir).checkpoints.glob(".remote-step-*.tmp-*"),
             *Path(run_dir).glob(".remote-logs.tmp-*")]
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def restore_logs(remote: Remote, manifest: dict, run_dir: Path) -> str | None:
    """Put the log snapshot of ``manifest``'s checkpoint into ``run_dir`` (a new node's), each
    file checked against its digest, so the resume continues the run's history. Returns the
    one line to print, or None. Never raises: a checkpoint resumes without its logs.

    Nothing local is overwritten: a run.dir with any log of its own keeps them all. A damaged
    snapshot restores nothing (no history with holes); an older manifest has no ``logs``."""
    step = manifest["step"]
    where = remote.show(f"{LOGS_DIR}/step-{step:08d}")
    logs = manifest.get("logs") or {}
    own = [name for name in LOGS if (run_dir / name).exists()]
    if own:
        return None if not logs else (
            f"notice: kept run.dir's own {', '.join(own)}; the remote's logs at step {step} "
            f"({where}) were not downloaded (delete the local ones to take them)")
    if not logs:
        return (f"notice: the remote checkpoint of step {step} holds no logs (an older "
                f"ironloop wrote it): run.dir's logs start at step {step}")
    try:
        names = _download_logs(remote, logs, run_dir)
    except (CheckpointError, OSError) as e:
        reason = str(e) if isinstance(e, CheckpointError) else short_error(e)
        return (f"warning: the remote logs {where} are damaged ({reason}); resuming without "
                f"them: run.dir's logs start at step {step}")
    return f"notice: restored {', '.join(names)} from {where}: the run's logs up to step {step}"


def _download_logs(remote: Remote, logs: dict, run_dir: Path) -> list[str]:
    """Every file of ``logs`` (checked: each ``logs/step-N/<one of LOGS>``) into a fresh temp
    folder, checked, then moved into ``run_dir`` under its base name. The caller found none of
    them there, and run.dir's lock (state/lock.py) keeps any other process out, so nothing is
    overwritten."""
    tmp = Path(tempfile.mkdtemp(prefix=f".remote-logs.tmp-{os.getpid()}-", dir=run_dir))
    try:
        for rel, want in logs.items():
            _get_checked(remote, rel, _inside(tmp, rel.rsplit("/", 1)[-1]), want)
        names = [name for name in LOGS if (tmp / name).exists()]
        for name in names:
            os.replace(tmp / name, run_dir / name)
        fsync_dir(run_dir)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
