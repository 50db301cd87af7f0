"""Several optimizers, updated in turn by the step (a GAN's generator and discriminator, an
actor and a critic): the step takes a third parameter named ``optimizers`` and updates each
one itself, in the order it needs::

    def step(model, batch, optimizers):
        real = batch[0]
        fake = model.generator(torch.randn(len(real), 16, device=real.device))
        d_loss = bce(model.discriminator(real), 1) + bce(model.discriminator(fake.detach()), 0)
        optimizers.update("discriminator", d_loss)    # D's parameters only
        g_loss = bce(model.discriminator(fake), 1)    # D as it is after its update
        optimizers.update("generator", g_loss)
        return g_loss, {"d_loss": d_loss.detach()}

``optimizers.update(name, loss)`` is one optimizer's step on its own parameters, in the loop's
order: their gradients set to None (what another loss left there is dropped), ``loss.backward()``,
their pre-clip norm, the guard's verdict on that loss and norm, the clip (``clip.*``) of those
gradients alone, ``optimizer.step()``. A bad update (a non-finite loss or norm) is skipped,
that optimizer's alone; the guard never rolls back. In evaluation (no gradients) it does nothing,
so the same step reports the validation losses.

The optimizers come from ``fit(optimizer={name: optimizer or factory(params)})``, a factory
called with the parameters of the model's submodule ``name``, or from a config,
``optim.name='module:factory'`` with ``factory(model) -> {name: optimizer}``. They are one
entry of the checkpoint (``Optimizers.state_dict``), each by its name, and what a run with one
optimizer has that cannot apply to several is refused before training (``refuse``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ironloop.engine.gradients import clip_to_norm, grad_norm_of
from ironloop.errors import ConfigError, UserError
from ironloop.guard.verdict import finite, masked_step, takes_found_inf
from ironloop.specs import import_spec

#: The parameter name that makes a step a several-optimizer step.
PARAMETER = "optimizers"


def takes_optimizers(step_fn) -> bool:
    """Whether ``step_fn`` has a parameter named ``optimizers``."""
    try:
        return PARAMETER in inspect.signature(step_fn).parameters
    except (TypeError, ValueError):
        return False


def wanted(given, optim_name: str) -> bool:
    """Whether the run has several optimizers: fit()'s ``optimizer=`` is a mapping, or none is
    given and ``optim.name`` is a 'module:factory'."""
    return isinstance(given, Mapping) or (given is None and ":" in optim_name)


class Optimizers(torch.optim.Optimizer):
    """The run's optimizers by name, as the step's ``optimizers`` argument and as the run's one
    optimizer: ``optimizers["generator"]`` is the torch optimizer, ``update(name, loss)`` its
    step. Its ``param_groups`` are every optimizer's own group objects, in order, so whatever
    reads or zeroes them (the logged LR, ``zero_grad``) sees all of them; its ``state_dict`` is
    ``{name: that optimizer's state_dict}`` and the guard's counts of skipped updates."""

    def __init__(self, named: dict[str, torch.optim.Optimizer], clip, guarded: bool):
        params = [p for opt in named.values() for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})  # the base's hooks and bookkeeping; the groups are below
        self.param_groups = [g for opt in named.values() for g in opt.param_groups]
        self.named, self.clip, self.guarded = named, clip, guarded
        self.own = {name: [p for g in opt.param_groups for p in g["params"]]
                    for name, opt in named.items()}
        # this step's pre-clip norms, clip flags and skipped updates, on the device
        self._norms: list[torch.Tensor] = []
        self._clipped: list[torch.Tensor] = []
        self._skipped: list[torch.Tensor] = []
        # the run's StepTimer.mark (engine/build.py): each update charges the forward that made
        # its loss, its backward and its step, as the loop does for one optimizer
        self.mark: Callable[[str], None] = lambda part: None

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.named[self._known(name)]

    def __iter__(self):
        return iter(self.named)

    def __len__(self) -> int:
        return len(self.named)

    def items(self):
        """(name, torch optimizer) pairs, in the order they were given."""
        return self.named.items()

    def _known(self, name: str) -> str:
        if name not in self.named:
            raise UserError(f"optimizers.update({name!r}, ...): no optimizer is named {name!r}; "
                            f"the run's are {', '.join(map(repr, self.named))}")
        return name

    def update(self, name: str, loss: torch.Tensor) -> None:
        """One optimizer's step on its own parameters (see the module's docstring)."""
        if not torch.is_grad_enabled():
            return  # evaluation (inference_mode): nothing to update
        opt, params = self.named[self._known(name)], self.own[name]
        self.mark("forward")  # since the last mark: the step's forward that made this loss
        for p in params:
            p.grad = None  # a gradient another loss left on these parameters is not this one's
        loss.backward()
        self.mark("backward")
        grads = [p for p in params if p.grad is not None]
        norm = grad_norm_of(grads)
        self._norms.append(norm.detach())
        ok = finite(loss.detach() + norm) if self.guarded else None
        # The guard looks before the clip, and a bad update is not clipped (as with one
        # optimizer: a clip by a non-finite norm would make every gradient non-finite).
        clip_norm = norm if ok is None else torch.where(ok, norm, 0.0)
        self._clipped.append(clip_to_norm(grads, clip_norm, self.clip.max_norm, self.clip.mode))
        if ok is None:
            opt.step()
        elif takes_found_inf(opt):  # skipped inside the fused kernel: no host read
            bad = (~ok).float()
            masked_step(opt, None, ok, bad)
            self._skipped.append(bad)
        elif bool(ok):  # host sync per update: this optimizer takes no found_inf (not fused)
            opt.step()
        else:
            self._skipped.append(torch.ones((), device=norm.device))
        self.mark("optimizer")

    def end_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the step: the global pre-clip norm over every update's gradients, whether any
        clip acted, and how many updates the guard skipped (device tensors, no host read)."""
        norms = self._norms or [torch.zeros(())]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        clipped = torch.stack([c.to(norm.device) for c in self._clipped]).any() \
            if self._clipped else torch.zeros((), dtype=torch.bool, device=norm.device)
        skipped = torch.stack(self._skipped).sum() if self._skipped else norm.new_zeros(())
        self._norms, self._clipped, self._skipped = [], [], []
        return norm, clipped, skipped

    def step(self, closure=None):
        raise UserError("with several optimizers the step updates each one itself: call "
                        "optimizers.update(name, loss) inside step_fn(model, batch, optimizers)")

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.named.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.named):
            raise ValueError(f"the checkpoint holds the optimizers {', '.join(map(repr, state))}"
                             f", this run {', '.join(map(repr, self.named))}")
        for name, opt in self.named.items():
            opt.load_state_dict(state[name])


