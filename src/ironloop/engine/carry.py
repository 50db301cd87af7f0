"""State a step carries from one batch to the next: an RNN's hidden state, a memory.

A step that takes a third parameter named ``state`` is stateful::

    def step(model, batch, state):
        x, y = batch
        logits, hidden = model(x, state.get("hidden"))  # None on the first batch
        state["hidden"] = hidden                        # stored detached: truncated BPTT
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), {}

The loop hands it a ``Carry``: a dict of tensors (or tuples, lists and dicts of them) that
ironloop keeps for you:

- **detached**: a value is stored detached, so the gradient stops at the batch boundary;
- **reset** at each epoch's start (``train.carry_reset=epoch``; ``never`` keeps it across
  epochs), never in the middle of an epoch, a resumed one included;
- **checkpointed**: the training carry is in every checkpoint (key ``carry``), so a resume
  mid-epoch continues with the state the killed process had;
- **separate for evaluation**: an evaluation gets its own carry, empty at its start, and the
  training carry is untouched by it (the model's mode picks which: eval mode, eval carry).

Under DDP each rank carries its own state but rank 0 writes the ``.pt`` checkpoint: a resume
restores rank 0's carry on every rank. Exact resume with carried state holds on one process
and under FSDP (each rank's carry is in its ``extras-rank{r}.pt``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _moved(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


class Carry:
    """A step's state across batches: ``state.get(name)``, ``state[name] = value``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._values: dict[str, Any] = {}

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._values[name] = _detached(value)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def clear(self) -> None:
        self._values.clear()

    def state_dict(self) -> dict:
        # On the host, so that a checkpoint loads anywhere (a copy: the step goes on using its own).
        return {k: _moved(v, "cpu") for k, v in self._values.items()}

    def load_state_dict(self, state: dict) -> None:
        self._values = {k: _moved(v, self.device) for k, v in (state or {}).items()}


def takes_state(step_fn) -> bool:
    """Whether ``step_fn`` has a ``state`` parameter (the third one, or a keyword)."""
    try:
        params = inspect.signature(step_fn).parameters
    except (TypeError, ValueError):
        return False
    return "state" in params


class StatefulStep:
    """A stateful step as the loop calls every step, ``step(model, batch)``: it hands the step
    the training carry when the model is in train mode and the evaluation carry in eval mode."""

    def __init__(self, step_fn, device: torch.device | str = "cpu", reset: str = "epoch"):
        self.fn, self.reset = step_fn, reset
        self.train, self.eval = Carry(device), Carry(device)

    def __call__(self, model, batch):
        return self.fn(model, batch, state=self.train if model.training else self.eval)

    def start_epoch(self, offset: int) -> None:
        """At the top of an epoch: a fresh carry, unless the epoch is resumed mid-way."""
        if offset == 0 and self.reset == "epoch":
            self.train.clear()

    def start_evaluation(self) -> None:
        self.eval.clear()

    def state_dict(self) -> dict:
        return {"train": self.train.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        self.train.load_state_dict((state or {}).get("train") or {})


def stateful(step_fn, device, reset: str = "epoch"):
    """``step_fn`` as the loop calls it, and its StatefulStep (None for a plain step)."""
    if not takes_state(step_fn):
        return step_fn, None
    wrapped = StatefulStep(step_fn, device, reset)
    return wrapped, wrapped
