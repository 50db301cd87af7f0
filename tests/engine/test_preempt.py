"""Preemption (engine/preempt.py): SIGTERM, SIGINT or SIGUSR1 finish the optimizer step, write a
checkpoint of it and exit 75; the resume redoes no step. A second signal while that checkpoint
is written kills at once and leaves the previous one intact. Real processes, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ironloop
from ironloop.callbacks import Callback
from ironloop.errors import Preempted
from ironloop.state.io import load_verified
from tests.conftest import REPO, blobs, cfg, tiny_mlp, wait_running

TIMEOUT = 300  # seconds; each run takes a few on an idle machine, far more at load 15
ARGS = ["configs/digits.yaml", "model.name=mlp", "log.progress=off", "log.every_steps=1",
        "doctor.preflight=false", "checkpoint.every_steps=1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start(argv: list[str], log: Path, torchrun: int = 0) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "ironloop"] if not torchrun else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}",
         "--standalone", "-m", "ironloop"]
    with log.open("w") as out:
        return subprocess.Popen([*launcher, *argv], cwd=REPO, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.endswith("}")]


def wait_for(what, proc: subprocess.Popen, log: Path, why: str) -> None:
    """Until ``what()`` is true (files are polled, never a fixed sleep); conftest.wait_running
    ends a hung run after HANG_S (a forked one writes its stacks first)."""
    wait_running(proc, what, why, log.read_text, every=0.01)
    if not what():
        pytest.fail(f"the run ended before {why}:\n{log.read_text()[-4000:]}")


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def ckpt_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["progress"]["step"]


def ironloop_lines(out: str) -> list[str]:
    """The lines ironloop itself printed as a message (``ironloop: ...``), with torchrun's
    optional ``[rankN]:`` prefix, never a path that happens to hold the word."""
    return [line for line in out.splitlines()
            if re.match(r"^(\[\w+\]:)?ironloop: ", line)]


def signal_and_time(proc: subprocess.Popen, sig: int) -> float:
    """Seconds from the signal to the process's exit (reported, never asserted on)."""
    sent = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=TIMEOUT)
    return time.monotonic() - sent


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_the_step_it_reached_and_the_resume_redoes_none(tmp_path, sig):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    argv = ["train", *ARGS, "train.epochs=20", f"run.dir={run_dir}"]
    proc = start(argv, log)
    wait_for(lambda: len(logged_steps(run_dir)) >= 5, proc, log, "step 5")
    seconds = signal_and_time(proc, sig)
    print(f"{sig.name}: {seconds:.2f} s from the signal to the exit")
    out = log.read_text()
    assert proc.returncode == Preempted.EXIT_CODE == 75, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith("ironloop:")]
    assert len(said) == 1 and f"preempted by {sig.name}" in said[0], out[-3000:]
    assert "Traceback" not in out
    stop = events(run_dir)[-1]
    assert stop["event"] == "preempted" and stop["signal"] == sig.name and stop["saved"]
    step = stop["step"]
    assert step >= 5 and logged_steps(run_dir)[-1] == step  # finished the step it was in
    assert ckpt_step(run_dir / "checkpoints" / "last.pt") == step  # and saved exactly that one
    if sig != signal.SIGTERM:
        return
    resumed = start([*argv, "--resume"], tmp_path / "resume.log")
    assert resumed.wait(timeout=TIMEOUT) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    resume = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resume == [{**resume[0], "step": step, "last_logged_step": step, "steps_redone": 0}]
    assert logged_steps(run_dir) == list(range(1, 20 * 23 + 1))  # each step logged once