def resolve(given, model: nn.Module, cfg, clip, guarded: bool) -> Optimizers:
    """The run's Optimizers from fit()'s ``{name: optimizer or factory(params)}`` (a factory
    gets the parameters of ``model``'s submodule ``name``), or from ``optim.name``'s
    'module:factory', ``factory(model) -> {name: optimizer}``. Each must hold only the model's
    parameters, and no parameter may be in two."""
    if given is None:
        factory = import_spec(cfg.name, "optim.name")
        given = factory(model)
        if not isinstance(given, Mapping) or not given:
            raise ConfigError(f"optim.name={cfg.name!r} returned {type(given).__name__}; a "
                              f"'module:factory' returns {{name: torch.optim.Optimizer}}, one "
                              f"per part the step updates (for one optimizer name a torch.optim "
                              f"class: optim.name=adamw)")
    if not given:
        raise UserError("optimizer={}: name at least one optimizer, {name: optimizer}")
    named = {str(name): _built(name, value, model) for name, value in given.items()}
    _check_params(named, model)
    return Optimizers(named, clip, guarded)


def _built(name, value, model: nn.Module) -> torch.optim.Optimizer:
    if isinstance(value, torch.optim.Optimizer):
        return value
    if not callable(value):
        raise UserError(f"optimizer={{{name!r}: {type(value).__name__}}}: each value must be a "
                        f"torch.optim.Optimizer, or a factory(params) called with the "
                        f"parameters of the model's submodule {name!r}")
    try:
        part = model.get_submodule(str(name))
    except AttributeError:
        parts = ", ".join(n for n, _ in model.named_children()) or "none"
        raise UserError(f"optimizer={{{name!r}: factory}}: the model has no submodule {name!r} "
                        f"whose parameters the factory would get (its children: {parts}); name "
                        f"the key after one, or pass an optimizer built on the parameters"
                        ) from None
    opt = value(part.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise UserError(f"optimizer={{{name!r}: factory}} returned {type(opt).__name__}, not a "
                        f"torch.optim.Optimizer")
    return opt


def _check_params(named: dict[str, torch.optim.Optimizer], model: nn.Module) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, str] = {}
    for name, opt in named.items():
        for p in (p for g in opt.param_groups for p in g["params"]):
            if id(p) not in names:
                raise UserError(f"optimizer {name!r} holds a parameter that is not the model's; "
                                f"build it from the parameters of the model passed to fit()")
            if id(p) in owner:
                raise UserError(f"parameter {names[id(p)]!r} is in both optimizer "
                                f"{owner[id(p)]!r} and {name!r}; give each parameter to one")
            owner[id(p)] = name


