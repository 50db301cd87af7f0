"""How the module the loop trains is wrapped: activation checkpointing and torch.compile.

Neither changes the user's module's ``state_dict``: activation checkpointing replaces the
``forward`` of each named block *instance* (no wrapper module, no renamed keys), and
``torch.compile`` wraps the module the loop calls while checkpoints, evaluation and export use
the user's own module. So checkpoints load across compiled and uncompiled runs, with or without
activation checkpointing.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ironloop.errors import ConfigError


def checkpoint_activations(model: nn.Module, class_names: list[str]) -> int:
    """Recompute the forward of every block whose class is named, during backward, instead of
    keeping its activations: memory for compute. Returns how many blocks were wrapped."""
    wanted = set(class_names)
    found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    missing = wanted - {type(m).__name__ for m in found}
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"train.activation_checkpointing={sorted(wanted)}: the model has no "
                          f"{', '.join(sorted(missing))} module; its classes are "
                          f"{', '.join(present)}")
    for block in found:
        # use_reentrant=False: torch's recommended variant; it works with inputs that do not
        # require grad and with torch.compile. The instance attribute shadows the class method.
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(found)


def compile_model(model: nn.Module, mode: str) -> nn.Module:
    """torch.compile for the training forward and backward; the first steps pay the compile."""
    # torch.compile returns an OptimizedModule (an nn.Module) for a module; typed as a callable.
    return cast(nn.Module, torch.compile(model, mode=None if mode == "default" else mode))
