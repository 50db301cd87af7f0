"""What the checks examine: the model, the data, the loss and the config, and helpers to get a
batch or a throwaway copy of the model and its optimizer. Checks never touch the real model."""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ironloop.config import Config
from ironloop.data.loader import EpochSampler, TensorData, make_loader, to_device
from ironloop.data.source import eval_loader
from ironloop.engine.carry import Carry, takes_state
from ironloop.engine.optim import build_optimizer
from ironloop.engine.step_fns import unpack


@dataclass
class DoctorSubject:
    model: nn.Module
    cfg: Config
    train: Any
    val: Any = None
    test: Any = None
    num_classes: int | None = None
    loss_fn: Any = None          # loss(output, target), a batch mean
    device: torch.device = torch.device("cpu")
    collate_fn: Any = None
    step_fn: Any = None          # the run's step: every check computes its loss through it
    user_step: bool = False      # the user's step_fn (or the built-in LM step), not the default
    val_batching: Any = None     # how evaluation batches val (data/source.py's EvalBatching)
    _kept: Any = field(default=None, repr=False)  # borrowed(): (state, training, device)

    def loader(self, batch_size: int | None = None, num_workers: int = 0):
        """The training data in the run's own order (epoch 0), in the main process."""
        sampler = EpochSampler(len(self.train), batch_size or self.cfg.train.batch_size,
                               self.cfg.run.seed, shuffle=self.cfg.data.shuffle)
        return make_loader(self.train, sampler, num_workers=num_workers, pin_memory=False,
                           collate_fn=self.collate_fn)

    def batch(self, size: int | None = None):
        """The first training batch of the run, on the device."""
        return to_device(next(iter(self.loader(size))), self.device, False)

    def val_batch(self):
        """The first validation batch as evaluation reads it (its DataLoader's batching), on
        the device; None without validation data."""
        if self.val is None or not len(self.val) or self.val_batching is None:
            return None
        loader = eval_loader(self.val, self.val_batching, self.cfg, 0, 1, self.device)
        return to_device(next(iter(loader)), self.device, False)

    def copy(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model in train mode, as it was handed over, and a fresh optimizer built from the
        config: what the real run starts with. Not a deep copy: a copy would share whatever the
        forward reaches outside the module tree (minGPT's ``self.mlpf = lambda x:
        m.c_proj(m.act(m.c_fc(x)))`` calls the original's layers), so its checks would see
        dead parameters that train normally. Inside ``borrowed()`` (``check``, the LR sweep),
        which puts the weights, mode, gradients and device back after the checks; a check
        called on its own, outside it, gets a deep copy."""
        if self._kept is None:
            model = copy.deepcopy(self.model).to(self.device).train()
        else:
            self._put_back(self._kept)  # every check starts from the handed-over weights
            model = self.model.to(self.device).train()
        return model, build_optimizer(model, self.cfg.optim)

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[None]:
        """Checks may train the model (``copy()``): its state as handed over comes back after
        them, also when one raises."""
        if self._kept is not None:  # nested: the outer one puts it back
            yield
            return
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        self._kept = ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                      self.model.training, first.device if first is not None else None)
        try:
            yield
        finally:
            kept, self._kept = self._kept, None
            self._put_back(kept)
            if kept[2] is not None:
                self.model.to(kept[2])

    def _put_back(self, kept: tuple) -> None:
        with torch.no_grad():
            self.model.load_state_dict(kept[0])
        self.model.train(kept[1])
        for p in self.model.parameters():
            p.grad = None

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) of ``model`` on ``batch``, through the run's step: the checks see the
        model as training does, whatever its forward takes. A stateful step gets a fresh state
        on every call (a check's batches do not follow one another)."""
        if takes_state(self.step_fn):
            out = self.step_fn(model, batch, state=Carry(self.device))
        else:
            out = self.step_fn(model, batch)
        loss, metrics, _ = unpack(out)
        return loss, metrics

    @property
    def classification(self) -> bool:
        return bool(self.num_classes) and self.cfg.loss.name in (
            "cross_entropy", "bce_logits", "kl_div")


def labels_of(dataset, cap: int | None = None) -> torch.Tensor | None:
    """The integer labels of a dataset (the first ``cap`` samples when it is not in memory)."""
    if dataset is None:
        return None
    if isinstance(dataset, TensorData):
        y = dataset.y
    else:
        n = len(dataset) if cap is None else min(cap, len(dataset))
        ys = [dataset[i][1] for i in range(n)]
        y = torch.as_tensor(ys) if ys and not isinstance(ys[0], torch.Tensor) else \
            torch.stack(ys) if ys else torch.zeros(0, dtype=torch.long)
    if y.is_floating_point() or y.ndim != 1:
        return None
    return y


def head(batch, n: int):
    """The first ``n`` samples of a (nested) batch: every tensor sliced along dim 0."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, dict):
        return {k: head(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(head(v, n) for v in batch)
    return batch


def repeated(batch, size: int):
    """A (nested) batch grown to ``size`` samples by repeating its own."""
    if isinstance(batch, torch.Tensor):
        reps = -(-size // len(batch))
        return batch.repeat(reps, *[1] * (batch.ndim - 1))[:size]
    if isinstance(batch, dict):
        return {k: repeated(v, size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(repeated(v, size) for v in batch)
    return batch
