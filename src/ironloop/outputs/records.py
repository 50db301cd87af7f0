"""What a run records about itself: what it actually used, and where it ran.

``config.yaml`` holds the resolved config plus a ``used:`` block: the model's class and parameter
count, the datasets' types and sizes, the optimizer's and scheduler's classes, and custom loss or
step functions. For a ``fit()`` run whose model or data did not come from ``model.name`` /
``data.name``, those two keys read ``"user: <ClassName>"``, so no default that was not used is
shown. ``Config.from_dict`` ignores the ``used:`` block, so a CLI run's config.yaml loads back.

``run.json`` records the environment of every process of the run: the first start, then one
entry per resume (a run resumed on another machine says so).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ironloop.state.run_dir import RUN_JSON
from ironloop.version import __version__


def _name(obj: Any) -> str | None:
    if obj is None:
        return None
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def used(model, optimizer, scheduler, from_config: bool, data: dict, loss_fn=None,
         step_fn=None) -> dict:
    """The ``used:`` block: what this run trained, on what (``data``: each split's type and
    size, from data/source.py), with what. Classes are read off the objects the run holds, so
    a user's own optimizer or scheduler is named as it is."""
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out: dict[str, Any] = {
        "model": {"class": type(model).__name__, "parameters": params, "trainable": trainable},
        "data": data,
        "optimizer": type(optimizer).__name__,
        "scheduler": None if scheduler is None else type(scheduler).__name__,
        "source": "config" if from_config else "fit",
    }
    if loss_fn is not None:
        out["loss_fn"] = _name(loss_fn)
    if step_fn is not None:
        out["step_fn"] = _name(step_fn)
    return out


def config_record(cfg_dict: dict, used_block: dict) -> dict:
    """config.yaml's content: the config, with the names of a user's model and data."""
    record = {k: dict(v) for k, v in cfg_dict.items()}
    if used_block["source"] == "fit":
        record["model"]["name"] = f"user: {used_block['model']['class']}"
        train = used_block["data"].get("train")
        record["data"]["name"] = f"user: {train['type']}" if train else "user"
    return {**record, "used": used_block}


def git_commit(cwd: Path | None = None) -> str | None:
    """The commit of the working directory's git checkout (with "+dirty"), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd, capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, world_size: int) -> dict:
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine() or device.type
    return {
        "time": time.time(), "command": [sys.executable, *sys.argv],
        "cwd": str(Path.cwd()), "git_commit": git_commit(),
        "ironloop": __version__, "torch": str(torch.__version__),
        "python": platform.python_version(), "host": platform.node(),
        "device": str(device), "device_name": device_name, "world_size": world_size,
        "cuda": torch.version.cuda,
    }


def write_run_json(run_dir: Path, env: dict, resumed: bool) -> None:
    """run.json: the first process's environment, then one entry per resume."""
    from ironloop.state.io import write_atomic

    path = run_dir / RUN_JSON
    record: dict = {}
    if resumed and path.is_file():
        try:
            record = json.loads(path.read_text())
        except ValueError:
            record = {}
    if not record:
        record = {**env, "resumes": []}
    else:
        record.setdefault("resumes", []).append(env)
    write_atomic(path, json.dumps(record, indent=2) + "\n")
