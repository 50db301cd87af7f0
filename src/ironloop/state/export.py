"""Weights out of a run: safetensors, which holds tensors only and cannot run code."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ironloop.errors import UserError
from ironloop.state import dcp, remote
from ironloop.state.checkpointer import Checkpointer
from ironloop.state.io import load_verified, remove_quietly, strip_prefixes, temp_path
from ironloop.state.run_dir import RunDir


def save_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Write atomically. Tensors are cloned because safetensors refuses shared storage."""
    tensors = {k: v.detach().to("cpu").contiguous().clone()
               for k, v in strip_prefixes(state_dict).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        # One metadata key only: safetensors writes the metadata map in hash order, so with
        # two keys identical weights could give different bytes (and different checksums).
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)  # a full disk leaves no half-written temp file behind
        if isinstance(e, OSError) or "I/O error" in str(e):  # safetensors' own error type
            raise UserError(f"{path} cannot be written ({_io_reason(e)}); free space (or "
                            f"raise the quota) on {path.parent} and try again: a run's "
                            f"checkpoints are intact, and --resume finishes it") from None
        raise


def _io_reason(e: BaseException) -> str:
    """The OS's words: safetensors says 'Error while serializing: I/O error: <reason>'."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return text.rsplit("I/O error: ", 1)[-1].strip()[:120]


def export_run(run_dir: Path | str, out: Path, which: str = "best", force: bool = False) -> Path:
    """Export best or last of ``run_dir`` to ``out`` as safetensors: a ``.pt`` file, or a
    sharded ``.dcp`` directory (FSDP2), whose shards are consolidated here in one process.
    ``run_dir`` may be a checkpoint.remote URL: its newest complete (best) checkpoint is
    fetched and verified first. ``avg``: the averaged weights (average.kind) of the last
    checkpoint, from a local run directory."""
    if force and (out.is_symlink() or (os.path.lexists(out) and not out.is_file()
                                       and not out.is_dir())):
        # os.replace would turn a device node, a symlink or a folder into a regular file
        raise UserError(f"--out {out} exists and is not a regular file (a folder, a symlink "
                        f"or a device); --force replaces only a file: pick another --out")
    averaged = which == "avg"
    if remote.is_remote(run_dir):
        if averaged:
            raise UserError("export --which avg reads a local run directory; export best or "
                            "last from the remote, or copy the run's final_avg.safetensors")
        return _export_remote(str(run_dir), out, which, force)
    checkpoints = Checkpointer(RunDir(run_dir))
    ckpt = checkpoints.named("last" if averaged else which)  # names what the run has
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name like model.safetensors")
    if out.exists() and not force:
        raise UserError(f"--out {out} already exists; pass --force to replace it, or pick "
                        f"another name")
    weights = _averaged(ckpt) if averaged else checkpoints.model_weights(which)
    save_safetensors(weights, out)
    return out


def _averaged(ckpt: Path) -> dict[str, torch.Tensor]:
    """The averaged model's weights in a checkpoint (AveragedModel's state_dict without its
    count); its keys are the model's own once ``module.`` is stripped."""
    if ckpt.is_dir():
        raise UserError(f"{ckpt} is sharded (FSDP2): each rank holds its own shards of the "
                        f"average; use the run's final_avg.safetensors instead")
    average = load_verified(ckpt).get("average")
    if average is None:
        raise UserError(f"{ckpt} holds no averaged weights: the run trained with "
                        f"average.kind=none; export --which best or --which last instead")
    return {k: v for k, v in average.items() if k != "n_averaged"}


def _export_remote(url: str, out: Path, which: str, force: bool) -> Path:
    store = remote.open_remote(url)
    store.require_bucket()
    with tempfile.TemporaryDirectory(prefix="ironloop-export-") as tmp:
        ckpts = RunDir(tmp).checkpoints
        got = remote.fetch_newest(store, ckpts, -1, lambda msg: print(f"warning: {msg}"),
                                  best=which == "best", check=dcp.check_any)
        if got is None:
            raise UserError(f"{url} holds no complete {which} checkpoint"
                            + (": pass --which last" if which == "best" and store.manifests()
                               else "; is it a checkpoint.remote URL?"))
        os.replace(got, ckpts / f"{which}{got.suffix}")
        return export_run(Path(tmp), out, which, force)
