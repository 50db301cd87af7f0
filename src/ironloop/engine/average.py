"""Weight averaging (``average.*``): an EMA or SWA copy of the model, updated on the device after
optimizer steps, evaluated beside the raw weights (``val_avg_*``), held in every checkpoint and
written to ``final_avg.safetensors``.

torch.optim.swa_utils does the math: ``AveragedModel`` holds the copy and its count
(``n_averaged``), ``get_ema_multi_avg_fn`` / ``get_swa_multi_avg_fn`` update it, ``update_bn``
recomputes SWA's BatchNorm statistics. ``WeightAverage.update`` is
``AveragedModel.update_parameters`` step for step, except that the count is also kept on the host:
torch's reads ``n_averaged`` from the device twice per call, a sync per step on CUDA.

EMA's decay warms up (``average.warmup``, on by default): after t updates it is
``min(decay, (1 + t) / (10 + t))``, TensorFlow's ``ExponentialMovingAverage(num_updates=t)``
and timm's warm-up. Without it, a decay of 0.999 keeps 0.999^t of the random initial weights
in the average (13% after 2,000 updates), and the average is worse than the raw weights for
most of a short run. t is the update count, ``n_averaged`` in every checkpoint (older ones
included), so a resume continues the warm-up bit for bit.

EMA averages the buffers too (BatchNorm's running statistics, as Lightning's and timm's EMA do);
SWA keeps the raw model's buffers while training and recomputes BatchNorm statistics once, for
``final_avg.safetensors``, as torch documents. A step the guard skipped left the weights as they
were; the average still takes them in (it averages the weights after each optimizer step).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.swa_utils import (
    AveragedModel,
    get_ema_multi_avg_fn,
    get_swa_multi_avg_fn,
    update_bn,
)

from ironloop.config import AverageConfig
from ironloop.errors import CheckpointError, UserError
from ironloop.parallel import data_parallel


class WeightAverage:
    """The averaged copy of ``model`` and when it is updated (after optimizer step s when
    ``s >= start_step`` and ``s % every_steps == 0``)."""

    def __init__(self, cfg: AverageConfig, model: nn.Module):
        self.kind, self.start_step, self.every = cfg.kind, cfg.start_step, cfg.every_steps
        self.decay, self.warmup = cfg.decay, cfg.kind == "ema" and cfg.warmup
        fn = get_ema_multi_avg_fn(cfg.decay) if cfg.kind == "ema" else get_swa_multi_avg_fn()
        self.averaged = AveragedModel(model, multi_avg_fn=fn, use_buffers=cfg.kind == "ema")
        refuse_outside_reach(model, self.averaged.module, cfg.kind)
        self.averaged.requires_grad_(False)  # never trained: no grads, no optimizer sees it
        self.source = model
        self.count = 0  # updates so far, on the host; ``averaged.n_averaged`` on the device
        self._grouped: list[tuple[list, list]] | None = None

    @property
    def module(self) -> nn.Module:
        """The averaged copy of the user's module: what evaluation and export use."""
        return self.averaged.module

    def due(self, step: int) -> bool:
        return step >= self.start_step and step % self.every == 0

    def decay_after(self, t: int) -> float:
        """EMA's decay for the update that follows ``t`` updates: warmed up
        (``min(decay, (1 + t) / (10 + t))``) or ``average.decay`` as it is."""
        return min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(averaged, model) tensors: parameters, and for EMA the buffers too."""
        avg, model = self.averaged, self.source
        mine: Iterable[torch.Tensor] = avg.module.parameters()
        theirs: Iterable[torch.Tensor] = model.parameters()
        if avg.use_buffers:
            mine = itertools.chain(mine, avg.module.buffers())
            theirs = itertools.chain(theirs, model.buffers())
        return [(a.detach(), m.detach().to(a.device)) for a, m in zip(mine, theirs)]

    def _groups(self) -> list[tuple[list, list]]:
        """The pairs grouped by device and dtype, as torch groups them for the foreach
        kernels; built once (the tensors stay the same objects: loads copy into them)."""
        if self._grouped is None:
            groups: dict[tuple, tuple[list, list]] = {}
            for a, m in self._pairs():
                own, new = groups.setdefault((a.device, a.dtype), ([], []))
                own.append(a)
                new.append(m)
            self._grouped = list(groups.values())
        return self._grouped

    @torch.no_grad()
    def update(self) -> None:
        """``AveragedModel.update_parameters`` with the count read from the host: the first
        update copies the weights, later ones average them in (foreach kernels, on the
        device)."""
        avg = self.averaged
        if self.count == 0:
            for a, m in self._pairs():
                a.copy_(m)
        else:
            # torch's EMA update at this update's decay (a host float: the count is on the host)
            fn = get_ema_multi_avg_fn(self.decay_after(self.count)) if self.warmup \
                else avg.multi_avg_fn
            for own, new in self._groups():
                # a host int where torch passes the device count: the same weight, no read
                fn(own, new, self.count)  # type: ignore[misc]
        if not avg.use_buffers:  # SWA: the buffers follow the raw model's
            for b_avg, b_model in zip(avg.module.buffers(), self.source.buffers()):
                b_avg.detach().copy_(b_model.detach().to(b_avg.device))
        avg.n_averaged += 1  # on the device: kept for AveragedModel's own state_dict
        self.count += 1

    @torch.no_grad()
    def reset(self) -> None:
        """An empty average that shows the model's current weights until its first update
        (a checkpoint from before averaging was on)."""
        for a, m in self._pairs():
            a.copy_(m)
        for b_avg, b_model in zip(self.module.buffers(), self.source.buffers()):
            b_avg.copy_(b_model)
        self.averaged.n_averaged.zero_()
        self.count = 0

    def state_dict(self) -> dict:
        """AveragedModel's state_dict; under FSDP2 each rank's own shards (plain tensors, in
        its per-rank extras: state/dcp.py), which a resume on as many ranks puts back."""
        return {k: v.to_local() if data_parallel.is_sharded(v) else v
                for k, v in self.averaged.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's average, or a fresh one from the restored weights when it has none."""
        if state is None:
            self.reset()
            return
        own = self.averaged.state_dict()
        if any(data_parallel.is_sharded(v) for v in own.values()):
            for k, v in own.items():
                local = v.to_local() if data_parallel.is_sharded(v) else v
                if k not in state or state[k].shape != local.shape:
                    raise CheckpointError(f"the checkpoint's averaged weights ({k}) are "
                                          f"another rank count's shards; resume an FSDP run "
                                          f"with average.kind on as many ranks as wrote it")
                local.copy_(state[k])
        else:
            self.averaged.load_state_dict(state)
        self.count = int(state["n_averaged"])  # host read, once: the checkpoint's CPU tensor

    def final_weights(self, batches: Iterable | None,
                      device: torch.device) -> dict[str, torch.Tensor]:
        """The averaged weights for final_avg.safetensors (a collective under FSDP2). SWA:
        BatchNorm statistics recomputed with one pass over ``batches`` (torch's ``update_bn``:
        the model gets each batch's first element), when the model has BatchNorm and there are
        batches; not under FSDP2, where ranks with unequal shares would wait on each other."""
        sharded = data_parallel.is_fsdp(self.module)
        if self.kind == "swa" and batches is not None and not sharded:
            update_bn(batches, self.module, device)
        return data_parallel.full_model_state(self.module)

    def shard(self, names: list[str], precision: str) -> None:
        """FSDP2: shard the copy as the model is (the same blocks, so its parameters have the
        model's placements and the foreach update runs shard by shard), then start again."""
        data_parallel.shard(self.module, names, precision)
        self._grouped = None
        self.reset()


