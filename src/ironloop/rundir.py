"""A run's directory: prepared (refused, overwritten or resumed), its logs and checkpoint
managers opened, and the best weights read back after a resume.

Rank 0 writes; every rank reads the checkpoint it resumes from.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import yaml

from ironloop import drift, loggers, loop, parallel
from ironloop.callbacks import fire
from ironloop.checkpoint import CheckpointManager, has_checkpoints, load_verified
from ironloop.checkpoint import dcp as sharded
from ironloop.config import Config
from ironloop.distributed import World, barrier
from ironloop.errors import UserError
from ironloop.logs import RunLog, unwritable, write_atomic
from ironloop.report import read_jsonl
from ironloop.resume import collect_state

#: Files a run writes; --overwrite removes these and nothing else.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "epochs.jsonl", "events.jsonl", "results.json",
               "final.safetensors", "config.yaml", "tb", "report", "evals.jsonl",
               "scalars.jsonl", "run.json", "wandb", "mlflow.db", "guard.jsonl", "trace")


def open_outputs(run: loop.Run, run_dir: Path, resume, state, source):
    """Rank 0's logs (truncated to the resumed step), the resume event, and the checkpoint
    manager wired into ``run.save``. Returns the manager, or None without checkpoints."""
    cfg = run.cfg
    # Any --resume, even one that found nothing and starts fresh, drops log lines past the
    # step it continues from, so each step and each epoch is logged exactly once.
    resume_step = run.progress.step if resume else None
    ids = (state.get("loggers") or {}) if state is not None else {}
    run.log = RunLog(run_dir, False, resume_epoch=run.progress.epoch, resume_step=resume_step,
                     loggers=loggers.build(cfg, run_dir, resume_step, ids))
    if ids:  # the same external runs go on: re-send what a killed process may have lost
        loggers.replay(run.log.loggers, read_jsonl(run_dir / "metrics.jsonl"),
                       read_jsonl(run_dir / "epochs.jsonl"), run.log.last_logged_time)
    if state is not None:
        run.log.write("events", {"event": "resume", "step": run.progress.step,
                                 "epoch": run.progress.epoch, "from": source,
                                 "last_logged_step": run.log.last_logged_step,
                                 # work lost to the crash: logged past the checkpoint, redone
                                 "steps_redone": max(0, run.log.last_logged_step
                                                     - run.progress.step),
                                 "time": time.time()})
    if not cfg.checkpoint.enabled or parallel.is_fsdp(run.raw_model):
        return None
    manager = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                cfg.checkpoint.async_write)
    for path in manager.discard_after(run.progress.step):
        print(f"notice: removed {path}: it is past the step this run resumed from")
    def save(best: bool) -> None:
        manager.save(collect_state(run), run.progress.step, best=best)
        fire(run, "on_checkpoint", {"step": run.progress.step, "epoch": run.progress.epoch,
                                    "best": best})

    run.save = save
    return manager


def open_sharded(run: loop.Run, run_dir: Path) -> sharded.ShardedCheckpointManager:
    """Under FSDP2: DCP directories, written by every rank, wired into ``run.save``."""
    cfg = run.cfg
    manager = sharded.ShardedCheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                               cfg.checkpoint.async_write)
    for path in manager.discard_after(run.progress.step):
        print(f"notice: removed {path}: it is past the step this run resumed from")
    run.save = lambda best: manager.save(collect_state(run), run.raw_model, run.optimizer,
                                         run.progress.step, best=best)
    return manager


def prepare_run_dir(run_dir: Path, cfg: Config, resume, overwrite: bool, world: World,
                     record: dict, allow_config_change: bool):
    """Returns (checkpoint state, its path) to resume from, or (None, None) for a fresh run.

    A resume whose config drifted from the checkpoint's is refused here, before anything in
    run.dir is touched (see ``ironloop.drift``)."""
    ckpt_dir = run_dir / "checkpoints"
    state = source = None
    if resume:
        path = Path(resume) if isinstance(resume, (str, Path)) else None
        if path is not None and sharded.is_sharded(path):
            source, state = str(path), sharded.load_extras(path)
        elif path is not None and not path.is_dir():
            source, state = str(path), load_verified(path)
        else:
            if path is not None:  # a directory: a run.dir or its checkpoints/ folder
                ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            warn = (lambda msg: print(f"warning: {msg}")) if world.is_main else (lambda msg: None)
            found = sharded.latest_any(ckpt_dir, warn)
            if found is None:
                if world.is_main:
                    print(f"notice: no checkpoint in {ckpt_dir}; starting a fresh run")
            else:
                source, state = str(found[0]), found[1]
        if state is not None:
            drift.check(state.get("config") or {}, cfg.to_dict(), allow_config_change,
                        say=print if world.is_main else (lambda msg: None),
                        worlds=(state.get("world_size", world.size), world.size))
    elif world.is_main:
        if not overwrite and (has_checkpoints(ckpt_dir) or (run_dir / "metrics.jsonl").exists()):
            raise UserError(f"run.dir {run_dir} already holds a run; pass --resume to continue "
                            f"it, --overwrite to delete its outputs and start over, or choose "
                            f"another run.dir")
        if overwrite:  # only the files a run writes; anything else in run.dir stays
            for path in (run_dir / n for n in RUN_OUTPUTS):
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    if world.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / "config.yaml", yaml.safe_dump(record, sort_keys=False))
        except OSError as e:
            raise unwritable(run_dir, e) from e
    barrier(world)
    return state, source


def best_weights(run_dir: Path, cfg: Config) -> dict | None:
    """After a resume, the best weights for the final restore come back from best.pt."""
    best = run_dir / "checkpoints" / "best.pt"
    if cfg.early_stop.patience == 0 or not best.exists():
        return None
    return load_verified(best)["model"]
