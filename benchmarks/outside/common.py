"""What the four outside-workload drivers share: one thread, per-step timing on both sides,
user lines of Python, the SIGKILL + resume check of the ironloop side, and the table row.

Each driver runs as ``python -m benchmarks.outside.<name>`` from the repository root (with
``PYTHONPATH=src``); it re-runs itself with ``--child RUN_DIR [--resume]`` for the ironloop run
that is SIGKILLed and resumed in a new process. Public code is read from OUTSIDE
(default /work/outside), unmodified.
"""

from __future__ import annotations

import ast
import inspect
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ironloop.callbacks import Callback

OUTSIDE = Path(os.environ.get("OUTSIDE", "/work/outside"))
REPO = Path(__file__).resolve().parents[2]


def one_thread() -> None:
    torch.set_num_threads(1)


class StepClock(Callback):
    """An ironloop callback: wall time between consecutive optimizer steps (ms)."""

    def __init__(self):
        self.ms: list[float] = []
        self._last: float | None = None

    def on_step_end(self, run, metrics):
        now = time.perf_counter()
        if self._last is not None:
            self.ms.append(1000 * (now - self._last))
        self._last = now

    def on_eval_end(self, run, metrics):
        self._last = None  # an evaluation is not a step


def code_lines(source: str) -> int:
    """Lines of Python that are not blank, comments or docstrings."""
    tree = ast.parse(source)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def lines_of(*objects) -> int:
    return sum(code_lines(inspect.getsource(o)) for o in objects)


def file_lines(path: Path) -> int:
    return code_lines(path.read_text())


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def kill_and_resume(module: str, run_dir: Path, kill_after_step: int, straight: Path,
                    timeout: float = 1800) -> str:
    """Run the ironloop side in a child, SIGKILL it once a checkpoint at or past
    ``kill_after_step`` is on disk, resume it in a new process, and compare its
    final.safetensors with the uninterrupted run's: 'k/n tensors equal'."""
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", module, "--child", str(run_dir)]
    child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    ckpts = run_dir / "checkpoints"
    deadline = time.monotonic() + timeout
    killed = False
    while time.monotonic() < deadline and child.poll() is None:
        steps = [int(p.stem.split("-")[1]) for p in ckpts.glob("step-*.pt")] \
            if ckpts.is_dir() else []
        if steps and max(steps) >= kill_after_step:
            os.kill(child.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)  # polling a file the child writes; bounded by the deadline
    child.wait()
    if not killed:
        return "not killed (the run ended first)"
    subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=timeout)
    a, b = load_file(straight), load_file(run_dir / "final.safetensors")
    equal = sum(torch.equal(a[k], b[k]) for k in a if k in b)
    return f"{equal}/{len(a)} tensors equal"


def print_row(name: str, row: dict) -> None:
    print(f"| {name} | {row['ref_metric']} | {row['ours_metric']} | "
          f"{row['ref_ms']:.1f} | {row['ours_ms']:.1f} | {row['ref_lines']} | "
          f"{row['ours_lines']} | {row['resume']} |", flush=True)


HEADER = ("| workload | final metric (reference) | final metric (ironloop) | ms/step ref "
          "(median) | ms/step ironloop (median) | user lines ref | user lines ironloop | "
          "SIGKILL + resume (ironloop) |\n|---|---|---|---|---|---|---|---|")


def child_args() -> tuple[Path, bool] | None:
    """(run_dir, resume) when this process is the kill test's child, else None."""
    if "--child" not in sys.argv:
        return None
    return Path(sys.argv[sys.argv.index("--child") + 1]), "--resume" in sys.argv
