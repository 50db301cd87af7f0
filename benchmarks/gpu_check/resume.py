"""Part 4, bit-exact resume under ``torch.use_deterministic_algorithms(True)``: a kill -9 in
the middle of an epoch, a resume, and the final weights ``torch.equal`` to a run never killed.

Both runs are the real CLI (``python -m ironloop train``) on one config: small_cnn on
synthetic 3x32x32 images, 2 epochs of 32 steps (2048 of the 2560 samples train), bf16 on CUDA,
a checkpoint every 10 steps. The straight run and the one to kill start together; the second
one stops in ``on_step_end`` of step 15 (mid-epoch 1, after the checkpoint at step 10; in a dry
run step 10, after the one at 8) and says so in a file, and is killed there with SIGKILL; then
``--resume`` trains it to the end. Deterministic algorithms are set by the ``Deterministic``
callback, which the config names (``train.callbacks``), since the CLI has no key for them;
CUBLAS_WORKSPACE_CONFIG is in the environment before CUDA starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks.gpu_check.shared import Part
from ironloop.callbacks import Callback

REPO = Path(__file__).resolve().parents[2]
#: Dry run: smaller images and batches, a checkpoint every 4 steps and the kill at step 10.
SIZES = {"full": {"image": 32, "batch": 64, "every": 10, "kill_at": 15},
         "dry": {"image": 8, "batch": 16, "every": 4, "kill_at": 10}}
#: How long the paused run waits to be killed before it gives up (it is killed at once).
PAUSE_LIMIT_S = 120.0


class Deterministic(Callback):
    """Deterministic algorithms for the whole run (set when the callback is built, before the
    first step). With GPU_CHECK_PAUSE_AT=N, it writes GPU_CHECK_PAUSED at step N and waits
    there to be killed."""

    def __init__(self):
        torch.use_deterministic_algorithms(True)
        self.pause_at = int(os.environ.get("GPU_CHECK_PAUSE_AT", "0"))
        self.marker = os.environ.get("GPU_CHECK_PAUSED", "")

    def on_step_end(self, run, metrics: dict) -> None:
        if metrics["step"] != self.pause_at:
            return
        Path(self.marker).write_text(str(metrics["step"]))
        limit = time.monotonic() + PAUSE_LIMIT_S
        while time.monotonic() < limit:  # the parent's SIGKILL ends this
            time.sleep(0.05)
        raise RuntimeError(f"not killed within {PAUSE_LIMIT_S:.0f} s of pausing at step "
                           f"{self.pause_at}")


def config(tmp: Path, name: str, cuda: bool, size: dict) -> Path:
    """32 steps an epoch: 2560 samples, 2048 of them training, at batch 64 (the dry run's
    sizes keep the steps)."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"dir": str(tmp / name), "device": "cuda" if cuda else "cpu"},
        "data": {"name": "synthetic", "input_shape": [3, size["image"], size["image"]],
                 "num_samples": 40 * size["batch"], "num_classes": 10},
        "model": {"name": "small_cnn"},
        "train": {"epochs": 2, "batch_size": size["batch"],
                  "precision": "bf16" if cuda else "fp32",
                  "callbacks": ["benchmarks.gpu_check.resume:Deterministic"]},
        "checkpoint": {"every_steps": size["every"]},
        "log": {"every_steps": 1, "progress": "off"},
        "doctor": {"preflight": False}}))
    return path


def cli(cfg: Path, *extra: str, env: dict, log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "ironloop", "train", str(cfg), *extra],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait(proc: subprocess.Popen, deadline: float, what: str) -> None:
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{what} did not finish before the part's deadline") from None
    if code != 0:
        raise RuntimeError(f"{what} exited {code} (its output is in the log)")


def kill_resume_compare(part: Part, tmp: Path, size: dict) -> dict:
    log = tmp / "cli.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
    marker = tmp / "paused"
    straight = cli(config(tmp, "straight", part.cuda, size), env=env, log=log)
    killed_cfg = config(tmp, "killed", part.cuda, size)
    kill_at = size["kill_at"]
    killed = cli(killed_cfg, env={**env, "GPU_CHECK_PAUSE_AT": str(kill_at),
                                  "GPU_CHECK_PAUSED": str(marker)}, log=log)
    while not marker.exists():  # bounded by the deadline and by the run's own end
        if killed.poll() is not None or time.time() > part.deadline:
            killed.kill()
            raise RuntimeError(f"the run to kill never reached step {kill_at} "
                               f"(exit {killed.poll()})")
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    # The checkpoint the resume starts from: the newest rolling step-N.pt (checkpoint.keep_last)
    # at the kill. None would make the check trivial (a resume from scratch is exact too).
    saved = [int(p.stem.removeprefix("step-"))
             for p in (tmp / "killed" / "checkpoints").glob("step-*.pt")]
    if not saved:
        raise RuntimeError("no step-N.pt checkpoint before the kill: nothing to resume from")
    wait(cli(killed_cfg, "--resume", env=env, log=log), part.deadline, "the resumed run")
    wait(straight, part.deadline, "the straight run")
    from safetensors.torch import load_file

    a = load_file(tmp / "straight" / "final.safetensors")
    b = load_file(tmp / "killed" / "final.safetensors")
    equal = [k for k in a if k in b and torch.equal(a[k], b[k])]
    return {"killed_at_step": kill_at, "resumed_from_step": max(saved),
            "tensors_equal": f"{len(equal)} of {len(a)}",
            "bit_exact": len(equal) == len(a) == len(b),
            "problem": None if len(equal) == len(a) == len(b) else "final weights differ"}


def main() -> None:
    part = Part("resume", __doc__.splitlines()[0])
    size = SIZES["dry" if part.dry else "full"]
    with tempfile.TemporaryDirectory() as d:
        got = part.attempt(f"kill -9 at step {size['kill_at']} (of 64), resume, final weights",
                           lambda: kill_resume_compare(part, Path(d), size),
                           cpu_status="skipped: no CUDA (the same kill and resume ran on the "
                                      "CPU, deterministic there anyway)")
        if got is None or not got["bit_exact"]:
            log = Path(d) / "cli.log"
            if log.exists():
                print(log.read_text()[-4000:], file=sys.stderr)


if __name__ == "__main__":
    main()
