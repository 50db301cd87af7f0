"""Optimizer, learning-rate schedule and loss, built from the config with torch's own classes."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from ironloop.config import torch_optimizer
from ironloop.errors import ConfigError, UserError
from ironloop.parallel.data_parallel import is_sharded


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict]:
    """Decay matrices and conv kernels; leave biases and norm weights (ndim < 2) undecayed.

    Decaying a bias or a LayerNorm/BatchNorm gain pulls it towards 0 for no regularising benefit.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if decay_all or p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """adamw, adam, sgd as ``optim.*`` describes; any other torch.optim class by its name, with
    optim.lr, optim.weight_decay and optim.fused/foreach where its constructor takes them,
    optim.args, and torch's defaults for the rest."""
    cls = _class_of(cfg.name)
    if cls is torch.optim.SparseAdam:
        _refuse_dense(model)
    takes = inspect.signature(cls).parameters
    groups = param_groups(model, cfg.weight_decay, cfg.decay_bias_and_norm) \
        if "weight_decay" in takes else [p for p in model.parameters() if p.requires_grad]
    # None = let torch pick its default kernel; passing fused=None is not the same on every torch.
    kernels = {k: v for k, v in (("fused", cfg.fused), ("foreach", cfg.foreach))
               if v is not None and k in takes}
    if not kernels and "fused" in takes and _fused_fits(model):
        # Fused when neither key is set: the guard can then skip a bad step inside the kernel
        # (found_inf) without reading its verdict on the host (guard/verdict.py).
        kernels = {"fused": True}
    known = {"adamw": {"betas": tuple(cfg.betas), "eps": cfg.eps},
             "adam": {"betas": tuple(cfg.betas), "eps": cfg.eps},
             "sgd": {"momentum": cfg.momentum}}.get(cfg.name, {})
    try:
        return cls(groups, lr=cfg.lr, **known, **kernels, **cfg.args)  # type: ignore[call-arg]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optim.name={cfg.name} with optim.args={cfg.args}: "
                          f"{str(e).splitlines()[0]}; see help(torch.optim.{cls.__name__})"
                          ) from None


def _refuse_dense(model: nn.Module) -> None:
    """SparseAdam steps only sparse gradients: refused before training, not at the first step
    (RuntimeError: SparseAdam does not support dense gradients)."""
    sparse = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
              and m.sparse for p in m.parameters()}
    dense = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in sparse]
    if dense:
        raise ConfigError(f"optim.name=SparseAdam steps sparse gradients only, and parameter "
                          f"{dense[0]!r} (of {len(dense)}) gets a dense one; use optim.name=adam "
                          f"or adamw, or pass an optimizer of your own to fit()")


def _fused_fits(model: nn.Module) -> bool:
    """Whether torch has fused Adam/AdamW/SGD kernels for these parameters: floating point,
    plain tensors (not FSDP2's DTensor shards) on a device with the kernels."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # private

    devices = _get_fused_kernels_supported_devices()
    return all(p.is_floating_point() and not is_sharded(p) and p.device.type in devices
               for p in model.parameters() if p.requires_grad)


def kernel(opt: torch.optim.Optimizer) -> str:
    """The kernel ``opt`` steps with: fused, foreach, or loop (one tensor at a time). torch's
    default (neither set) is foreach when every parameter is on CUDA, else the loop."""
    if opt.defaults.get("fused"):
        return "fused"
    foreach = opt.defaults.get("foreach")
    if foreach is None:
        foreach = all(p.is_cuda for g in opt.param_groups for p in g["params"])
    return "foreach" if foreach else "loop"


def takes(opt: torch.optim.Optimizer, argument: str) -> bool:
    """Whether the optimizer's class takes ``argument`` (LBFGS takes neither fused nor
    foreach)."""
    return argument in inspect.signature(type(opt).__init__).parameters


def foreign(opt: torch.optim.Optimizer, cfg) -> str:
    """The optimizer's class name when it is not the class ``optim.name`` builds (the user
    passed their own), else ''."""
    if ":" in cfg.name:  # a 'module:factory' of several optimizers (engine/several.py)
        return type(opt).__name__
    return "" if type(opt) is _class_of(cfg.name) else type(opt).__name__


def _class_of(name: str) -> type[torch.optim.Optimizer]:
    """The class ``optim.name`` names (the config checked it is one)."""
    builtin = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    cls = builtin.get(name) or torch_optimizer(name)
    if cls is None:
        raise ConfigError(f"optim.name={name!r}: not a torch.optim class")
    return cls


def fused_open(opt: torch.optim.Optimizer) -> bool:
    """Whether torch has a fused kernel for this optimizer's class and parameters."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # private

    if not takes(opt, "fused"):
        return False
    devices = _get_fused_kernels_supported_devices()
    params = [p for g in opt.param_groups for p in g["params"]]
    return bool(params) and all(p.is_floating_point() and not is_sharded(p)
                                and p.device.type in devices for p in params)


def check_given(given) -> None:
    """fit()'s ``optimizer=``: an Optimizer, a factory, a mapping of them (several, see
    engine/several.py) or None; anything else is refused before it is called."""
    if given is None or isinstance(given, (torch.optim.Optimizer, Mapping)) or callable(given):
        return
    several = " (several optimizers: a dict {name: optimizer}, and a step_fn(model, batch, " \
        "optimizers) that updates each)" if isinstance(given, (list, tuple)) else ""
    raise UserError(f"optimizer= must be a torch.optim.Optimizer or a factory "
                    f"factory(params) returning one{several}; got {type(given).__name__}")


