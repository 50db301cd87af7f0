"""A run's directory prepared before anything is written there: refused, overwritten, or
resumed from the checkpoint the checkpointer finds (state/checkpointer.py); then claimed (its
lock) and config.yaml written. Opening the logs and the checkpoint writer is wiring:
``engine/build.py``.

Rank 0 writes; every rank reads the checkpoint it resumes from.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
from pathlib import Path

import yaml

from ironloop.config import Config
from ironloop.errors import CheckpointError, UserError, option
from ironloop.parallel.world import World, rank_zero_first
from ironloop.state import dcp, drift, remote
from ironloop.state.checkpointer import Checkpointer, Found, Peeked, holds_any
from ironloop.state.file_writer import has_checkpoints
from ironloop.state.io import write_atomic
from ironloop.state.lock import LOCK_NAME, claim, written_by_ironloop
from ironloop.state.remote import lease as remote_lease
from ironloop.state.run_dir import FINAL, OUTPUTS, RunDir


def unwritable(run_dir: Path, e: OSError) -> UserError:
    """The one-line error for a run.dir that cannot be created or written."""
    return UserError(f"run.dir {run_dir} cannot be created or written ({e.strerror or e}); "
                     f"choose a writable run.dir")


def refuse_foreign(run_dir: Path) -> None:
    """A run that would write into run.dir must not clobber files another program wrote there
    under the names a run uses (config.yaml, metrics.jsonl, ...). ironloop's own runs leave their
    lock file in run.dir (state/lock.py); without it, those names are someone else's."""
    if written_by_ironloop(run_dir):
        return
    theirs = [n for n in OUTPUTS if (run_dir / n).exists()]
    if theirs:
        raise UserError(f"run.dir {run_dir} holds {', '.join(theirs)}, which ironloop did not "
                        f"write (no {LOCK_NAME}) and no checkpoint; a run would overwrite them. "
                        f"Choose another run.dir, or pass {option('overwrite')} to replace them")


def prepare_run_dir(checkpoints: Checkpointer, cfg: Config, resume, overwrite: bool,
                    world: World, record: dict, allow_config_change: bool,
                    peeked: Peeked | None = None) -> Found | None:
    """The checkpoint to resume from, or None for a fresh run (``peeked``: the read of it that
    resolved the run's config, ``Checkpointer.peek``, not read again).

    Every check that can refuse run.dir runs before anything in it is written: the refusals of
    ``check_run_dir``, then a resume whose config drifted from the checkpoint's (see
    ``ironloop.state.drift``) or whose checkpoint would leave another run's newer ones to be
    deleted. Then run.dir is claimed (state/lock.py) and config.yaml written."""
    run_dir, found = checkpoints.run_dir.path, None
    rank_zero_first(functools.partial(_refuse, run_dir, cfg, resume, overwrite), world)
    if resume:
        # the newest in run.dir (or the remote's), or the checkpoint or folder --resume names
        found = checkpoints.find(resume, peeked=peeked)
        if found is not None:
            drift.check(found.state.get("config") or {}, cfg.to_dict(), allow_config_change,
                        say=print if world.is_main else (lambda msg: None),
                        worlds=(found.state.get("world_size", world.size), world.size))
            rank_zero_first(functools.partial(_refuse_other_lineage, checkpoints, found), world)
        elif world.is_main:
            print(f"notice: no checkpoint in {checkpoints.directory}; starting a fresh run")
    rank_zero_first(functools.partial(_take, run_dir, cfg, resume, overwrite, record), world)
    return found


def _refuse(run_dir: Path, cfg: Config, resume, overwrite: bool) -> None:
    """Rank 0: the refusals before anything is written."""
    check_run_dir(run_dir, resume, overwrite)
    if not resume and cfg.checkpoint.remote:
        fresh_remote(cfg, overwrite)  # refused, or with --overwrite emptied (manifests first)


def _take(run_dir: Path, cfg: Config, resume, overwrite: bool, record: dict) -> None:
    """Rank 0: run.dir claimed (its lock), emptied for --overwrite, config.yaml written."""
    claim(run_dir)
    if overwrite and not resume:  # only the files a run writes; anything else stays
        for path in RunDir(run_dir).outputs():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(RunDir(run_dir).config, yaml.safe_dump(record, sort_keys=False))
        lease = remote_lease.held(cfg.checkpoint.remote) if cfg.checkpoint.remote else None
        if lease is not None:  # which run's checkpoints these are, for the next resume
            remote_lease.record(RunDir(run_dir).checkpoints, lease.lease.lineage)
    except OSError as e:
        raise unwritable(run_dir, e) from e


def refuse_resume_args(resume, overwrite: bool) -> None:
    """``--resume``'s argument, refused before anything reads it: empty (``--resume=$UNSET``
    started a fresh run), with ``--overwrite`` (which one was dropped, silently), or naming a
    path that is neither a file nor a folder (a FIFO: the read waited forever)."""
    if isinstance(resume, (str, Path)) and not str(resume).strip():
        raise UserError("--resume= names an empty path (an unset shell variable?); pass "
                        "--resume alone for the newest checkpoint in run.dir, or the path of "
                        "a checkpoint or run.dir")
    if resume and overwrite:
        raise UserError("--resume and --overwrite together: --resume continues the run in "
                        "run.dir, --overwrite deletes it and starts over; pass one of them")
    if isinstance(resume, (str, Path)) and os.path.exists(resume):
        mode = os.stat(resume).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(f"--resume {resume}: not a regular file or a folder (a pipe "
                                  f"or a device); pass a checkpoint file or a run.dir")