def bound(step_fn, optimizers: Optimizers, given: bool, spec: str) -> Callable:
    """``step_fn(model, batch, optimizers)`` as the loop calls a step, ``step(model, batch)``;
    a step that cannot update them is refused."""
    if step_fn is None:
        raise UserError("several optimizers need a step that updates each one: pass "
                        "step_fn(model, batch, optimizers) (train.step_fn=module:function) "
                        "calling optimizers.update(name, loss)")
    if not takes_optimizers(step_fn):
        raise UserError(f"step_fn {getattr(step_fn, '__name__', step_fn)!r} takes no "
                        f"'{PARAMETER}' parameter, and the run has several optimizers "
                        f"({'optimizer={...}' if given else f'optim.name={spec}'}); write it "
                        f"as step_fn(model, batch, optimizers) and call "
                        f"optimizers.update(name, loss) for each")

    def step(model, batch):
        return step_fn(model, batch, optimizers)

    step.__name__ = getattr(step_fn, "__name__", "step")
    return step


def refuse(cfg, world_size: int, scheduler_given: bool) -> None:
    """What a run with one optimizer has that several cannot, refused before training in one
    line each."""
    t, g, defaults = cfg.train, cfg.guard, type(cfg.guard)()
    why = ("train.accumulation_steps > 1: each update steps on the batch the step gets; set "
           "train.accumulation_steps=1" if t.accumulation_steps > 1 else
           "train.cuda_graph: the graph captures one optimizer's step; set "
           "train.cuda_graph=false" if t.cuda_graph else
           f"average.kind={cfg.average.kind}: the average follows one optimizer's steps; set "
           f"average.kind=none" if cfg.average.kind != "none" else
           "train.precision=fp16: GradScaler scales one loss per step; use bf16 or fp32"
           if t.precision == "fp16" else
           f"{world_size} processes: each update would need its own gradient all-reduce; "
           f"train in one process" if world_size > 1 else
           "a scheduler=: each optimizer needs its own; step its LR inside the step "
           "(optimizers[name].param_groups)" if scheduler_given else
           f"schedule.name={cfg.schedule.name}: the schedule drives one optimizer; set "
           f"schedule.name=constant" if cfg.schedule.name != "constant" else None)
    for key in ("max_bad_steps", "max_rollbacks", "lr_backoff", "rollback_to", "spike_factor"):
        if why is None and getattr(g, key) != getattr(defaults, key):
            why = (f"guard.{key}={getattr(g, key)}: the guard skips a bad update of one "
                   f"optimizer and never rolls back or judges spikes; leave guard.{key} at its "
                   f"default ({getattr(defaults, key)})")
    if why is not None:
        raise ConfigError(f"several optimizers cannot run with {why}")
