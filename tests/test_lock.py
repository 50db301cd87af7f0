"""One owner per run.dir (state/lock.py): while a run holds its run.dir, a second ``ironloop
train`` on it, with --resume, --overwrite or neither, exits 2 naming the holder and touches
nothing; a SIGKILLed holder leaves no stale lock."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest

from ironloop.cli import main
from ironloop.state import lock
from tests.test_preempt import ARGS, TIMEOUT, logged_steps, start, wait_for


def test_the_lock_is_reentrant_in_one_process_and_released_after(tmp_path):
    with lock.hold(tmp_path):
        with lock.hold(tmp_path):  # ironloop train takes it before the preflight, fit again
            pass
        record = json.loads((tmp_path / lock.LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with lock.hold(tmp_path, enabled=False):  # ranks other than 0 hold nothing
        pass
    with lock.hold(tmp_path):  # released: taken again
        pass


@pytest.mark.slow
def test_a_second_process_is_refused_and_a_sigkill_leaves_no_stale_lock(tmp_path, capsys):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    first = start(["train", *ARGS, "train.epochs=30", f"run.dir={run_dir}"], log)
    wait_for(lambda: len(logged_steps(run_dir)) >= 3, first, log, "step 3")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for flags in (["--resume"], ["--overwrite"], []):
        code = main(["train", *ARGS, "train.epochs=1", f"run.dir={run_dir}", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (flags, err)
        assert f"pid {first.pid} on {socket.gethostname()}, started " in err[0], err
        assert "in use" in err[0] and "Traceback" not in err[0]
    assert first.poll() is None, "the holder must not notice the refused processes"
    assert (run_dir / "metrics.jsonl").exists() and logged_steps(run_dir)[0] == 1  # untouched
    assert set(ckpts) <= {p.name for p in (run_dir / "checkpoints").iterdir()}
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=TIMEOUT)
    # The kernel dropped the dead holder's lock: a --resume takes it at once.
    assert main(["train", *ARGS, "train.epochs=1", f"run.dir={run_dir}", "--resume",
                 "--allow-config-change"]) == 0
    assert json.loads((run_dir / lock.LOCK_NAME).read_text())["pid"] == os.getpid()


def test_resume_into_a_directory_of_foreign_files_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("lr: 0.1\n")
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    for flags, says in ((["--resume"], "did not write"), ([], "already holds a run")):
        assert main(["train", *ARGS, "train.epochs=1", "train.max_steps=2",
                     f"run.dir={run_dir}", *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
        assert ("config.yaml" in err and "metrics.jsonl" in err) or says != "did not write", err
    assert (run_dir / "config.yaml").read_text() == "lr: 0.1\n"  # nothing overwritten
    assert (run_dir / "metrics.jsonl").read_text() == '{"epoch": 1, "acc": 0.5}\n'


def test_the_holder_is_named_even_before_it_wrote_itself(tmp_path):
    (tmp_path / lock.LOCK_NAME).write_text("")  # locked, its pid not written yet
    assert "another process" in lock.holder(tmp_path)