def build_average(cfg: AverageConfig, model: nn.Module) -> WeightAverage | None:
    """The run's average of the user's module before any wrapper, or None (average.kind=none).
    Under FSDP2 the caller shards it beside the model (``WeightAverage.shard``)."""
    if cfg.kind == "none":
        return None
    return WeightAverage(cfg, model)


def outside_reach(original: nn.Module, copied: nn.Module) -> tuple[str, str] | None:
    """(the copy's attribute, the original's module) where a deep copy of ``original`` still
    calls the original: a function attribute that closes over one of its modules (minGPT's
    ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))``) or a method bound to one. deepcopy
    copies neither a function nor what its closure holds, so the copy's forward would run the
    original's weights."""
    names = {id(m): name or "the model" for name, m in original.named_modules()}
    for where, module in copied.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, nn.Module):
                continue  # torch's own tables (_modules, _parameters, ...) and submodules
            owner = getattr(value, "__self__", None)  # a bound method
            cells = getattr(getattr(value, "__func__", value), "__closure__", None) or ()
            for held in [owner, *(_contents(c) for c in cells)]:
                if isinstance(held, nn.Module) and id(held) in names:
                    return f"{where}.{attr}" if where else attr, names[id(held)]
    return None


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def refuse_outside_reach(original: nn.Module, copied: nn.Module, kind: str) -> None:
    """Refuse, before training, averaged weights whose copy would call the original model."""
    found = outside_reach(original, copied)
    if found is not None:
        attr, module = found
        raise UserError(f"average.kind={kind} averages a deep copy of the model, but its "
                        f"attribute {attr} is a function that calls the original's {module}, "
                        f"so the copy would run the raw weights; make it a method (def "
                        f"{attr.rsplit('.', 1)[-1]}(self, x): ...) or an nn.Module, or set "
                        f"average.kind=none")
