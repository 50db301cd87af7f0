"""state/export.py: weights out as safetensors, written atomically or not at all."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ironloop.errors import UserError
from ironloop.state import export
from ironloop.state.export import export_run
from ironloop.state.io import save_atomic
from tests.conftest import REPO

# A file-size limit is a real write failure (EFBIG) without a full disk to fill: the process
# ignores SIGXFSZ, so the write returns the error as a full disk's would (ENOSPC).
FULL = """
import resource, signal, sys, torch
from pathlib import Path
from ironloop.errors import UserError
from ironloop.state.export import save_safetensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    save_safetensors({"w": torch.zeros(100_000)}, Path(sys.argv[1]) / "final.safetensors")
except UserError as e:
    print(e)
"""


def test_final_weights_that_cannot_be_written_are_one_line_and_leave_no_temp_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", FULL, str(tmp_path)], cwd=REPO, text=True,
                          capture_output=True, timeout=120, env={"PYTHONPATH": "src"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == (f"{tmp_path}/final.safetensors cannot be written (File too large "
                           f"(os error 27)); free space (or raise the quota) on {tmp_path} and "
                           f"try again: a run's checkpoints are intact, and --resume finishes "
                           f"it\n")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temp


def test_a_safetensors_io_error_names_the_oss_reason_in_full(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):  # safetensors' own error, as a full disk gives it
        raise RuntimeError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")

    monkeypatch.setattr(export, "save_file", full_disk)
    with pytest.raises(UserError, match=r"cannot be written \(No space left on device "
                                        r"\(os error 28\)\); free space"):
        export.save_safetensors({"w": torch.zeros(2)}, tmp_path / "final.safetensors")


@pytest.mark.parametrize("which, has, other", [("best", "last.pt", "last"),
                                               ("last", "best.pt", "best")])
def test_export_of_a_checkpoint_the_run_lacks_names_the_which_it_has(tmp_path, which, has, other):
    (tmp_path / "checkpoints").mkdir()
    save_atomic({"model": {"w": torch.zeros(2)}, "progress": {"step": 1}},
                tmp_path / "checkpoints" / has)
    with pytest.raises(UserError, match=f"this run has {has}: pass --which {other}$"):
        export_run(tmp_path, tmp_path / "m.safetensors", which=which)
