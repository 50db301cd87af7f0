"""The train module: the training math of one optimizer step, apart from the loop that
orchestrates it (OLMo-core's ``TrainModule``). It owns the model and its wrapper, the optimizer,
the schedule and its cadence, the scaler, the step function, the parameter list and a stateful
step's carry, and it holds the guard's device verdict, so there is one stepping branch.

The optimizer step, in order::

    scaler.unscale_(optimizer)                # fp16 only; unscale BEFORE clipping
    grad_norm = norm(gradients)               # the pre-clip norm is what gets logged
    ok = guard verdict, on the device         # guard/verdict.py: no host read
    clip(parameters, grad_norm)
    optimizer.step(); scaler.update()         # a bad step is skipped inside the fused kernel
    scheduler.step()                          # per-step schedules, AFTER optimizer.step
    average.update()                          # when due (average.*): the loop calls it

With several optimizers (``several_step``) the step function runs that order once per
optimizer, on each one's own parameters, inside its call (engine/several.py).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ironloop.config import ClipConfig
from ironloop.engine.average import WeightAverage
from ironloop.engine.carry import StatefulStep
from ironloop.engine.gradients import clip_to_norm, grad_norm_of
from ironloop.engine.metrics import SplitMetrics
from ironloop.engine.precision import autocast
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.several import Optimizers
from ironloop.engine.step_fns import StepFn, describe, unpack
from ironloop.errors import ConfigError, UserError
from ironloop.guard.reporter import lr_scaled
from ironloop.guard.verdict import DeviceVerdicts, forget_unscale, masked_step
from ironloop.parallel.world import World

Scheduler = torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau


def takes_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (torch.optim.LBFGS)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no readable signature: called without one, as before
        return False
    return param is not None and param.default is inspect.Parameter.empty


def check_model(model: nn.Module) -> None:
    """Refuse, before anything runs, a model that cannot train: one on the meta device (no
    values to compute with), or one with no parameter that requires a gradient (none at all,
    only buffers, or all frozen), where the first backward would fail deep in autograd."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        raise UserError("the model is on the meta device (its tensors have shapes, no values); "
                        "materialize it first: model.to_empty(device='cpu'), then initialize "
                        "it (or load_state_dict(state, assign=True))")
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return
    buffers = [name for name, _ in model.named_buffers()]
    what = f"all {len(params)} of its parameter tensors are frozen (requires_grad=False)" \
        if params else "it has no parameters" + (f", only buffers ({', '.join(buffers[:3])})"
                                                   if buffers else "")
    raise UserError(f"the model has nothing to train: {what}; unfreeze what should learn "
                    f"(p.requires_grad_(True)), or hold its weights in nn.Parameter (a buffer "
                    f"or a plain tensor attribute is not trained)")


def check_closure(optimizer: torch.optim.Optimizer, accumulation: int, precision: str,
                  world: World, stateful: bool) -> None:
    """A closure optimizer evaluates its closure several times per step, on one batch: refuse,
    at build time, what that cannot honour."""
    if not takes_closure(optimizer):
        return
    name = type(optimizer).__name__
    why = ("train.accumulation_steps > 1: its closure recomputes one batch, not a window; set "
           "train.accumulation_steps=1" if accumulation > 1 else
           "train.precision=fp16: GradScaler does not support closures; use bf16 or fp32"
           if precision == "fp16" else
           "several processes: each rank's closure count follows its own loss, and DDP would "
           "wait; train it in one process" if world.size > 1 else
           "a stateful step: each closure call would move its state again; carry the state "
           "in the model, or use another optimizer" if stateful else None)
    if why is not None:
        raise ConfigError(f"optimizer {name} takes a closure (step(closure)), which ironloop "
                          f"cannot run with {why}")


