"""Real stream formats from the CLI: Hugging Face streaming datasets (json, parquet) with a
shuffle buffer and WebDataset tar shards, SIGKILLed twice mid-run (across an epoch boundary),
resumed, and bit-identical to an uninterrupted run. A damaged shard stops the run with exit 2
and a message naming it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import forked
from tests.conftest import REPO, wait_running
from tests.stream_data import write_files

pytestmark = pytest.mark.slow
pytest.importorskip("torchdata")
safetensors = pytest.importorskip("safetensors.torch")

STEPS = 40  # 240 samples, batches of 16: 14 or 15 steps an epoch, so the run ends in epoch 3


def command(factory: str, root: Path, run_dir: Path, *extra: str) -> list[str]:
    config = root / "stream.yaml"
    config.write_text(f"data:\n  name: tests.stream_data:{factory}\n  root: {root}\n"
                      f"model:\n  name: tests.stream_data:model\n"
                      f"train:\n  epochs: 3\n  max_steps: {STEPS}\n  batch_size: 16\n")
    return [sys.executable, "-m", "ironloop", "train", str(config), "checkpoint.every_steps=4",
            "log.progress=off", f"run.dir={run_dir}", *extra, "--resume"]


def env(tmp_path: Path, pause_at: int = 0) -> dict:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
            "PYTHONUNBUFFERED": "1", "IRONLOOP_TEST_PAUSE_AT": str(pause_at),
            "IRONLOOP_TEST_PAUSE_FILE": str(tmp_path / "paused")}


def in_process(cmd: list[str], tmp_path: Path, monkeypatch) -> int:
    """``cmd``'s ``ironloop`` (the CLI's main) in this process, with the subprocesses'
    environment and one intra-op thread (OMP_NUM_THREADS=1 there): the same run, without an
    interpreter's and torch's start-up (issue 45). Its DataLoader workers are forks of it."""
    from ironloop.cli import main

    for key in ("HF_DATASETS_OFFLINE", "HF_HOME", "IRONLOOP_TEST_PAUSE_AT"):
        monkeypatch.setenv(key, env(tmp_path)[key])
    monkeypatch.chdir(REPO)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(cmd[3:])
    finally:
        torch.set_num_threads(threads)


def run_to_end(cmd: list[str], tmp_path: Path, monkeypatch, capsys) -> None:
    """The resume after the kills, to the end, in this process (``in_process``): the kills are
    the real processes'; resuming from what they left needs no fresh interpreter (issue 45).
    Its stdout goes to run.dir/stdout.log."""
    capsys.readouterr()
    code = in_process(cmd, tmp_path, monkeypatch)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    run_dir = Path(next(a[len("run.dir="):] for a in cmd if a.startswith("run.dir=")))
    (run_dir / "stdout.log").write_text(out)


def kill_at(cmd: list[str], tmp_path: Path, forward: int) -> None:
    """Start the run, in a process of its own: ``cmd``'s ``ironloop`` in a fork of this one
    (tests/forked.py: no interpreter's and torch's start-up; what is killed is a real process
    and its loader workers); its ``forward``-th training forward pauses
    (tests.stream_data.PausingMLP), and the process is SIGKILLed there, mid-step, its loader
    workers mid-read."""
    marker, out = tmp_path / "paused", tmp_path / "killed.out"
    marker.unlink(missing_ok=True)
    proc = forked.fork_main(cmd[3:], env(tmp_path, forward), out)
    wait_running(proc, marker.exists, f"pause at forward {forward}", out.read_text, every=0.05)
    assert proc.poll() is None, (proc.returncode, out.read_text()[-3000:])
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def resumed_steps(run_dir: Path) -> list[int]:
    import json

    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if json.loads(x).get("event") == "resume"]


@pytest.mark.parametrize("factory, fmt, extra", [
    # A shuffle buffer: HF's state leaves it out, so the resume replays the epoch (exact).
    ("hf", "jsonl", ()),
    # No shuffle buffer: resumed from HF's own state in each worker, not by replay.
    ("hf", "parquet", ("data.kwargs={fmt: parquet, buffer: 0}", "data.num_workers=2")),
    ("tars", "tar", ("data.num_workers=2",)),
], ids=["hf-json-buffer", "hf-parquet-state-2-workers", "webdataset-2-workers"])
def test_killed_twice_across_an_epoch_boundary_ends_bit_identical(tmp_path, factory, fmt,
                                                                   extra, monkeypatch, capsys):
    root = write_files(tmp_path / "data", fmt)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    # the uninterrupted reference and the last resume in this process; the kills are real
    assert in_process(command(factory, root, reference, *extra), tmp_path, monkeypatch) == 0
    cmd = command(factory, root, killed, *extra)
    kill_at(cmd, tmp_path, 18)  # in epoch 2; the newest checkpoint is step 16
    kill_at(cmd, tmp_path, 17)  # from step 16 on: past the start of epoch 3
    run_to_end(cmd, tmp_path, monkeypatch, capsys)
    assert resumed_steps(killed) == [16, 32]
    replayed = "reads again" in (killed / "stdout.log").read_text()
    assert replayed == ("buffer: 0" not in " ".join(extra))
    want = safetensors.load_file(reference / "final.safetensors")
    got = safetensors.load_file(killed / "final.safetensors")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_a_damaged_shard_stops_the_run_naming_it_and_keeps_the_checkpoints(tmp_path, capsys,
                                                                            monkeypatch):
    order = [f"part-{s:02d}.tar" for s in range(4)]
    random.Random(0).shuffle(order)  # tests.stream_data.Shards' order in epoch 1 (seed 0)
    last = int(order[-1][5:7])
    root = write_files(tmp_path / "data", "tar", corrupt=last)
    run_dir = tmp_path / "run"
    # the CLI's main in this process: its exit code and what it writes to stderr
    code = in_process(command("tars", root, run_dir), tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert order[-1] in err and "Traceback" not in err
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["progress"]["step"] >= 4  # the shards before it trained and were saved


def test_two_ranks_with_unequal_shares_end_each_epoch_together(tmp_path):
    """3 tar shards over 2 ranks (wds.split_by_node): rank 0 reads two, rank 1 one. The ranks
    agree on each window, so the epoch ends on both when rank 1's share ends (DDP would hang
    otherwise) and rank 0's surplus is dropped with a warning."""
    root = write_files(tmp_path / "data", "tar", n=240, shards=3)
    run_dir = tmp_path / "run"
    cmd = command("tars", root, run_dir, "train.max_steps=12", "train.epochs=3",
                  "checkpoint.every_steps=0")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--standalone", "-m", "ironloop"]
    done = subprocess.run([*launcher, *cmd[3:]], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**env(tmp_path), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    import json

    epochs = [json.loads(x) for x in (run_dir / "epochs.jsonl").read_text().splitlines()]
    # 80 samples a shard: rank 1's 80 make 5 full batches of 16, so 5 steps an epoch.
    assert [e["step"] for e in epochs] == [5, 10]
    assert done.stderr.count("batch(es) more than another rank's") == 2
