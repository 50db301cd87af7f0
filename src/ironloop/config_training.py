"""The config sections of what is trained and how: the run, the data, the model, the
training loop, the optimizer, clipping, the schedule, the loss, early stopping,
evaluation and weight averaging. ``ironloop.config`` re-exports every name here; import
from there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ironloop.config_fields import (
    Section,
    doc_field as fld,  # short: it is on every field below
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