SLOW_SAVE = """
import signal, sys, time
from pathlib import Path
from ironloop.state import file_writer as manager
from ironloop.cli import main

saving = Path(sys.argv[1])
real = manager.save_atomic

def slow_save(state, path):
    # The preemption's own save (the only time the loop sets SIGINT to the kernel's default)
    # hangs, as a huge checkpoint on a slow disk would.
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        saving.touch()
        while True:
            time.sleep(0.01)
    real(state, path)

manager.save_atomic = slow_save
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_second_signal_while_saving_exits_at_once_and_keeps_the_previous_checkpoint(
        tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    script, saving = tmp_path / "slow_save.py", tmp_path / "saving"
    script.write_text(SLOW_SAVE)
    argv = ["train", *ARGS, "train.epochs=20", f"run.dir={run_dir}"]  # saves at epoch ends
    proc = subprocess.Popen([sys.executable, str(script), str(saving), *argv],
                            cwd=REPO, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)
    last = run_dir / "checkpoints" / "last.pt"
    wait_for(lambda: last.exists() and len(logged_steps(run_dir)) >= 25, proc, log,
             "epoch 1's checkpoint")
    proc.send_signal(signal.SIGINT)
    wait_for(saving.exists, proc, log, "the preemption's save")
    before = last.read_bytes()  # no other save can run now: the loop is inside its last one
    seconds = signal_and_time(proc, signal.SIGINT)
    print(f"second SIGINT while saving: {seconds:.2f} s to the exit")
    assert proc.returncode == -signal.SIGINT, log.read_text()[-3000:]  # the kernel's default
    assert last.read_bytes() == before  # the previous checkpoint, intact and loadable
    step = load_verified(last)["progress"]["step"]
    assert step % 23 == 0 and step < logged_steps(run_dir)[-1]  # an epoch end's, not the new
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_torchrun_ranks_agree_on_the_step_save_together_and_resume_it(tmp_path):
    # SIGTERM to torchrun, as Kubernetes and SLURM send it: torchrun forwards it to both ranks,
    # which receive it at different points of a step; they must stop after the same step.
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    argv = ["train", *ARGS, "train.epochs=20", "train.batch_size=32", f"run.dir={run_dir}"]
    proc = start(argv, log, torchrun=2)
    wait_for(lambda: len(logged_steps(run_dir)) >= 5, proc, log, "step 5")
    seconds = signal_and_time(proc, signal.SIGTERM)
    print(f"torchrun, 2 ranks: {seconds:.2f} s from SIGTERM to the exit")
    out = log.read_text()
    assert "preempted by SIGTERM" in out, out[-4000:]
    stop = events(run_dir)[-1]
    assert stop["event"] == "preempted", out[-4000:]
    assert ckpt_step(run_dir / "checkpoints" / "last.pt") == stop["step"]
    # ironloop's own lines start with "ironloop: " (the CLI's one-line messages); torchrun's
    # tracebacks may name the checkout's path, which can contain "ironloop" anywhere
    ranks_out = [line for line in ironloop_lines(out) if "error" in line.lower()]
    assert not ranks_out, out[-4000:]
    resumed = start([*argv, "--resume", "train.max_steps=" + str(stop["step"] + 2),
                     "--allow-config-change"], tmp_path / "resume.log", torchrun=2)
    assert resumed.wait(timeout=TIMEOUT) == 0, (tmp_path / "resume.log").read_text()[-4000:]
    resume = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resume[0]["step"] == stop["step"] and resume[0]["steps_redone"] == 0
    assert logged_steps(run_dir) == list(range(1, stop["step"] + 3))


class Exited(BaseException):
    """os._exit, caught: the handler's kill, seen by the test instead of ending it."""


def test_the_same_signal_twice_within_the_window_is_one_request_and_later_kills(monkeypatch):
    """SLURM and torchrun both forward one SIGTERM: a repeat within DUPLICATE_S is the same
    request (the run still saves), a second signal after it kills at once. Real signals to
    this process; the handler's clock and its os._exit are the test's."""
    from types import SimpleNamespace

    from ironloop.engine import preempt

    now = [100.0]

    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(preempt, "time", SimpleNamespace(monotonic=lambda: now[0]))
    written = []
    monkeypatch.setattr(preempt, "os", SimpleNamespace(
        write=lambda fd, b: written.append((fd, b)) or len(b), _exit=exit_now))
    with preempt.Preemption(distributed=False) as p:
        assert not p.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        now[0] += preempt.DUPLICATE_S / 2
        os.kill(os.getpid(), signal.SIGTERM)  # the forwarded copy: not a second request
        now[0] += preempt.DUPLICATE_S / 2 - 0.01
        os.kill(os.getpid(), signal.SIGTERM)  # still within DUPLICATE_S of the first
        assert p.should_stop() and p.signum == signal.SIGTERM
        now[0] = 100.0 + preempt.DUPLICATE_S
        os.kill(os.getpid(), signal.SIGTERM)  # exactly DUPLICATE_S after: still the same one
        now[0] += 0.01  # past DUPLICATE_S since the first: a user's second request
        with pytest.raises(Exited) as exited:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.args == (128 + signal.SIGTERM,)
    assert written == [(2, b"ironloop: second SIGTERM: exiting now without a checkpoint; the "
                           b"previous one is intact\n")]  # to stderr, the one line said
    assert signal.getsignal(signal.SIGTERM) != p._on_signal  # handlers given back


