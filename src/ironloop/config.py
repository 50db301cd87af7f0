"""Typed, self-validating configuration.

One dataclass per section, one line of doc per field. ``load_config`` reads YAML, applies dotted
``key=value`` overrides and validates everything; every error names the dotted key and the
allowed values, and is a ``ConfigError`` (the CLI turns it into exit code 2, no traceback).
No ``exec``, no ``eval``: values are parsed with a safe YAML loader (that refuses a key given
twice: ``config_fields.load_yaml``) and coerced to the field type.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ironloop.config_fields import (
    Section,
    build_section,
    doc_field as fld,  # short: it is on every field below
    load_yaml,
    split_override,
    yaml_key,
)
from ironloop.errors import ConfigError

#: The most threads or loader processes one run may start (a typo's millions fork-bomb).
MAX_PROCS = 1024
NAME_MAX = 255  # bytes in one path component on Linux, macOS and Windows filesystems


@dataclass
class RunConfig(Section):
    _name = "run"
    dir: str = fld("runs/run", "output directory: config, logs, checkpoints, weights")
    seed: int = fld(0, "seeds python, numpy, torch, the data order and the loader workers")
    device: str = fld("auto", "where to train; auto picks cuda, then mps, then cpu",
                     ("auto", "cpu", "cuda", "mps"))
    threads: int = fld(0, "the process's intra-op CPU threads (torch.set_num_threads) for the "
                       "run; 0 = torch's default (OMP_NUM_THREADS, else one per core)")

    def validate(self) -> None:
        if not 0 <= self.threads <= MAX_PROCS:
            # torch.set_num_threads takes any count; OpenMP then crashes the run (SIGSEGV)
            self._bad("threads", f"must be in [0, {MAX_PROCS}] (0 = torch's default)")
        if not self.dir.strip():  # as from run.dir=$UNSET: it trained into the current directory
            self._bad("dir", "is empty; name the run's output directory, e.g. run.dir=runs/a")
        long = [part for part in self.dir.split("/") if len(os.fsencode(part)) > NAME_MAX]
        if long:  # the lock's open failed with a traceback (ENAMETOOLONG)
            self._bad("dir", f"has a component of {len(os.fsencode(long[0]))} bytes "
                      f"({long[0][:24]}...); a file name may have at most {NAME_MAX}: shorten it")


@dataclass
class DataConfig(Section):
    _name = "data"
    name: str = fld("digits", "dataset: digits | mnist1d | fashion-mnist | synthetic | "
                   "'module:factory' (returns (train, val[, test]) datasets)")
    root: str = fld("data", "directory holding dataset files (fashion-mnist)")
    val_fraction: float = fld(0.2, "fraction of the training split held out for validation")
    num_workers: int = fld(0, "DataLoader worker processes (0 = load in the main process)")
    seed_samples: bool = fld(True, "seed python, numpy and torch from (seed, epoch, index) before "
                             "each __getitem__: augmentation exact under resume and num_workers")
    shuffle: bool = fld(True, "shuffle the training order each epoch; false = the dataset's own "
                        "order (sequences, ContiguousStreams)")
    pin_memory: bool = fld(True, "pin host batches for faster non_blocking copies (CUDA only)")
    download: bool = fld(False, "fetch missing fashion-mnist files and verify their MD5s")
    num_samples: int = fld(4096, "synthetic only: number of samples")
    input_shape: list = fld([1, 28, 28], "synthetic only: shape of one input")
    num_classes: int = fld(10, "synthetic only: number of classes")
    kwargs: dict = fld({}, "module:factory data only: keyword arguments, besides root=data.root")
    stream_resume: str = fld("auto", "a stream's mid-epoch resume: auto (its state_dict when it "
                             "has an exact one, else replay) | state | replay (read the epoch's "
                             "served batches again)", ("auto", "state", "replay"))

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            self._bad("val_fraction", "must be in [0, 1)")
        if not 0 <= self.num_workers <= MAX_PROCS:
            self._bad("num_workers", f"must be in [0, {MAX_PROCS}] (0 = load in the main "
                      f"process; a few per core is plenty)")
        self._positive("num_samples", "num_classes")
        if not self.input_shape or any(not isinstance(d, int) or d <= 0 for d in self.input_shape):
            self._bad("input_shape", "must be a non-empty list of positive ints, e.g. [1, 28, 28]")


@dataclass
class ModelConfig(Section):
    _name = "model"
    name: str = fld("mlp", "built-in model (mlp, small_cnn, cnn1d) or 'module:factory'")
    kwargs: dict = fld({}, "extra keyword arguments for the model factory")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainConfig(Section):
    _name = "train"
    epochs: int = fld(10, "passes over the training split")
    max_steps: int = fld(0, "stop after this many optimizer steps (0 = no cap)")
    batch_size: int = fld(64, "samples per micro-batch, per process")
    accumulation_steps: int = fld(1, "micro-batches summed into one optimizer step")
    global_batch_size: int = fld(0, "samples per optimizer step over all ranks, kept on a resume "
                                 "at another world size by re-deriving accumulation_steps "
                                 "(0 = batch_size x accumulation_steps x ranks at the start)")
    precision: str = fld("fp32", "fp32 | fp16 (autocast + GradScaler) | bf16 (autocast) | auto",
                        ("fp32", "fp16", "bf16", "auto"))
    step_fn: str = fld("", "'module:function' step(model, batch[, state]) -> (loss, {name: "
                       "tensor}[, weight]); lm = next-token cross-entropy per token; empty = "
                       "the (inputs, targets) step")
    carry_reset: str = fld("epoch", "a stateful step's state starts empty at each epoch (epoch) "
                           "or only at the run's start (never)", ("epoch", "never"))
    compile: bool = fld(False, "torch.compile the model for training (evaluation runs eager)")
    compile_mode: str = fld("default", "torch.compile mode", COMPILE_MODES)
    cuda_graph: bool = fld(False, "capture the whole optimizer step (forward, backward, guard, "
                           "clip, step) as one CUDA graph after 3 eager steps; CUDA only")
    activation_checkpointing: list = fld([], "block class names whose forward is recomputed "
                                        "in backward (torch.utils.checkpoint), e.g. [Block]")
    callbacks: list = fld([], "callbacks to build, after fit()'s own: each 'module:Class', or "
                          "a mapping of spec: 'module:Class' and its keyword arguments")

    def validate(self) -> None:
        self._positive("epochs", "batch_size")
        self._non_negative("max_steps", "global_batch_size")
        if self.accumulation_steps < 1:
            self._bad("accumulation_steps", "must be >= 1")
        if self.step_fn and ":" not in self.step_fn and self.step_fn != "lm":
            self._bad("step_fn", "must be 'module:function' (e.g. my_pkg.steps:step) or lm")
        if any(not isinstance(n, str) or not n for n in self.activation_checkpointing):
            self._bad("activation_checkpointing", "must be a list of class names, e.g. [Block]")
        for spec in self.callbacks:
            name = spec.get("spec") if isinstance(spec, dict) else spec
            if not isinstance(name, str) or ":" not in name:
                self._bad("callbacks", "must be a list of 'module:Class' or {spec: "
                          "'module:Class', kwarg: value}, e.g. [my_pkg.cbs:Printer]")


#: The optimizers optim.* configures in full; any other torch.optim class is taken by name.
BUILT_IN_OPTIMIZERS = ("adamw", "adam", "sgd")


def torch_optimizer(name: str) -> type | None:
    """The torch.optim class called ``name``, or None (torch is imported only for such a name)."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    import torch.optim

    cls = getattr(torch.optim, name, None)
    optimizer = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
    return cls if optimizer and cls is not torch.optim.Optimizer else None


