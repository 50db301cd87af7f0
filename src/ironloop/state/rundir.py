"""A run's directory: prepared (refused, overwritten or resumed) and the best weights read back
after a resume. Opening its logs and checkpoint managers is wiring: ``engine/build.py``.

Rank 0 writes; every rank reads the checkpoint it resumes from.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import yaml

from ironloop.config import Config
from ironloop.errors import CheckpointError, UserError
from ironloop.parallel.world import World, rank_zero_first
from ironloop.state import dcp as sharded, drift, remote as mirror, remote_lease
from ironloop.state.io import load_verified, write_atomic
from ironloop.state.lock import LOCK_NAME, claim, written_by_ironloop
from ironloop.state.manager import has_checkpoints, step_entries

#: Files a run writes; --overwrite removes these and nothing else.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "epochs.jsonl", "events.jsonl", "results.json",
               "final.safetensors", "final_avg.safetensors", "config.yaml", "tb", "report",
               "evals.jsonl", "scalars.jsonl", "run.json", "wandb", "mlflow.db", "guard.jsonl",
               "trace", "trackers.json")


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
    theirs = [n for n in RUN_OUTPUTS if (run_dir / n).exists()]
    if theirs:
        raise UserError(f"run.dir {run_dir} holds {', '.join(theirs)}, which ironloop did not "
                        f"write (no {LOCK_NAME}) and no checkpoint; a run would overwrite them. "
                        f"Choose another run.dir, or pass --overwrite to replace them")


def prepare_run_dir(run_dir: Path, cfg: Config, resume, overwrite: bool, world: World,
                     record: dict, allow_config_change: bool):
    """Returns (checkpoint state, its path) to resume from, or (None, None) for a fresh run.

    Every check that can refuse run.dir runs before anything in it is written: the refusals of
    ``check_run_dir``, then a resume whose config drifted from the checkpoint's (see
    ``ironloop.state.drift``) or whose checkpoint would leave another run's newer ones to be
    deleted. Then run.dir is claimed (state/lock.py) and config.yaml written."""
    state = source = None
    rank_zero_first(functools.partial(_refuse, run_dir, cfg, resume, overwrite), world)
    if resume:
        source, state = _resume_from(run_dir, resume, cfg, world)
        if state is not None:
            drift.check(state.get("config") or {}, cfg.to_dict(), allow_config_change,
                        say=print if world.is_main else (lambda msg: None),
                        worlds=(state.get("world_size", world.size), world.size))
            if source is not None:
                rank_zero_first(functools.partial(_refuse_other_lineage, run_dir,
                                                  Path(source), _step_of(state)), world)
        elif world.is_main:
            print(f"notice: no checkpoint in {run_dir / 'checkpoints'}; starting a fresh run")
    rank_zero_first(functools.partial(_take, run_dir, cfg, resume, overwrite, record), world)
    return state, source


def _refuse(run_dir: Path, cfg: Config, resume, overwrite: bool) -> None:
    """Rank 0: the refusals before anything is written."""
    check_run_dir(run_dir, resume, overwrite)
    if not resume and cfg.checkpoint.remote:
        fresh_remote(cfg, overwrite)  # refused, or with --overwrite emptied (manifests first)


def _take(run_dir: Path, cfg: Config, resume, overwrite: bool, record: dict) -> None:
    """Rank 0: run.dir claimed (its lock), emptied for --overwrite, config.yaml written."""
    claim(run_dir)
    if overwrite and not resume:  # only the files a run writes; anything else stays
        for path in (run_dir / n for n in RUN_OUTPUTS):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", yaml.safe_dump(record, sort_keys=False))
        lease = remote_lease.held(cfg.checkpoint.remote) if cfg.checkpoint.remote else None
        if lease is not None:  # which run's checkpoints these are, for the next resume
            remote_lease.record(run_dir / "checkpoints", lease.lease.lineage)
    except OSError as e:
        raise unwritable(run_dir, e) from e


def check_run_dir(run_dir: Path, resume, overwrite: bool) -> None:
    """The refusals that read run.dir and write nothing (rank 0, under run.dir's lock): a fresh
    run over a previous one or over someone else's files; ``--resume DIR`` where DIR holds no
    checkpoint; a resume into a run.dir without checkpoints that holds someone else's files, or
    a finished run that cannot be resumed (checkpoint.enabled=false: starting over would
    overwrite it). ``ironloop train`` runs them before its preflight doctor writes doctor.json."""
    if resume:
        path = Path(resume) if isinstance(resume, (str, Path)) else None
        if path is not None and path.is_dir() and not sharded.is_sharded(path) \
                and not _any_checkpoint(path):
            raise CheckpointError(f"--resume {path}: no checkpoint in this directory; pass the "
                                  f"run.dir or the checkpoint file of the run to resume, or "
                                  f"leave --resume out to start a fresh run")
        if _any_checkpoint(run_dir / "checkpoints"):
            return
        refuse_foreign(run_dir)
        if path is None and _unresumable(run_dir):
            raise UserError(f"run.dir {run_dir} holds a run that wrote no checkpoint "
                            f"(checkpoint.enabled=false), so --resume would start it over and "
                            f"overwrite its outputs; pass --overwrite to start over, or choose "
                            f"another run.dir")
        return
    if not overwrite and (has_checkpoints(run_dir / "checkpoints") or _logged(run_dir)):
        raise UserError(f"run.dir {run_dir} already holds a run; pass --resume to continue "
                        f"it, --overwrite to delete its outputs and start over, or choose "
                        f"another run.dir")
    if not overwrite:
        refuse_foreign(run_dir)


def _logged(run_dir: Path) -> bool:
    """metrics.jsonl holds a step: a run that failed before its first log line (a bad input
    found at step 1) left nothing to lose, and its corrected rerun starts over."""
    try:
        return (run_dir / "metrics.jsonl").stat().st_size > 0
    except FileNotFoundError:
        return False


def _any_checkpoint(path: Path) -> bool:
    """A checkpoint in ``path`` or in its checkpoints/ folder, file or sharded."""
    dirs = (path, path / "checkpoints")
    return any(has_checkpoints(d) or bool(step_entries(d, sharded.STEP_RE)) for d in dirs)


def _unresumable(run_dir: Path) -> bool:
    """A finished run, or one that ran with checkpoint.enabled=false (config.yaml says so). A
    run killed before its first checkpoint is neither: --resume starts it over, as a requeue
    script expects."""
    if (run_dir / "results.json").exists() or (run_dir / "final.safetensors").exists():
        return True
    try:
        record = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return (record.get("checkpoint") or {}).get("enabled") is False
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return False


def _resume_from(run_dir: Path, resume, cfg: Config,
                 world: World) -> tuple[str | None, dict | None]:
    """(path, state) of the checkpoint to resume from; (None, None) when a bare --resume finds
    none (check_run_dir refused every case where that would lose something)."""
    path = Path(resume) if isinstance(resume, (str, Path)) else None
    if path is not None and sharded.is_sharded(path):
        return str(path), sharded.load_extras(path)
    if path is not None and not path.is_dir():
        return str(path), load_verified(path)
    ckpt_dir = run_dir / "checkpoints"
    if path is not None:  # a directory: a run.dir or its checkpoints/ folder
        ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    warn = (lambda msg: print(f"warning: {msg}")) if world.is_main else (lambda msg: None)
    # the remote mirrors this run's own checkpoints, not those of a --resume DIR
    found = latest(ckpt_dir, cfg, world, warn) if path is None \
        else sharded.latest_any(ckpt_dir, warn)
    if found is None:
        return None, None
    return str(found[0]), found[1]


def _step_of(state: dict) -> int:
    return int((state.get("progress") or {}).get("step", 0))


def _refuse_other_lineage(run_dir: Path, source: Path, step: int) -> None:
    """A resume deletes run.dir's checkpoints past its step (a rewind abandons that future)
    only when it resumed from run.dir's own checkpoints: checkpoints of another lineage are
    never deleted; the resume is refused instead."""
    ckpt_dir = (run_dir / "checkpoints").resolve()
    if source.resolve().parent == ckpt_dir:
        return
    newer = sorted(s for s in (*step_entries(ckpt_dir), *step_entries(ckpt_dir, sharded.STEP_RE))
                   if s > step)
    if newer:
        raise CheckpointError(f"--resume {source}: run.dir {run_dir} holds its own "
                              f"checkpoints up to step {newer[-1]}, past this checkpoint's "
                              f"step {step}, which the resume would delete; choose another "
                              f"run.dir, or pass one of {ckpt_dir}'s own checkpoints")


def latest(ckpt_dir: Path, cfg: Config, world: World, warn) -> tuple[Path, dict] | None:
    """The newest valid checkpoint to resume from: run.dir's, or, when ``checkpoint.remote``
    has a newer complete one (a new node, an emptied disk), that one, fetched into run.dir
    (``ckpt_dir``'s parent) with the run's logs as they were at its step, when run.dir has
    none of its own. The resume then truncates them as it does local logs.

    Rank 0 fetches; a refusal there (the store unreachable with nothing local, every remote
    checkpoint damaged) is handed to every rank, so all of them stop with the same line."""
    if not cfg.checkpoint.remote:
        return sharded.latest_any(ckpt_dir, warn)
    local, error = None, None
    try:
        local = sharded.latest_any(ckpt_dir, warn)
    except CheckpointError as e:  # every local one is damaged: the remote may hold a good one
        error = e
    # rank 0 fetches; every rank reads run.dir, as for a local resume
    fetched = rank_zero_first(functools.partial(_fetch, ckpt_dir, cfg, local, warn), world)
    if fetched is not None or world.distributed:  # read again: the fetched one is the newest
        return sharded.latest_any(ckpt_dir, lambda msg: None)
    if error is not None:
        raise error
    return local


def _fetch(ckpt_dir: Path, cfg: Config, local: tuple[Path, dict] | None,
           warn) -> Path | None:
    """Rank 0: the remote checkpoint newer than ``local``, fetched and checked, or None. With
    a good local checkpoint, a store that does not answer is a warning (the run resumes from
    it and uploads retry in the background); without one, it is the refusal."""
    for path in mirror.remove_leftovers(ckpt_dir.parent):
        print(f"notice: removed {path}: a fetch that was killed left it")
    said: set[str] = set()
    warn = functools.partial(_once, warn, said)  # the best save's fetch meets the same damage
    remote = mirror.open_remote(cfg.checkpoint.remote, cfg.checkpoint.remote_options)
    above = local[1]["progress"]["step"] if local is not None else -1
    logs = functools.partial(_restore_logs, remote, ckpt_dir.parent)
    try:
        remote.require_bucket()
        # before the run deletes anything there; refused for another run's checkpoints
        remote_lease.claim(remote, resume=True, lineage=remote_lease.recorded(ckpt_dir))
        fetched = mirror.fetch_newest(remote, ckpt_dir, above, warn, verified=logs,
                                      check=sharded.check_any)
        held = remote.manifests() if fetched is None and local is None else []
    except mirror.StoreUnavailable as e:
        if local is None:
            raise UserError(f"{e}: run.dir {ckpt_dir.parent} holds no checkpoint to resume "
                            f"from without it") from None
        warn(f"{e}; resuming from run.dir's own {local[0]}")
        return None
    if held:  # nothing local and nothing remote passed: refused as a local resume would be
        raise CheckpointError(f"every checkpoint in checkpoint.remote {remote.url} is damaged "
                              f"(steps {held[0]}..{held[-1]}, see the warnings above) and "
                              f"run.dir has none; nothing was deleted. Repair or remove them "
                              f"yourself, or choose another checkpoint.remote")
    if fetched is not None:
        print(f"notice: fetched {remote.show(fetched.name)} into {fetched}: it is newer than "
              f"anything in run.dir")
        if not (ckpt_dir / "best.pt").exists():  # the final restore reads best.pt
            _fetch_best(remote, ckpt_dir, warn)
    return fetched


def _once(warn, said: set[str], line: str) -> None:
    if line not in said:
        said.add(line)
        warn(line)


def _restore_logs(remote: mirror.Remote, run_dir: Path, manifest: dict) -> None:
    """Before the fetched checkpoint takes its place, so that a kill in between never leaves
    it without its logs (the next attempt fetches it again and finds them)."""
    line = mirror.restore_logs(remote, manifest, run_dir)
    if line:
        print(line)


def _fetch_best(remote: mirror.Remote, ckpt_dir: Path, warn) -> None:
    best = mirror.fetch_newest(remote, ckpt_dir, -1, warn, best=True, check=sharded.check_any)
    if best is not None and best.suffix == ".pt":
        best.with_name(".best.pt.tmp-fetch").unlink(missing_ok=True)
        os.link(best, best.with_name(".best.pt.tmp-fetch"))
        os.replace(best.with_name(".best.pt.tmp-fetch"), ckpt_dir / "best.pt")


def fresh_remote(cfg: Config, overwrite: bool) -> None:
    """A fresh run must not mix its checkpoints with another run's in checkpoint.remote:
    refused, or with --overwrite, those are deleted (manifests first)."""
    remote = mirror.open_remote(cfg.checkpoint.remote, cfg.checkpoint.remote_options)
    remote.require_bucket()
    lease = remote_lease.claim(remote, resume=False)  # refused while another run writes there
    held = sorted(set(remote.manifests()) | set(remote.step_objects()))
    if held and not overwrite:
        lease.release()
        raise UserError(f"checkpoint.remote {remote.url} already holds a run's checkpoints "
                        f"(steps {held[0]}..{held[-1]}); pass --resume to continue it, "
                        f"--overwrite to delete them and start over, or choose another "
                        f"checkpoint.remote")
    for step in held:
        remote.remove_checkpoint(step)
    if held:
        print(f"notice: removed {len(held)} checkpoint(s) from {remote.url} (--overwrite)")


def best_weights(run_dir: Path, cfg: Config, restoring: bool = True) -> dict | None:
    """The best weights from best.pt: after a resume, for early stopping's final restore
    (``restoring``: none without patience); else for the test split, whatever the patience."""
    best = run_dir / "checkpoints" / "best.pt"
    if (restoring and cfg.early_stop.patience == 0) or not best.exists():
        return None
    return load_verified(best)["model"]
