"""Preemption that reaches the loader workers (issue 29): SIGTERM to the whole process group,
in one process and under torchrun, with 2 loader workers per process, exits 75 with the
checkpoint of the last logged step, 5 of 5. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import forked
from tests.conftest import REPO
from tests.engine.test_preempt import (
    ARGS,
    ENV,
    TIMEOUT,
    ckpt_step,
    events,
    ironloop_lines,
    logged_steps,
    wait_for,
)

pytestmark = pytest.mark.slow

RC = """
import os, sys
from pathlib import Path
from ironloop.cli import main

rc = main(sys.argv[2:])
Path(sys.argv[1], "rc." + os.environ.get("RANK", "0")).write_text(str(rc))
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
"""


def _preempt_once(tmp_path: Path, i: int, torchrun: bool) -> tuple[Path, list[int]]:
    """A run with 2 loader workers per process, SIGTERM to its whole process group (torchrun's
    too) after step 5; returns run.dir and the exit codes of the training processes. The one
    process is a fork of this one (tests/forked.py: no interpreter's and torch's start-up, 5
    times); under torchrun, the ranks are torchrun's."""
    run_dir, log, rcs = tmp_path / f"run{i}", tmp_path / f"run{i}.log", tmp_path / f"rc{i}"
    rcs.mkdir()
    script = tmp_path / "rc.py"
    script.write_text(textwrap.dedent(RC))
    argv = ["train", *ARGS, "data.num_workers=2", "train.epochs=20", "train.batch_size=32",
            f"run.dir={run_dir}"]
    proc: subprocess.Popen | forked.Child
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--standalone"]
        with log.open("w") as out:
            proc = subprocess.Popen([*launcher, str(script), str(rcs), *argv], cwd=REPO,
                                    env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    else:  # the process: a fork of this one, in a session of its own (tests/forked.py)
        proc = forked.fork_main(argv, ENV, log, new_session=True)
    wait_for(lambda: len(logged_steps(run_dir)) >= 5, proc, log, "step 5")
    os.killpg(proc.pid, signal.SIGTERM)  # every process: launcher, ranks, loader workers
    code = proc.wait(timeout=TIMEOUT)
    text = log.read_text()
    # the ranks' exit codes (what the rc script wrote), or the process's own exit status
    codes = [int(p.read_text()) for p in sorted(rcs.iterdir())] if torchrun else [code]
    assert "DataLoader worker" not in text and "ConnectionResetError" not in text, text[-4000:]
    # torchrun prints its own SignalException traceback; one process prints none
    assert torchrun or "Traceback" not in text, text[-4000:]
    assert not [line for line in ironloop_lines(text) if "error" in line.lower()], text[-4000:]
    return run_dir, codes


@pytest.mark.parametrize("torchrun", [False, True], ids=["process_group", "torchrun"])
def test_sigterm_to_the_process_group_with_2_workers_exits_75_redoing_no_step_5_of_5(
        tmp_path, torchrun):
    for i in range(5):
        run_dir, codes = _preempt_once(tmp_path, i, torchrun)
        assert codes == [75] * (2 if torchrun else 1), (i, codes)
        stop = events(run_dir)[-1]
        assert stop["event"] == "preempted" and stop["saved"], (i, stop)
        # the checkpoint is the last step logged: a resume redoes none
        assert ckpt_step(run_dir / "checkpoints" / "last.pt") == stop["step"]
        assert logged_steps(run_dir)[-1] == stop["step"], i