def test_a_signal_in_process_ends_fit_with_preempted_and_an_event_naming_the_signal(tmp_path):
    """fit() in this process (no CLI): a SIGUSR1 sent at step 3 saves that step, and
    events.jsonl's preempted line names the signal, the step and that it was saved."""
    class Signal(Callback):
        def on_step_end(self, run, metrics: dict) -> None:
            if metrics["step"] == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    with pytest.raises(Preempted):
        ironloop.fit(tiny_mlp(), blobs(256), None, cfg(tmp_path), callbacks=[Signal()])
    stop = events(tmp_path / "run")[-1]
    assert (stop["event"], stop["signal"], stop["saved"]) == ("preempted", "SIGUSR1", True)
    assert stop["step"] == ckpt_step(tmp_path / "run" / "checkpoints" / "last.pt") == 3


def test_a_run_preempted_at_an_epochs_last_step_logs_its_lr_and_position_after_the_resume(
        tmp_path, capsys):
    """A signal at the epoch's last (ragged) step: the resumed process ends that epoch with no
    step of its own, and its epochs.jsonl and evals.jsonl rows still carry the LR that step
    used (the checkpoint keeps it), as an uninterrupted run's do; the resume line counts the
    ragged step (7/7 steps into the epoch, not 6/7)."""
    class Signal(Callback):
        def on_step_end(self, run, metrics: dict) -> None:
            if metrics["step"] == 7:  # 200 samples / 32: 7 steps, the last one ragged
                os.kill(os.getpid(), signal.SIGUSR1)

    def rows(run_dir: Path, name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / f"{name}.jsonl").read_text().splitlines()]

    def config(name: str) -> dict:
        return cfg(tmp_path / name, schedule__name="cosine")

    ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1), config("whole"))
    with pytest.raises(Preempted):
        ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1), config("cut"),
                     callbacks=[Signal()])
    capsys.readouterr()
    ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1), config("cut"), resume=True)
    assert "(epoch 1, 7/7 steps into it)" in capsys.readouterr().out
    whole, cut = tmp_path / "whole" / "run", tmp_path / "cut" / "run"
    for name in ("epochs", "evals"):
        lrs = [r["lr"] for r in rows(whole, name)]
        assert lrs[0] > 0 and [r["lr"] for r in rows(cut, name)] == lrs, name


def test_under_a_process_group_the_stop_is_read_one_step_after_the_signal(tmp_path):
    """Each step's flag goes out in an all-reduce that is read at the next step, so every rank
    stops at the same step: a group of one, in this process, shows the one-step lag."""
    from datetime import timedelta

    import torch.distributed as dist

    from ironloop.engine import preempt

    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60),
                            store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        p = preempt.Preemption(distributed=True, timeout_s=30)
        assert not p.should_stop()  # nothing sent before: nothing to read
        assert not p.should_stop()  # the first step's flag: no signal
        p.signum = signal.SIGTERM   # the handler, between two steps
        assert not p.should_stop()  # this step sends the flag; it reads the previous one
        assert p.should_stop() and p.should_stop()
        assert p._pending is not None
        p.__exit__(None, None, None)  # waits for the last all-reduce sent
        assert p._pending is None
        stop = p.stopped(7, saved=True)
        assert (stop.signal_name, stop.step, stop.saved) == ("SIGTERM", 7, True)
        other = preempt.Preemption(distributed=True)
        assert other.stopped(3, saved=False).signal_name == "a signal to another rank"
    finally:
        dist.destroy_process_group()


def test_handlers_are_installed_from_the_main_thread_only_and_given_back_once():
    """signal.signal works in the main thread only: fit() called from another thread runs
    without the stop-at-a-step handlers rather than failing; leaving twice gives back once."""
    import threading

    from ironloop.engine import preempt

    before = {sig: signal.getsignal(sig) for sig in preempt.SIGNALS}
    p = preempt.Preemption(distributed=False)
    with p:
        assert all(signal.getsignal(sig) == p._on_signal for sig in preempt.SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in preempt.SIGNALS} == before
    p.__exit__(None, None, None)  # an error path's second cleanup: nothing left to give back
    assert {sig: signal.getsignal(sig) for sig in preempt.SIGNALS} == before
    seen: list = []

    def in_a_thread():
        with preempt.Preemption(distributed=False) as q:
            seen.append((dict(q._previous), signal.getsignal(signal.SIGTERM)))

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert seen == [({}, before[signal.SIGTERM])]
