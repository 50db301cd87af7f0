"""Out of memory during a run: what was in use, and the fixes in order of ease."""

from __future__ import annotations

import torch

from ironloop.engine.run import Run
from ironloop.errors import UserError, option


class OutOfMemory(UserError):
    """The run ran out of device memory; the message says what to change."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def out_of_memory(run: Run, error: BaseException) -> OutOfMemory:
    """The user-facing error for a ``torch.OutOfMemoryError`` raised during ``run``."""
    cfg, device, precision, p = run.cfg, run.module.device, run.module.precision, run.progress
    if device.type == "cuda":
        # Read before the caller frees anything: this is what the failed step was holding.
        used = (f"allocated {_gib(torch.cuda.memory_allocated(device))}, reserved "
                f"{_gib(torch.cuda.memory_reserved(device))} of "
                f"{_gib(torch.cuda.get_device_properties(device).total_memory)}")
    else:
        used = f"allocated/reserved: not tracked on {device.type}"
    bs, accum = cfg.train.batch_size, cfg.train.accumulation_steps
    # The largest batch that divides this one and is at most half of it: the effective batch
    # stays exactly the same (7 is 1 x 7, where 3 x 2 would be 6). A batch of 1 cannot shrink.
    smaller = next((d for d in range(bs // 2, 0, -1) if bs % d == 0), None)
    fixes = []
    if smaller is not None:
        share = "half" if bs == 2 * smaller else f"1/{bs // smaller} of"
        fixes.append(f"train.batch_size={smaller} train.accumulation_steps="
                     f"{accum * bs // smaller} (same effective batch of {bs * accum}, {share} "
                     f"the activation memory)")
    if precision == "fp32":
        fixes.append("train.precision=bf16 (about half the activation memory)")
    fixes.append("activation checkpointing in the model "
                 "(torch.utils.checkpoint.checkpoint around its blocks)")
    steps = "\n".join(f"  {i}. {f}" for i, f in enumerate(fixes, 1))
    return OutOfMemory(
        f"out of memory at optimizer step {p.step + 1} (epoch "
        f"{p.epoch + 1}) with train.batch_size={bs}, precision {precision}: "
        f"{used}. torch said: {str(error).splitlines()[0] if str(error) else 'OOM'}\n"
        f"Fixes, easiest first:\n{steps}\n"
        f"Checkpoints in {cfg.run.dir}/checkpoints are intact: resume with {option('resume')} "
        f"after the "
        f"change.")
