"""Data parallelism: wrap the user's model for DDP or FSDP2, and the few places the loop differs.

The process group itself is set up in ``world.py``; this module only decides how the model
is replicated or sharded over it. Both strategies average gradients over ranks (DDP's all-reduce,
FSDP2's reduce-scatter), so the loop's ``loss * n_micro * world / window`` weighting gives the
global batch's mean gradient under either, and 2x32 equals 1x64 to fp32 rounding.

* ``ddp``: every rank holds the whole model; gradients are all-reduced in the last backward of
  each accumulation window (``no_sync`` before that).
* ``fsdp``: ``fully_shard`` on each block, then on the root. Parameters, gradients and optimizer
  state are sharded (DTensors); each block is all-gathered for its forward and backward. Inside
  an accumulation window gradients are neither reduce-scattered nor the parameters resharded
  after backward, so the next micro-batch needs no new all-gather (more memory, less traffic).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ironloop.config import Config
from ironloop.errors import ConfigError
from ironloop.parallel.world import World


def resolve_strategy(cfg: Config, world: World) -> str:
    """``none`` on one process whatever was asked; ``auto`` is ``ddp`` on several."""
    strategy = cfg.dist.strategy
    if not world.distributed:
        return "none"
    if strategy == "none":
        raise ConfigError(f"dist.strategy='none' on {world.size} processes would train "
                          f"{world.size} copies that never sync; use ddp or fsdp, or launch one "
                          f"process")
    return "ddp" if strategy == "auto" else strategy


def wrap(model: nn.Module, cfg: Config, world: World, device: torch.device,
         precision: str) -> tuple[nn.Module, str]:
    """(the module the loop calls, the strategy used). FSDP2 shards ``model`` in place, so the
    returned module is ``model`` itself; DDP returns a wrapper around it."""
    strategy = resolve_strategy(cfg, world)
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids), strategy
    if strategy == "fsdp":
        return shard(model, cfg.dist.fsdp_modules, precision), strategy
    return model, strategy


def shard(model: nn.Module, names: list[str], precision: str) -> nn.Module:
    """``fully_shard`` each block (bottom-up, as FSDP2 requires), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    # Compute in the low dtype, but reduce gradients in fp32: a bf16 sum over ranks loses bits.
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    blocks = fsdp_blocks(model, names)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def fsdp_blocks(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The submodules to shard one by one: those whose class name is in ``names``, or, with no
    names, each child with parameters of every Sequential or ModuleList (the root included)."""
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not found:
            kinds = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"dist.fsdp_modules={names}: the model has no such submodule; "
                              f"its module classes are {', '.join(kinds)}")
        return found
    containers = (nn.Sequential, nn.ModuleList)
    return [child for m in model.modules() if isinstance(m, containers)
            for child in m.children() if any(True for _ in child.parameters())]


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


#: A context that does nothing, made once: a null context holds no state, so one serves every
#: micro-batch (the loop enters up to three per step; a small model's step feels each call).
NO_CONTEXT = contextlib.nullcontext()


def micro_sync(model: nn.Module, last: bool):
    """The context for one micro-batch's backward: gradients are synced over ranks only in the
    last micro-batch of an accumulation window."""
    model = getattr(model, "_orig_mod", model)  # under train.compile, the wrapped DDP/FSDP module
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return NO_CONTEXT if last else model.no_sync()
    if isinstance(model, FSDPModule):  # is_fsdp, spelled so that the type checker sees it
        # Both apply to every FSDP module below the root (recurse=True by default).
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
    return NO_CONTEXT


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) result as the whole tensor, e.g. the global grad norm; a collective."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model_state(model: nn.Module) -> dict:
    """The whole model's state dict on CPU: a collective under FSDP2 (every rank must call it;
    rank 0 gets the tensors), a plain ``state_dict()`` otherwise."""
    if not is_fsdp(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def extra_forwards(model: nn.Module, world: World, n: int, batch_size: int, done: int) -> int:
    """Forwards this rank still owes the others in an evaluation of ``n`` samples: under FSDP2
    every forward all-gathers, so a rank whose shard has fewer batches must run as many."""
    if not is_fsdp(model) or not world.distributed:
        return 0
    from ironloop.data.loader import EvalSampler

    most = max(len(EvalSampler(n, batch_size, 0, False, rank=r, world_size=world.size))
               for r in range(world.size))
    return most - done