def resolve_optimizer(given, model: nn.Module, cfg) -> torch.optim.Optimizer:
    """The user's optimizer (an object, or a factory called with the model's parameters), or
    the one ``optim.*`` describes."""
    if given is None:
        return build_optimizer(model, cfg)
    check_given(given)
    opt = given if isinstance(given, torch.optim.Optimizer) else given(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise UserError(f"optimizer= must be a torch.optim.Optimizer or a factory "
                        f"factory(params) returning one; its factory returned "
                        f"{type(opt).__name__}")
    ours = {id(p) for p in model.parameters()}
    if not any(id(p) in ours for g in opt.param_groups for p in g["params"]):
        raise UserError("optimizer= holds none of the model's parameters; build it from "
                        "model.parameters() (of the model passed to fit) or pass a factory")
    return opt


def resolve_scheduler(given, opt: torch.optim.Optimizer, cfg, steps_per_epoch: int,
                      total_steps: int):
    """(scheduler or None, cadence) for the user's scheduler (an object, or a factory called with
    the optimizer) or the one ``schedule.*`` describes. ReduceLROnPlateau steps per evaluation
    with the monitored metric; every other scheduler steps once per optimizer step."""
    if given is None:
        return build_scheduler(opt, cfg, steps_per_epoch, total_steps)
    is_sched = isinstance(given, (sched.LRScheduler, sched.ReduceLROnPlateau))
    scheduler = given if is_sched else given(opt)
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
        raise UserError(f"scheduler= must be a torch LR scheduler or a factory "
                        f"factory(optimizer) returning one; got {type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", opt) is not opt:
        raise UserError("scheduler= is bound to another optimizer than the one fit() uses; "
                        "pass optimizer= too, or pass the scheduler as a factory "
                        "factory(optimizer)")
    return scheduler, cadence_of(scheduler)


def cadence_of(scheduler) -> str:
    return "eval" if isinstance(scheduler, sched.ReduceLROnPlateau) else "step"


def build_scheduler(opt: torch.optim.Optimizer, cfg, steps_per_epoch: int, total_steps: int):
    """Returns (scheduler or None, cadence): cadence is "step" (once per optimizer step) or
    "eval" (ReduceLROnPlateau, once per evaluation with the monitored metric)."""
    name, total = cfg.name, max(1, total_steps)
    if name == "constant":
        return None, "step"
    if name == "plateau":
        return sched.ReduceLROnPlateau(opt, factor=cfg.factor, patience=cfg.patience), "eval"
    if name == "onecycle":
        max_lr = cfg.max_lr or 10 * opt.param_groups[0]["lr"]
        return sched.OneCycleLR(opt, max_lr=max_lr, total_steps=total,
                                pct_start=cfg.pct_start), "step"
    if name == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=total, eta_min=cfg.eta_min), "step"
    if name == "cosine_restarts":
        return sched.CosineAnnealingWarmRestarts(opt, T_0=cfg.T_0 or steps_per_epoch,
                                                 T_mult=cfg.T_mult, eta_min=cfg.eta_min), "step"
    # warmup_cosine: linear warmup, then cosine decay over the remaining steps.
    warmup = min(cfg.warmup_steps, total - 1)
    if warmup == 0:
        return sched.CosineAnnealingLR(opt, T_max=total, eta_min=cfg.eta_min), "step"
    return sched.SequentialLR(opt, [
        sched.LinearLR(opt, start_factor=cfg.warmup_start_factor, total_iters=warmup),
        sched.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=cfg.eta_min),
    ], milestones=[warmup]), "step"


class Loss:
    """``loss(output, target)`` = the MEAN over the batch of a per-sample loss.

    Per-sample mean (not torch's weight-normalised mean for class weights) is what makes
    micro-batch losses add up exactly when weighted by their sample counts. Integer class targets
    are turned into one-hot vectors for the losses that compare distributions or values.
    """

    def __init__(self, cfg, num_classes: int | None = None):
        self.name = cfg.name
        self.label_smoothing = cfg.label_smoothing
        self.delta = cfg.huber_delta
        self.weights = torch.tensor(cfg.class_weights, dtype=torch.float32) \
            if cfg.class_weights else None
        if self.weights is not None and num_classes and len(self.weights) != num_classes:
            raise ConfigError(f"loss.class_weights has {len(self.weights)} entries but the data "
                              f"has {num_classes} classes; give one weight per class")

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.dtype in (torch.float16, torch.bfloat16):
            output = output.float()  # losses in fp32 even under autocast
        weights = None if self.weights is None else self.weights.to(output.device)
        if self.name == "cross_entropy":
            if weights is None:  # torch's mean is the per-sample mean: one kernel, not three
                return nn.functional.cross_entropy(output, target,
                                                   label_smoothing=self.label_smoothing)
            per = nn.functional.cross_entropy(output, target, weight=weights, reduction="none",
                                              label_smoothing=self.label_smoothing)
            return per.mean()
        if not target.is_floating_point():
            target = nn.functional.one_hot(target, output.shape[-1]).float()
        if self.name == "bce_logits":
            per = nn.functional.binary_cross_entropy_with_logits(output, target, reduction="none")
        elif self.name == "mse":
            per = nn.functional.mse_loss(output, target, reduction="none")
        elif self.name == "huber":
            per = nn.functional.huber_loss(output, target, reduction="none", delta=self.delta)
        else:  # kl_div: the model gives logits, the target is a distribution
            per = nn.functional.kl_div(output.log_softmax(-1), target, reduction="none")
        if weights is not None and per.shape[-1] == len(weights):
            per = per * weights
        per = per.reshape(len(per), -1)
        # KL is a sum over the distribution; the others average over the output elements.
        return (per.sum(-1) if self.name == "kl_div" else per.mean(-1)).mean()
