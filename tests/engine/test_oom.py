"""engine/oom.py: the out-of-memory error says where the run was, what it held, and the fixes
in order of ease, with the config keys to change."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ironloop.config import Config
from ironloop.engine.oom import OutOfMemory, out_of_memory
from ironloop.errors import UserError


def run_at(step: int, epoch: int, precision: str = "fp32", **overrides):
    cfg = Config().with_overrides({"run.dir": "runs/x", **overrides})
    return SimpleNamespace(cfg=cfg, progress=SimpleNamespace(step=step, epoch=epoch),
                           module=SimpleNamespace(device=torch.device("cpu"), precision=precision))


def test_the_message_names_the_step_the_memory_and_the_fixes_easiest_first():
    error = out_of_memory(run_at(6, 1, **{"train.batch_size": 48, "train.accumulation_steps": 2}),
                          torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB\nmore"))
    assert isinstance(error, OutOfMemory) and isinstance(error, UserError)
    assert str(error) == (
        "out of memory at optimizer step 7 (epoch 2) with train.batch_size=48, precision fp32: "
        "allocated/reserved: not tracked on cpu. torch said: CUDA out of memory. Tried 2 GiB\n"
        "Fixes, easiest first:\n"
        "  1. train.batch_size=24 train.accumulation_steps=4 (same effective batch of 96, half "
        "the activation memory)\n"
        "  2. train.precision=bf16 (about half the activation memory)\n"
        "  3. activation checkpointing in the model (torch.utils.checkpoint.checkpoint around "
        "its blocks)\n"
        "Checkpoints in runs/x/checkpoints are intact: resume with --resume after the change.")


def test_a_half_precision_run_of_batch_one_is_not_told_to_halve_either_again():
    error = str(out_of_memory(run_at(0, 0, "bf16", **{"train.batch_size": 1}),
                              RuntimeError("")))
    assert "torch said: OOM\n" in error
    assert "train.batch_size=1 " not in error and "train.precision=bf16" not in error
    assert "  1. activation checkpointing" in error


def test_an_odd_batch_is_split_into_a_divisor_so_the_effective_batch_stays_exact():
    def first_fix(bs: int, accum: int = 1) -> str:
        error = str(out_of_memory(run_at(0, 0, **{"train.batch_size": bs,
                                                  "train.accumulation_steps": accum}),
                                  RuntimeError("")))
        return error.split("  1. ")[1].splitlines()[0]

    assert first_fix(7) == ("train.batch_size=1 train.accumulation_steps=7 (same effective "
                            "batch of 7, 1/7 of the activation memory)")
    assert first_fix(9, 2) == ("train.batch_size=3 train.accumulation_steps=6 (same effective "
                               "batch of 18, 1/3 of the activation memory)")
    assert first_fix(2) == ("train.batch_size=1 train.accumulation_steps=2 (same effective "
                            "batch of 2, half the activation memory)")


def test_gib_has_two_decimals():
    from ironloop.engine.oom import _gib

    assert _gib(3 * 2**30 // 2) == "1.50 GiB" and _gib(0) == "0.00 GiB"


def test_on_a_gpu_the_message_gives_what_the_failed_step_held_of_that_devices_memory(
        monkeypatch):
    asked = []

    def reads(value):
        def read(device):
            asked.append(device)
            return value
        return read

    monkeypatch.setattr(torch.cuda, "memory_allocated", reads(3 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", reads(7 * 2**29))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        reads(SimpleNamespace(total_memory=80 * 2**30)))
    run = run_at(0, 0)
    run.module.device = torch.device("cuda", 1)
    error = str(out_of_memory(run, torch.OutOfMemoryError("CUDA out of memory")))
    assert ("precision fp32: allocated 3.00 GiB, reserved 3.50 GiB of 80.00 GiB. torch said: "
            "CUDA out of memory\n") in error
    assert asked == [torch.device("cuda", 1)] * 3  # the run's own GPU, not GPU 0