@dataclass
class TrainModule:
    model: nn.Module                 # what the loop calls: the DDP/FSDP/compile wrapper
    raw_model: nn.Module             # the user's module: evaluation, checkpoints, export
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler | None
    schedule_on: str                 # "step" (after every optimizer step) or "eval" (plateau)
    scaler: torch.amp.GradScaler | None
    step_fn: StepFn                  # as the loop calls it: (model, batch) -> (loss, metrics)
    carry: StatefulStep | None       # a stateful step's state across batches, or None
    device: torch.device
    precision: str
    clip: ClipConfig
    total_steps: int
    schedule_steps: int = 0          # a finite schedule's length; past it the LR holds (0: none)
    verdicts: DeviceVerdicts | None = None  # the guard's device verdicts (guard.enabled)
    check_labels: Callable[[Any], None] | None = None  # a host-side label check, or None
    lr: float = 0.0                  # the LR the last optimizer step used
    frozen: bool = False             # optim.lr=0: every step at LR 0, whatever a resumed schedule
    average: WeightAverage | None = None  # the averaged weights (average.kind), or None
    metrics: SplitMetrics | None = None   # whole-split metrics for evaluation (eval.metrics)
    graph: Any = None                # train.cuda_graph: the StepGraph (engine/cuda_graph.py)
    several: Optimizers | None = None  # several optimizers the step updates (the optimizer too)
    # After parallel.wrap: FSDP2 has replaced them with their sharded DTensors by then. All of
    # them, not only those requiring grad: a callback may unfreeze a layer later.
    params: list[nn.Parameter] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.params = list(self.raw_model.parameters())
        self.takes_closure = takes_closure(self.optimizer)  # LBFGS: step(closure)

    def closure(self, batch, loss: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """A closure optimizer's closure for this step (None for any other optimizer). Its
        first call returns the loss whose gradients the loop has just made, checked by the
        guard and clipped; each later call (LBFGS evaluates several per step) zeroes the
        gradients and recomputes loss and gradients on the same batch, clipped the same way:
        torch's closure (zero_grad, forward, backward), with the clip after the backward."""
        if not self.takes_closure:
            return None
        first = [loss.detach()]

        def closure() -> torch.Tensor:
            if first:
                return first.pop()
            self.optimizer.zero_grad(set_to_none=True)
            with self.autocast():
                again = unpack(self.step_fn(self.model, batch))[0]
            again.backward()
            params = [p for p in self.params if p.grad is not None]
            clip_to_norm(params, grad_norm_of(params), self.clip.max_norm, self.clip.mode)
            return again.detach()

        return closure

    def zero_grad(self) -> None:
        """At a window's start. A captured graph owns the gradients: its replay overwrites
        them, and set to None here they would be lost to the host (cuda_graph.py)."""
        if self.graph is None or not self.graph.captured:
            self.optimizer.zero_grad(set_to_none=True)

    def autocast(self):
        return autocast(self.precision, self.device)

    def forward(self, model: nn.Module, batch, where: str, progress: Progress):
        """The step function's (loss, metrics, weight or None); an exception from it (the
        user's code, usually) keeps its traceback and gains one line saying where in the run
        it happened and on what batch."""
        try:
            return unpack(self.step_fn(model, batch))
        except Exception as e:
            step = progress.step + 1 if where == "training" else progress.step
            if hasattr(e, "add_note"):  # Python 3.11+; on 3.10 the error goes as it came
                e.add_note(f"ironloop: raised in {where} at step {step}, epoch "
                           f"{progress.epoch + 1}; batch: {describe(batch)}")
            raise

    def backward(self, scaled: torch.Tensor) -> None:
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def optimizer_step(self, progress: Progress, meter: Meter, world: World,
                       closure: Callable[[], torch.Tensor] | None = None) -> None:
        """unscale -> norm -> guard verdict -> clip -> step -> scaler update -> per-step
        scheduler. The step is counted as good; the guard's verdict stays on the device, a bad
        step changes nothing there, and the settle takes it back from the counters later.
        ``closure``: a closure optimizer's (``closure``), passed to its ``step``."""
        opt, scaler, guard = self.optimizer, self.scaler, self.verdicts
        skipped = None
        if scaler is not None:
            scaler.unscale_(opt)  # clipping must see the true gradients, not the scaled ones
            # Read before step(): found_inf is on the device, so counting skips costs no sync.
            found = scaler._found_inf_per_device(opt)  # private, stable since torch 1.x
            skipped = torch.stack([f.to(self.device) for f in found.values()]).sum().clamp(max=1)
        params = [p for p in self.params if p.grad is not None]  # no module walk per step
        grad_norm = grad_norm_of(params)
        # The guard looks before clipping: a NaN norm would make the clip turn every gradient
        # NaN.
        ok = None if guard is None else guard.check(meter, grad_norm, progress.offset, skipped,
                                                    world)
        clip_norm = grad_norm  # the pre-clip norm is still what gets logged, a bad step's too
        if ok is not None and self.clip.mode == "norm" and self.clip.max_norm > 0:
            # A bad step is not clipped: its guard.jsonl line names the parameters whose
            # gradients are non-finite, which a clip by a non-finite norm would make all of them.
            clip_norm = torch.where(ok, grad_norm, 0.0)
        clipped = clip_to_norm(params, clip_norm, self.clip.max_norm, self.clip.mode)
        with lr_scaled(opt, self.lr_factor):  # the rollbacks' LR factor, on top of the schedule
            if guard is not None and ok is not None and guard.masks:
                masked_step(opt, scaler, ok, guard.judge.found_inf(ok))  # skips on device
            elif guard is not None and ok is not None and not guard.allows(ok):
                forget_unscale(opt, scaler)  # a bad step read on the host: no update
            elif scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif closure is not None:
                opt.step(closure)  # type: ignore[arg-type]  # LBFGS's closure returns a tensor
            else:
                opt.step()
            self.lr = float(opt.param_groups[0]["lr"])  # the LR this step used, for the logs
        self.step_schedule(progress.step)  # after optimizer.step, once per optimizer step
        progress.step += 1
        meter.add_step(grad_norm, clipped, skipped, ok)

    def several_step(self, batch, n_micro: int, progress: Progress, meter: Meter) -> None:
        """Several optimizers (engine/several.py): the step updates each one itself, inside its
        call (backward, norm, guard, clip and step per optimizer, on its own parameters); what
        is left is the step's count, its logged loss and the norms, as one optimizer step's."""
        several = self.several
        assert several is not None  # the loop calls this only with several optimizers
        with self.autocast():
            loss, _, _ = self.forward(self.model, batch, "training", progress)
        meter.add_micro(loss, n_micro)
        grad_norm, clipped, skipped = several.end_step()
        self.lr = float(several.param_groups[0]["lr"])  # the first optimizer's, for the logs
        progress.step += 1
        meter.add_step(grad_norm, clipped, skipped)

    @property
    def lr_factor(self) -> float:
        """The guard's LR factor after rollbacks (1 without a guard); 0 with optim.lr=0, so a
        resume that sets it freezes the weights although the optimizer and schedule state come
        back from the checkpoint with their own LR."""
        if self.frozen:
            return 0.0
        return 1.0 if self.verdicts is None else self.verdicts.policy.lr_factor

    def step_schedule(self, step: int) -> None:
        """The per-step scheduler step, after ``optimizer.step``. A run longer than its finite
        schedule (extended on resume) holds the LR of the schedule's last step: past their end,
        onecycle extrapolates and cosine climbs back up."""
        if self.scheduler is None or self.schedule_on != "step":
            return
        if not self.schedule_steps or self.total_steps <= self.schedule_steps or \
                step < self.schedule_steps - 1:
            self.scheduler.step()

    def resume_schedule(self, steps: int | None) -> None:
        """A resumed finite schedule keeps the length it was built with (``steps``, from the
        checkpoint; absent in older ones): an extended run holds its last LR (see drift.py)."""
        if self.schedule_steps:
            self.schedule_steps = steps or self.schedule_steps
            self.hold_onecycle()

    def hold_onecycle(self) -> None:
        """A finished onecycle has stepped once past its end, to an extrapolated LR; a run
        extended beyond it gets the LR of the schedule's last step back (OneCycleLR's LR is
        closed-form)."""
        sched, end = self.scheduler, self.schedule_steps
        if not isinstance(sched, torch.optim.lr_scheduler.OneCycleLR) or \
                self.total_steps <= end or sched.last_epoch < end:
            return
        sched.last_epoch = end - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "get_lr outside step": that is what is wanted
            lrs = sched.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