@dataclass
class OptimConfig(Section):
    _name = "optim"
    name: str = fld("adamw", "optimizer: adamw | adam | sgd, or a torch.optim class by name "
                    "(LBFGS, RMSprop, ...: lr, weight_decay and optim.args reach it, torch's "
                    "defaults the rest), or 'module:factory' returning {name: optimizer} for a "
                    "step that updates several (engine/several.py)")
    lr: float = fld(1e-3, "learning rate (the peak for onecycle is schedule.max_lr); 0 "
                    "freezes the weights, also on a resume")
    weight_decay: float = fld(0.01, "decoupled (adamw) or L2 (adam, sgd) weight decay")
    momentum: float = fld(0.9, "sgd momentum")
    decay_bias_and_norm: bool = fld(False, "also decay biases and norm weights (usually wrong)")
    betas: list = fld([0.9, 0.999], "adamw, adam: (beta1, beta2); nanoGPT uses [0.9, 0.95]")
    eps: float = fld(1e-8, "adamw, adam: denominator epsilon")
    fused: bool | None = fld(None, "fused optimizer kernel (true, false; null = torch's default)")
    foreach: bool | None = fld(None, "multi-tensor (foreach) kernel (null = torch's default)")
    args: dict = fld({}, "more keyword arguments for the optimizer class (a mapping, e.g. "
                     "LBFGS's history_size and max_iter)")

    def validate(self) -> None:
        if self.name not in BUILT_IN_OPTIMIZERS and not torch_optimizer(self.name) and \
                ":" not in self.name:
            import torch.optim

            near = [n for n in dir(torch.optim) if n.lower() == self.name.lower()
                    and torch_optimizer(n)]
            self._bad("name", f"must be one of {', '.join(BUILT_IN_OPTIMIZERS)}, or the name of "
                      f"a torch.optim class ({near[0] if near else 'LBFGS, RMSprop, ...'}: the "
                      f"case matters), or 'module:factory' for several optimizers")
        if any(k in self.args for k in ("params", "lr")):
            self._bad("args", "params and lr are set by ironloop (lr: optim.lr); remove them")
        self._positive("eps")
        self._non_negative("lr", "weight_decay", "momentum")
        if len(self.betas) != 2 or any(isinstance(b, bool) or not isinstance(b, (int, float))
                                       or not 0.0 <= b < 1.0 for b in self.betas):
            self._bad("betas", "must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        self.betas = [float(b) for b in self.betas]
        if self.fused and self.foreach:
            self._bad("fused", "fused and foreach cannot both be true; set one of them")


@dataclass
class ClipConfig(Section):
    _name = "clip"
    max_norm: float = fld(1.0, "clip threshold; 0 disables clipping (the norm is still logged)")
    mode: str = fld("norm", "clip the global grad norm, or each grad value", ("norm", "value"))

    def validate(self) -> None:
        self._non_negative("max_norm")


SCHEDULES = ("constant", "warmup_cosine", "onecycle", "cosine", "cosine_restarts", "plateau")


@dataclass
class ScheduleConfig(Section):
    _name = "schedule"
    name: str = fld("constant", "learning-rate schedule", SCHEDULES)
    warmup_steps: int = fld(0, "warmup_cosine: optimizer steps of linear warmup")
    warmup_start_factor: float = fld(0.01, "warmup_cosine: LR multiplier at step 0")
    max_lr: float = fld(0.0, "onecycle: peak LR (0 = 10 x optim.lr)")
    pct_start: float = fld(0.3, "onecycle: fraction of steps spent rising")
    eta_min: float = fld(0.0, "cosine*: the LR at the bottom of the cosine")
    T_0: int = fld(0, "cosine_restarts: optimizer steps in the first cycle (0 = one epoch)")
    T_mult: int = fld(1, "cosine_restarts: cycle length multiplier")
    factor: float = fld(0.1, "plateau: LR multiplier on a plateau")
    patience: int = fld(2, "plateau: evaluations without improvement before cutting the LR")

    def validate(self) -> None:
        self._non_negative("warmup_steps", "max_lr", "eta_min", "T_0", "patience")
        if not 0.0 < self.pct_start < 1.0:
            self._bad("pct_start", "must be in (0, 1)")
        if not 0.0 < self.factor < 1.0:
            self._bad("factor", "must be in (0, 1)")
        if not 0.0 < self.warmup_start_factor <= 1.0:
            self._bad("warmup_start_factor", "must be in (0, 1]")
        if self.T_mult < 1:
            self._bad("T_mult", "must be >= 1")


LOSSES = ("cross_entropy", "bce_logits", "mse", "huber", "kl_div")


@dataclass
class LossConfig(Section):
    _name = "loss"
    name: str = fld("cross_entropy", f"loss function: {' | '.join(LOSSES)} | "
                   "'module:function' called as loss(output, target)")
    label_smoothing: float = fld(0.0, "cross_entropy: label smoothing in [0, 1)")
    class_weights: list = fld([], "per-class loss weights (empty = all 1)")
    huber_delta: float = fld(1.0, "huber: where the loss turns from quadratic to linear")

    def validate(self) -> None:
        if self.name not in LOSSES and ":" not in self.name:
            self._bad("name", f"must be one of {', '.join(LOSSES)}, or 'module:function'")
        if not 0.0 <= self.label_smoothing < 1.0:
            self._bad("label_smoothing", "must be in [0, 1)")
        if any(not isinstance(w, (int, float)) or w < 0 for w in self.class_weights):
            self._bad("class_weights", "must be a list of non-negative numbers")
        self._positive("huber_delta")


@dataclass
class EarlyStopConfig(Section):
    _name = "early_stop"
    patience: int = fld(0, "evaluations without improvement before stopping (0 disables)")
    min_delta: float = fld(0.0, "smallest change that counts as an improvement")
    metric: str = fld("val_loss", "monitored metric: also picks best.pt and drives plateau")
    mode: str = fld("auto", "min or max; auto = min for *loss, max otherwise",
                   ("auto", "min", "max"))

    def validate(self) -> None:
        self._non_negative("patience", "min_delta")
        if not self.metric.startswith("val_"):
            self._bad("metric", "must be a validation metric such as val_loss or val_acc")

    @property
    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return "min" if self.metric.endswith("loss") else "max"


@dataclass
class EvalConfig(Section):
    _name = "eval"
    every_steps: int = fld(0, "evaluate every N optimizer steps (0 = at each epoch end)")
    max_batches: int = fld(0, "evaluate on a fixed subset of N batches of the val split "
                          "(0 = all of it)")
    perplexity: bool = fld(False, "log val_ppl = exp(val_loss) (always on with "
                           "train.step_fn=lm)")
    metrics: dict = fld({}, "whole-split metrics logged as val_<name>: {name: {spec: "
                        "torchmetrics.classification.MulticlassF1Score, num_classes: 10, ...}}")

    def validate(self) -> None:
        self._non_negative("every_steps", "max_batches")
        for name, spec in self.metrics.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("spec"), str) or \
                    ("." not in spec["spec"] and ":" not in spec["spec"]):
                raise ConfigError(f"eval.metrics.{name}={spec!r}: must be a mapping with spec: "
                                  f"module.Class and its arguments, e.g. {{spec: torchmetrics."
                                  f"classification.MulticlassF1Score, num_classes: 10}}")


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


