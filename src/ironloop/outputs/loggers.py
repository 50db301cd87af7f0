"""Where a run's rows go besides its JSONL files: TensorBoard, Weights & Biases, MLflow.

One small interface: ``write(kind, row)`` gets every metrics row (``kind="metrics"``, one per
logged optimizer step) and epoch row (``kind="epochs"``); ``ids()`` is what a resume needs to
continue the same external run (kept in the checkpoint under ``"loggers"``); ``close()``.
Keys are ``<kind>/<column>`` (``metrics/loss``, ``epochs/val_acc``) against the optimizer step.

A logger that fails (no disk, a bad URI, a server that went away) warns once and is dropped:
it never stops training (``Guarded``). A logger that is asked for but not installed is a
UserError at start, naming the extra to install. wandb and mlflow are imported only when used.

Rows reach a tracker only once the checkpoint covering their step is on disk, so each step is
there exactly once across kills and resumes (``durable.py``). MLflow writes asynchronously.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ironloop.errors import UserError
from ironloop.extras import require
from ironloop.outputs import durable
from ironloop.state.drift import flatten
from ironloop.state.run_dir import TENSORBOARD

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
    asynchronous = False  # write_rows returns before the store has them; flush() waits

    def write(self, kind: str, row: dict) -> None:
        """Record one row; ``row["step"]`` is the optimizer step."""

    def write_rows(self, rows: list[tuple[str, dict]]) -> None:
        """Record (kind, row) pairs, in order: one batch where the tracker takes batches."""
        for kind, row in rows:
            self.write(kind, row)

    def flush(self) -> None:
        """What was written survives this process's death, where the tracker allows it."""

    def held_steps(self) -> dict[str, int] | None:
        """The last step of each kind the tracker's own store holds; None when it cannot tell
        (then what it confirmed at each checkpoint counts: TensorBoard, flushed)."""
        return None

    def ids(self) -> dict[str, Any]:
        """What a resume needs to continue the same external run."""
        return {}

    def close(self) -> None:
        """Flush and finish."""


class Guarded:
    """Runs a tracker behind ``durable.Durable``; its first exception is a warning, after which
    it is dropped."""

    def __init__(self, inner: durable.Durable):
        self.inner, self.name, self.failed = inner, inner.name, False

    def _call(self, what: str, *args):
        if self.failed:
            return None
        try:
            return getattr(self.inner, what)(*args)
        except Exception as e:  # noqa: BLE001 - a logger must never stop training
            self.failed = True
            warnings.warn(f"{self.name} logging failed ({type(e).__name__}: {e}); training "
                          f"continues without {self.name}", RuntimeWarning, stacklevel=3)
            return None

    def write(self, kind: str, row: dict) -> None:
        self._call("write", kind, row)

    def durable(self, step: int) -> None:
        self._call("durable", step)

    def rewind(self, step: int) -> None:
        self._call("rewind", step)

    def held(self) -> dict[str, int]:
        return self._call("held") or {}

    def confirmed(self) -> int | None:
        return None if self.failed else self.inner.confirmed

    def ids(self) -> dict[str, Any]:
        return self._call("ids") or {}

    def close(self) -> None:
        self._call("finish", _failing())


class TensorBoard(Logger):
    name = "tensorboard"

    def __init__(self, run_dir: Path, confirmed: int | None):
        tb = require("torch.utils.tensorboard", "tensorboard", "log.tensorboard=true")
        # On resume, purge_step makes TensorBoard's reader drop the events past what the killed
        # process confirmed: those it may have half-written are sent again (durable.catch_up).
        purge = None if confirmed is None else confirmed + 1
        self.writer = tb.SummaryWriter(str(run_dir / TENSORBOARD), purge_step=purge)

    def write(self, kind: str, row: dict) -> None:
        for k, v in row.items():
            if k not in ("step", "epoch") and isinstance(v, (int, float)):
                self.writer.add_scalar(f"{kind}/{k}", v, row["step"])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Logger):
    """``log.wandb=true``: one W&B run per ironloop run; a resume continues the same run id."""

    name = "wandb"

    def __init__(self, cfg, run_dir: Path, run_id: str | None):
        wandb = require("wandb", "wandb", "log.wandb=true")
        self.run_dir = run_dir
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

    def held_steps(self) -> dict[str, int]:
        from ironloop.outputs.wandb_file import held_steps

        return held_steps(self.run_dir)

    def ids(self) -> dict[str, Any]:
        return {"wandb": self.run.id}

    def close(self) -> None:
        self.run.finish(exit_code=1 if _failing() else 0)


class MLflow(Logger):
    """``log.mlflow=true``: params from the config, metrics by step; a resume continues the run.

    Uses ``MlflowClient`` against one tracking URI, never mlflow's global active run."""

    name = "mlflow"
    asynchronous = True

    def __init__(self, cfg, run_dir: Path, run_id: str | None):
        self._ops: list = []
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
        self.write_rows([(kind, row)])

    def write_rows(self, rows: list[tuple[str, dict]]) -> None:
        """Whole rows per batch (at most 1000 metrics, MLflow's limit), in step order, each an
        atomic write: what the store holds is a prefix of the rows, which ``held_steps``
        reads back. Asynchronous: ``flush`` waits for them."""
        batch: list = []
        for kind, row in rows:
            stamp = int(row.get("time", time.time()) * 1000)
            metrics = [self.entities.Metric(f"{kind}/{k}", v, stamp, row["step"])
                       for k, v in _scalars(row).items()]
            if batch and len(batch) + len(metrics) > 1000:
                self._ops.append(self.client.log_batch(self.run_id, metrics=batch,
                                                       synchronous=False))
                batch = []
            batch += metrics
        if batch:
            self._ops.append(self.client.log_batch(self.run_id, metrics=batch,
                                                   synchronous=False))

    def flush(self) -> None:
        for op in self._ops:
            op.wait()
        self._ops = []

    def held_steps(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for key in self.client.get_run(self.run_id).data.metrics:
            kind = key.split("/", 1)[0]
            steps = [m.step for m in self.client.get_metric_history(self.run_id, key)]
            held[kind] = max([held.get(kind, 0), *steps])
        return held

    def ids(self) -> dict[str, Any]:
        return {"mlflow": self.run_id}

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, "FAILED" if _failing() else "FINISHED")


def build(cfg, run_dir: Path, resume_step: int | None, ids: dict) -> list[Guarded]:
    """The trackers the config asks for, each behind the checkpoints (``durable.Durable``) and
    guarded. ``ids`` come from the checkpoint; on a resume, each continues where
    ``trackers.json`` says it confirmed its rows.

    A missing package is a UserError now; any other failure to start warns and drops it."""
    marks = durable.read_marks(run_dir) if resume_step is not None else {}
    tb_mark = None if resume_step is None else marks.get("tensorboard", 0)
    wanted = [("tensorboard", cfg.log.tensorboard, lambda: TensorBoard(run_dir, tb_mark)),
              ("wandb", cfg.log.wandb, lambda: WandB(cfg, run_dir, ids.get("wandb"))),
              ("mlflow", cfg.log.mlflow, lambda: MLflow(cfg, run_dir, ids.get("mlflow")))]
    out: list[Guarded] = []
    for name, on, make in wanted:
        if not on:
            continue
        try:
            out.append(Guarded(durable.Durable(make(), marks.get(name, 0),
                                               passthrough=not cfg.checkpoint.enabled)))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a logger must never stop training, not at its start
            warnings.warn(f"{name} logging failed to start ({type(e).__name__}: {e}); training "
                          f"continues without {name}", RuntimeWarning, stacklevel=2)
    return out
