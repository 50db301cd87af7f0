"""The config sections of how a run is watched, kept and spread: logging, checkpoints,
fault injection, the non-finite guard, profiling, the preflight doctor and distribution.
``ironloop.config`` re-exports every name here; import from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ironloop.config_fields import (
    Section,
    doc_field as fld,  # short: it is on every field below
)


@dataclass
class LogConfig(Section):
    _name = "log"
    every_steps: int = fld(10, "write a metrics.jsonl line every N optimizer steps")
    tensorboard: bool = fld(False, "also write TensorBoard events to run.dir/tb")
    progress: str = fld("auto", "auto: a tqdm bar on a terminal, plain progress lines when "
                        "stdout is not one (a log file); on: the bar always; off: neither",
                        ("auto", "on", "off"))
    progress_every_steps: int = fld(100, "plain progress line every N optimizer steps (0 = "
                                    "by time only)")
    progress_every_s: float = fld(30.0, "plain progress line every N seconds too, "
                                  "whichever comes first (0 = by steps only)")
    wandb: bool = fld(False, "also log to Weights & Biases (pip install 'ironloop[wandb]')")
    wandb_project: str = fld("ironloop", "W&B project")
    wandb_name: str = fld("", "W&B run name (empty = the name of run.dir)")
    wandb_mode: str = fld("auto", "W&B mode; auto = WANDB_MODE or wandb's default",
                         ("auto", "online", "offline", "disabled"))
    mlflow: bool = fld(False, "also log to MLflow (pip install 'ironloop[mlflow]')")
    mlflow_tracking_uri: str = fld("", "MLflow tracking URI (empty = sqlite:///<run.dir>/mlflow.db)")
    mlflow_experiment: str = fld("ironloop", "MLflow experiment name")
    loss_growth: float = fld(10.0, "warn once when a logged loss exceeds this many times the "
                             "run's first logged loss (kept in the checkpoint, so a resume "
                             "keeps it; a finite divergence; no extra device sync); 0 = off")

    def validate(self) -> None:
        self._positive("every_steps")
        self._non_negative("progress_every_steps", "progress_every_s")
        if self.loss_growth and self.loss_growth <= 1:
            self._bad("loss_growth", "must be > 1 (a factor over the first logged loss), or 0 "
                      "to turn the warning off")


@dataclass
class CheckpointConfig(Section):
    _name = "checkpoint"
    enabled: bool = fld(True, "write checkpoints to run.dir/checkpoints")
    every_steps: int = fld(0, "also checkpoint every N optimizer steps (0 = at epoch ends only)")
    keep_last: int = fld(3, "rolling step-N.pt files to keep (0 = only last.pt and best.pt)")
    async_write: bool = fld(False, "write in a background thread after a CPU snapshot",
                           key="async")
    remote: str = fld("", "also upload each checkpoint, in the background, to this fsspec URL "
                     "(s3://bucket/prefix, gs://..., file:///...); --resume fetches from it "
                     "when run.dir has nothing newer ('' = off; needs ironloop[remote])")
    remote_options: dict = fld({}, "keyword arguments for the remote's fsspec filesystem (e.g. "
                               "{profile: ...}); credentials and endpoints otherwise come the "
                               "filesystem's usual way (AWS_* variables, AWS_ENDPOINT_URL)")
    remote_retries: int = fld(5, "retries of a failed upload, with backoff from 0.5 s doubling "
                              "to 30 s; then it is skipped with a warning, training goes on")
    remote_wait_s: float = fld(120.0, "at the end of a run (and on SIGTERM), how long pending "
                               "uploads may still take")
    slurm_requeue: bool = fld(True, "under SLURM, requeue the job (scontrol requeue) after the "
                              "checkpoint of a time limit or a preemption; never on scancel")
    slurm_min_steps: int = fld(5, "under SLURM, a time limit's stop is requeued only if its "
                                  "attempt trained at least this many steps: fewer means the "
                                  "warning came during start-up, as it would in every attempt "
                                  "(exit 75, saying so; 0 = always requeue)")

    def validate(self) -> None:
        self._non_negative("every_steps", "keep_last", "remote_retries", "remote_wait_s",
                           "slurm_min_steps")


@dataclass
class FaultConfig(Section):
    _name = "fault"
    crash_at_step: int = fld(0, "lab knob: os._exit(1) right after optimizer step N (0 = off)")
    nan_at_step: list = fld([], "guard knob: make the loss NaN on the first attempt at these "
                               "optimizer steps ([20, 21, 22]: three bad steps in a row)")
    nan_sample: int = fld(-1, "guard knob: make sample I's input NaN on every read (-1 = off)")

    oom_at_step: int = fld(0, "test knob: raise torch.OutOfMemoryError after step N (0 = off)")

    def validate(self) -> None:
        self._non_negative("crash_at_step", "oom_at_step")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.nan_at_step):
            self._bad("nan_at_step", "must be a step number >= 1 or a list of them, e.g. [10, 20]")
        if self.nan_sample < -1:
            self._bad("nan_sample", "must be a sample index >= 0, or -1 to disable it")


@dataclass
class GuardConfig(Section):
    _name = "guard"
    enabled: bool = fld(True, "skip steps whose loss or grad norm is non-finite; roll back on "
                       "repeats")
    max_bad_steps: int = fld(3, "consecutive bad steps that trigger a rollback")
    max_rollbacks: int = fld(3, "rollbacks allowed; the next trigger stops the run (exit code 3)")
    lr_backoff: float = fld(0.5, "LR multiplier applied at each rollback, kept for the rest of "
                           "the run")
    rollback_to: str = fld("checkpoint", "checkpoint: the newest checkpoint (the run's start "
                          "before the first); memory: a CPU copy taken at each checkpoint point",
                          ("checkpoint", "memory"))
    spike_factor: float = fld(0.0, "opt-in: also bad when loss or grad norm > median + factor x "
                             "1.4826 MAD of recent good steps (0 = off; 6 is a common choice)")
    spike_window: int = fld(100, "good steps the spike statistic looks back over")
    spike_warmup: int = fld(100, "first optimizer steps kept out of the spike statistic")

    def validate(self) -> None:
        self._positive("max_bad_steps", "spike_window")
        self._non_negative("max_rollbacks", "spike_factor", "spike_warmup")
        if not 0.0 < self.lr_backoff <= 1.0:
            self._bad("lr_backoff", "must be in (0, 1]")


@dataclass
class ProfileConfig(Section):
    _name = "profile"
    breakdown: bool = fld(True, "time data/copy/forward/backward/optimizer/checkpoint/validation")
    sync: bool = fld(False, "CUDA: synchronize around forward and backward (exact, slower)")
    trace: bool = fld(False, "write a torch.profiler trace of a few steps to run.dir/trace")
    trace_steps: int = fld(3, "optimizer steps the trace records (after 1 wait + 1 warm-up)")
    peak_tflops: float = fld(0.0, "the device's peak TFLOP/s: logs mfu = 6 x parameters x "
                             "tokens_per_s / peak, for steps that report tokens (0 = off)")

    def validate(self) -> None:
        self._positive("trace_steps")
        self._non_negative("peak_tflops")


@dataclass
class DoctorConfig(Section):
    _name = "doctor"
    preflight: bool | None = fld(None, "the doctor's quick checks before training (doctor.json): "
                                 "null = ironloop train runs them, fit() does not; true = "
                                 "fit() too; false = neither")
    strict: bool = fld(False, "stop before training (exit 2) when a check finds an error")
    overfit_steps: int = fld(30, "overfit-one-batch check: optimizer steps allowed")
    max_batches: int = fld(8, "preflight: batches timed, and read from data not in memory")
    memory_search: bool = fld(False, "CUDA: find the largest batch that fits by search")

    def validate(self) -> None:
        self._positive("overfit_steps", "max_batches")


@dataclass
class DistConfig(Section):
    _name = "dist"
    strategy: str = fld("auto", "auto (ddp when world > 1) | ddp | fsdp (FSDP2, DCP checkpoints) "
                       "| none", ("auto", "ddp", "fsdp", "none"))
    fsdp_modules: list = fld([], "fsdp: class names of the blocks to shard one by one "
                            "(empty = each child of a Sequential or ModuleList)")
    timeout_s: float = fld(600.0, "seconds a collective may wait for a silent rank before the "
                          "job fails (torch.distributed's process-group timeout)")

    def validate(self) -> None:
        self._positive("timeout_s")
        if any(not isinstance(n, str) or not n for n in self.fsdp_modules):
            self._bad("fsdp_modules", "must be a list of module class names, e.g. [Block]")