AVERAGES = ("none", "ema", "swa")


@dataclass
class AverageConfig(Section):
    _name = "average"
    kind: str = fld("none", "weight averaging: none | ema (exponential moving average) | swa "
                    "(equal average, BatchNorm recomputed for final_avg.safetensors)", AVERAGES)
    decay: float = fld(0.999, "ema: average = decay x average + (1 - decay) x weights, per update")
    warmup: bool = fld(True, "ema: after t updates the decay is min(decay, (1 + t) / (10 + t)), "
                       "as TensorFlow and timm warm it up, so the random initial weights fade "
                       "from the average within its first hundred updates")
    start_step: int = fld(0, "the first optimizer step whose weights join the average")
    every_steps: int = fld(1, "update the average after every N optimizer steps")

    def validate(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            self._bad("decay", "must be in [0, 1], e.g. 0.999")
        self._non_negative("start_step")
        self._positive("every_steps")


@dataclass
class Config:
    """The whole resolved configuration; ``to_dict`` round-trips through ``from_dict``."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    average: AverageConfig = field(default_factory=AverageConfig)

    @classmethod
    def from_dict(cls, raw: dict | None) -> Config:
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
        # config.yaml's `used:` block is a record of the run, not config (see records.py).
        raw = {k: v for k, v in raw.items() if k != "used"}
        unknown = sorted(set(raw) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"unknown config section '{unknown[0]}'; "
                              f"known sections: {', '.join(SECTIONS)}")
        return cls(**{name: build_section(SECTIONS[name], raw.get(name)) for name in SECTIONS})

    def to_dict(self) -> dict:
        return {name: {yaml_key(sec, f.name): getattr(sec, f.name) for f in dataclasses.fields(sec)}
                for name, sec in ((n, getattr(self, n)) for n in SECTIONS)}

    def with_overrides(self, overrides: list[str] | dict) -> Config:
        raw = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else map(split_override, overrides)
        for dotted, value in items:
            _set_dotted(raw, dotted, value)
        return Config.from_dict(raw)


#: section name -> its dataclass, read off Config's fields so the two cannot drift apart.
SECTIONS: dict[str, type[Section]] = {f.name: typing.cast("type[Section]", f.default_factory)
                                      for f in dataclasses.fields(Config)}


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) < 2 or parts[0] not in SECTIONS:
        raise ConfigError(f"unknown config key '{dotted}'; keys look like section.key with "
                          f"section one of {', '.join(SECTIONS)}")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; pass the path of a YAML file, "
                              f"e.g. configs/digits.yaml")
        try:
            raw = load_yaml(path.read_text(), str(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}".replace("\n", " ")) from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start} is "
                              f"{e.object[e.start:e.start + 1]!r}); save it as UTF-8") from None
    return Config.from_dict(raw).with_overrides(overrides or [])


def describe() -> str:
    """Every key with its default and doc, for ``ironloop train help``."""
    lines = []
    for name, cls in SECTIONS.items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            choices = f.metadata.get("choices")
            doc = f.metadata["doc"]
            # the allowed values, unless the doc already lists them (as "a | b | c")
            allowed = f" (one of: {' | '.join(map(str, choices))})" if choices and \
                " | " not in doc else ""
            shown = "null" if default is None else repr(default)  # what an override accepts
            lines.append(f"{name}.{f.metadata.get('key') or f.name} = {shown}  "
                         f"# {doc}{allowed}")
    return "\n".join(lines)
