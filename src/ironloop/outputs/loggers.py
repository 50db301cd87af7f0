"""Where a run's rows go besides its JSONL files: TensorBoard, Weights & Biases, MLflow.

One small interface: ``write(kind, row)`` gets every metrics row (``kind="metrics"``, one per
logged optimizer step) and epoch row (``kind="epochs"``); ``ids()`` is what a resume needs to
continue the same external run (kept in the checkpoint under ``"loggers"``); ``close()``.
Keys are ``<kind>/<column>`` (``metrics/loss``, ``epochs/val_acc``) against the optimizer step.

A logger that fails (no disk, a bad URI, a server that went away) warns once and is dropped:
it never stops training (``Guarded``). A logger that is asked for but not installed is a
UserError at start, naming the extra to install. wandb and mlflow are imported only when used.

After a crash, the steps between the checkpoint and the crash are logged again by the resumed
process. The JSONL files and TensorBoard drop the old lines; W&B and MLflow are append-only, so
they hold such a step twice, and the later value is the one that counts (on CPU the two are
equal: the resume is bit-exact).

W&B writes its data every 15 s (``x_transaction_log_flush_interval``), so a killed process loses
what it logged in its last seconds, checkpointed steps included. A resume therefore replays into
such a logger the rows it kept from the last ``replay_seconds`` before the dead process's last
line (``replay``). MLflow's client writes each call through, and needs no replay.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ironloop.state.drift import flatten
from ironloop.errors import UserError
from ironloop.extras import require

SKIP = ("step", "epoch", "time")  # the x axis and bookkeeping, not metrics


def _failing() -> bool:
    """True inside the ``finally`` that closes the logs while an exception leaves fit()."""
    return sys.exc_info()[0] is not None


def _scalars(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Logger:
    """The interface. Subclasses override what they need."""

    name = "logger"
    replay_seconds = 0.0  # how far back a resume re-sends rows this logger may have lost

    def write(self, kind: str, row: dict) -> None:
        """Record one metrics or epochs row; ``row["step"]`` is the optimizer step."""

    def ids(self) -> dict[str, Any]:
        """What a resume needs to continue the same external run."""
        return {}

    def close(self) -> None:
        """Flush and finish."""


class Guarded(Logger):
    """Runs a logger; its first exception is a warning, after which it is dropped."""

    def __init__(self, inner: Logger):
        self.inner, self.name, self.failed = inner, inner.name, False
        self.replay_seconds = inner.replay_seconds

    def _call(self, what: str, *args):
        if self.failed:
            return None
        try:
            return getattr(self.inner, what)(*args)
        except Exception as e:  # a logger must never stop training
            self.failed = True
            warnings.warn(f"{self.name} logging failed ({type(e).__name__}: {e}); training "
                          f"continues without {self.name}", RuntimeWarning, stacklevel=3)
            return None

    def write(self, kind: str, row: dict) -> None:
        self._call("write", kind, row)

    def ids(self) -> dict[str, Any]:
        return self._call("ids") or {}

    def close(self) -> None:
        self._call("close")


class TensorBoard(Logger):
    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None):
        tb = require("torch.utils.tensorboard", "tensorboard", "log.tensorboard=true")
        # purge_step drops events past the checkpoint, like the JSONL truncation.
        purge = None if resume_step is None else resume_step + 1
        self.writer = tb.SummaryWriter(str(run_dir / "tb"), purge_step=purge)

    def write(self, kind: str, row: dict) -> None:
        for k, v in row.items():
            if k not in ("step", "epoch") and isinstance(v, (int, float)):
                self.writer.add_scalar(f"{kind}/{k}", v, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandB(Logger):
    """``log.wandb=true``: one W&B run per ironloop run; a resume continues the same run id."""

    name = "wandb"
    replay_seconds = 2 * 15.0  # twice W&B's default flush interval of the .wandb file

    def __init__(self, cfg, run_dir: Path, run_id: str | None):
        wandb = require("wandb", "wandb", "log.wandb=true")
        log = cfg.log
        mode = None if log.wandb_mode == "auto" else log.wandb_mode  # auto: WANDB_MODE decides
        self.run = wandb.init(project=log.wandb_project, name=log.wandb_name or run_dir.name,
                              dir=str(run_dir), mode=mode, id=run_id, resume="allow",
                              config=cfg.to_dict())
        # Our own x axis: wandb's internal step must only grow, and a resume goes back.
        self.run.define_metric("step")
        for kind in ("metrics", "epochs"):
            self.run.define_metric(f"{kind}/*", step_metric="step")

    def write(self, kind: str, row: dict) -> None:
        self.run.log({"step": row["step"],
                      **{f"{kind}/{k}": v for k, v in _scalars(row).items()}})

    def ids(self) -> dict[str, Any]:
        return {"wandb": self.run.id}

    def close(self) -> None:
        self.run.finish(exit_code=1 if _failing() else 0)


class MLflow(Logger):
    """``log.mlflow=true``: params from the config, metrics by step; a resume continues the run.

    Uses ``MlflowClient`` against one tracking URI, never mlflow's global active run."""

    name = "mlflow"

    def __init__(self, cfg, run_dir: Path, run_id: str | None):
        tracking = require("mlflow.tracking", "mlflow", "log.mlflow=true")
        self.entities = require("mlflow.entities", "mlflow", "log.mlflow=true")
        uri = cfg.log.mlflow_tracking_uri or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.client = tracking.MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        name = cfg.log.mlflow_experiment
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [self.entities.Param(k, str(v)[:6000]) for k, v in flatten(cfg.to_dict()).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, kind: str, row: dict) -> None:
        stamp = int(row.get("time", time.time()) * 1000)
        metrics = [self.entities.Metric(f"{kind}/{k}", v, stamp, row["step"])
                   for k, v in _scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def ids(self) -> dict[str, Any]:
        return {"mlflow": self.run_id}

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if _failing() else "FINISHED")


def replay(logs: list[Logger], metrics: list[dict], epochs: list[dict],
           last_time: float | None) -> None:
    """Re-send the kept rows a killed process may not have flushed: the metrics rows from the
    last ``replay_seconds`` before ``last_time`` (its last line), and the epoch rows since."""
    for logger in logs:
        if not logger.replay_seconds or last_time is None:
            continue
        recent = [r for r in metrics if r.get("time", 0.0) >= last_time - logger.replay_seconds]
        if not recent:
            continue
        first = recent[0]["step"]
        for kind, rows in (("metrics", metrics), ("epochs", epochs)):
            for row in rows:
                if row.get("step", 0) >= first:
                    logger.write(kind, row)


def build(cfg, run_dir: Path, resume_step: int | None, ids: dict) -> list[Logger]:
    """The loggers the config asks for, each guarded. ``ids`` come from the checkpoint.

    A missing package is a UserError now; any other failure to start warns and drops it."""
    wanted = [("tensorboard", cfg.log.tensorboard, lambda: TensorBoard(run_dir, resume_step)),
              ("wandb", cfg.log.wandb, lambda: WandB(cfg, run_dir, ids.get("wandb"))),
              ("mlflow", cfg.log.mlflow, lambda: MLflow(cfg, run_dir, ids.get("mlflow")))]
    out: list[Logger] = []
    for name, on, make in wanted:
        if not on:
            continue
        try:
            out.append(Guarded(make()))
        except UserError:
            raise
        except Exception as e:  # a logger must never stop training, not even at its start
            warnings.warn(f"{name} logging failed to start ({type(e).__name__}: {e}); training "
                          f"continues without {name}", RuntimeWarning, stacklevel=2)
    return out
