"""A resume into a run.dir whose checkpoints path is broken (a file, a dangling link, a folder
this user cannot write) is refused in one line before a byte of run.dir is written."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ironloop.errors import UserError
from tests.conftest import REPO
from tests.state.test_remote import StopAt, _config, _fit


def _bytes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _broken(ckpt: Path, how: str) -> None:
    shutil.rmtree(ckpt)
    if how == "a file":
        ckpt.write_text("not a folder\n")
    elif how == "a dangling link":
        ckpt.symlink_to(ckpt.parent / "nowhere")
    else:
        ckpt.mkdir()
        ckpt.chmod(0o500)


@pytest.mark.parametrize("how", ["a file", "a dangling link", "a read-only folder"])
def test_a_broken_checkpoints_path_refuses_the_resume_and_keeps_every_log_byte(tmp_path, how):
    if how == "a read-only folder" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    config = _config(tmp_path)
    _fit(config, callbacks=[StopAt(7)])
    run_dir = tmp_path / "run"
    _broken(run_dir / "checkpoints", how)
    before = _bytes(run_dir)
    assert before["metrics.jsonl"]  # a run with logs to lose
    with pytest.raises(UserError, match=r"checkpoints (is|cannot) .*cannot be resumed"):
        _fit(config, resume=True)
    assert _bytes(run_dir) == before


def test_cli_a_checkpoints_file_is_one_line_exit_2_and_run_dir_unchanged(tmp_path):
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "ironloop", "train", str(REPO / "configs" / "digits.yaml"),
           f"run.dir={run_dir}", "train.max_steps=4", "checkpoint.every_steps=2"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    _broken(run_dir / "checkpoints", "a file")
    before = _bytes(run_dir)
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "cannot be resumed" in done.stderr
    assert _bytes(run_dir) == before