def check_run_dir(run_dir: Path, resume, overwrite: bool) -> None:
    """The refusals that read run.dir and write nothing (rank 0, under run.dir's lock): a fresh
    run over a previous one or over someone else's files; ``--resume DIR`` where DIR holds no
    checkpoint; a resume into a run.dir without checkpoints that holds someone else's files, or
    a finished run that cannot be resumed (checkpoint.enabled=false: starting over would
    overwrite it). ``ironloop train`` runs them before its preflight doctor writes doctor.json."""
    if resume:
        refuse_broken_layout(run_dir)
        path = Path(resume) if isinstance(resume, (str, Path)) else None
        if path is not None and path.is_dir() and not dcp.is_sharded(path) \
                and not holds_any(path):
            raise CheckpointError(f"{option('resume', path)}: no checkpoint in this directory; "
                                  f"pass the run.dir or the checkpoint file of the run to "
                                  f"resume, or leave {option('resume')} out to start a fresh "
                                  f"run")
        if holds_any(RunDir(run_dir).checkpoints):
            return
        refuse_foreign(run_dir)
        if path is None and _unresumable(run_dir):
            raise UserError(f"run.dir {run_dir} holds a run that wrote no checkpoint "
                            f"(checkpoint.enabled=false), so {option('resume')} would start it "
                            f"over and overwrite its outputs; pass {option('overwrite')} to "
                            f"start over, or choose "
                            f"another run.dir")
        return
    if not overwrite and (has_checkpoints(RunDir(run_dir).checkpoints) or _logged(run_dir)):
        raise UserError(f"run.dir {run_dir} already holds a run; pass {option('resume')} to "
                        f"continue it, {option('overwrite')} to delete its outputs and start "
                        f"over, or choose "
                        f"another run.dir")
    if not overwrite:
        refuse_foreign(run_dir)


def refuse_broken_layout(run_dir: Path) -> None:
    """A resume whose checkpoints path is not a folder it can read and write: refused before
    anything in run.dir is written. Taken for "no checkpoint", it truncated the run's logs, then
    crashed on the first save."""
    path = RunDir(run_dir).checkpoints
    if not os.path.lexists(path):
        return
    if not path.is_dir():  # a link to a folder (a bigger disk) is a folder
        what = "a dangling link" if path.is_symlink() else "not a folder"
        raise UserError(f"{path} is {what}, so run.dir {run_dir} cannot be resumed, and its "
                        f"logs are kept as they are; move it aside (or put the run's checkpoints "
                        f"folder back), then resume")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise UserError(f"{path} cannot be read and written by this user, so run.dir "
                        f"{run_dir} cannot be resumed; fix its permissions (chmod u+rwx), then "
                        f"resume")


def _logged(run_dir: Path) -> bool:
    """metrics.jsonl holds a step: a run that failed before its first log line (a bad input
    found at step 1) left nothing to lose, and its corrected rerun starts over."""
    try:
        return RunDir(run_dir).log("metrics").stat().st_size > 0
    except FileNotFoundError:
        return False


def _unresumable(run_dir: Path) -> bool:
    """A finished run, or one that ran with checkpoint.enabled=false (config.yaml says so). A
    run killed before its first checkpoint is neither: --resume starts it over, as a requeue
    script expects."""
    rd = RunDir(run_dir)
    if rd.results.exists() or (rd / FINAL).exists():
        return True
    try:
        record = yaml.safe_load(rd.config.read_text()) or {}
        return (record.get("checkpoint") or {}).get("enabled") is False
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return False


def _refuse_other_lineage(checkpoints: Checkpointer, found: Found) -> None:
    """A resume deletes run.dir's checkpoints past its step (a rewind abandons that future)
    only when it resumed from run.dir's own checkpoints: checkpoints of another lineage are
    never deleted; the resume is refused instead."""
    ckpt_dir = checkpoints.directory.resolve()
    if found.path.resolve().parent == ckpt_dir:
        return
    newest = checkpoints.holds_newer(found.step)
    if newest is not None:
        raise CheckpointError(f"{option('resume', found.path)}: run.dir {checkpoints.run_dir.path} "
                              f"holds its own checkpoints up to step {newest}, past this "
                              f"checkpoint's step {found.step}, which the resume would delete; "
                              f"choose another run.dir, or pass one of {ckpt_dir}'s own "
                              f"checkpoints")


def fresh_remote(cfg: Config, overwrite: bool) -> None:
    """A fresh run must not mix its checkpoints with another run's in checkpoint.remote:
    refused, or with --overwrite, those are deleted (manifests first)."""
    store = remote.open_remote(cfg.checkpoint.remote, cfg.checkpoint.remote_options)
    store.require_bucket()
    lease = remote_lease.claim(store, resume=False)  # refused while another run writes there
    held = sorted(set(store.manifests()) | set(store.step_objects()))
    if held and not overwrite:
        lease.release()
        raise UserError(f"checkpoint.remote {store.url} already holds a run's checkpoints "
                        f"(steps {held[0]}..{held[-1]}); pass {option('resume')} to continue "
                        f"it, {option('overwrite')} to delete them and start over, or choose "
                        f"another "
                        f"checkpoint.remote")
    for step in held:
        store.remove_checkpoint(step)
    if held:
        print(f"notice: removed {len(held)} checkpoint(s) from {store.url} "
              f"({option('overwrite')})")
