"""ironloop under a real SLURM (engine/slurm.py, examples/slurm/train.sbatch).

The decision is tested first as the pure function it is. Then the shipped template meets a real
one-node cluster (scripts/slurm-up; tests/slurm_cluster.py): a time limit in each of the three
signal forms, a preemption, a scancel, two DDP ranks through srun, a crash, a bad key, a
requeue that resumes from S3, a warning during start-up and a requeue by hand run side by side
(``scenarios``, one pass). The runs read slowly
(examples/slow_reads.py: a sleep per sample), so they take wall time without taking the 2
cores, and each attempt under ``--time=1`` is cut by its warning signal. Asserted: job states,
requeue counts, events.jsonl and torch.equal weights and optimizer state; the timings are
printed, never asserted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ironloop.engine.preempt import Preemption
from ironloop.engine.slurm import Decision, EarlySignals, adopt_step_env, after_stop, decide
from ironloop.errors import Preempted
from tests import slurm_cluster as sc
from tests.conftest import REPO

# measured speed or timed signals: never beside the other (tests/conftest.py cpu_alone)
pytestmark = pytest.mark.usefixtures("cpu_alone")

# ------------------------------------------------------------------------ the decision --
NOW = time.mktime(time.strptime("2026-11-26T17:00:00", "%Y-%m-%dT%H:%M:%S"))


def fields(state="RUNNING", end="2026-11-26T17:00:40", preempt="None", reason="None") -> dict:
    return {"JobState": state, "EndTime": end, "PreemptTime": preempt, "Reason": reason,
            "Restarts": "0"}


def test_a_signal_near_the_time_limit_requeues():
    assert decide(fields(), NOW, True) == Decision("time limit", True, "40 s to the time limit")
    # SIGNALING: SLURM is delivering the warning signal
    assert decide(fields(state="SIGNALING"), NOW, True).requeue


def test_a_preemption_requeues_whatever_time_is_left():
    got = decide(fields(end="2026-11-27T17:00:00", preempt="2026-11-26T16:59:58"), NOW, True)
    assert (got.cause, got.requeue) == ("preemption", True)


def test_a_scancel_never_requeues():
    for state in ("COMPLETING", "CANCELLED"):
        assert decide(fields(state=state), NOW, True) == \
            Decision("scancel", False, f"the job is {state}")


def test_a_signal_the_scheduler_does_not_explain_stops_without_a_requeue():
    got = decide(fields(end="2026-11-26T19:00:00"), NOW, True)
    assert (got.cause, got.requeue) == ("unexplained", False)
    # scontrol did not answer
    assert decide({}, NOW, True) == \
        Decision("unexplained", False, "scontrol show job did not answer")


def test_a_job_that_is_no_longer_running_ends_without_a_requeue_naming_its_reason():
    # killed at its time limit without a warning signal: COMPLETING for TimeLimit
    assert decide(fields(state="COMPLETING", reason="TimeLimit"), NOW, True) == \
        Decision("ending", False, "the job is COMPLETING for TimeLimit")
    assert decide(fields(state="FAILED"), NOW, True) == \
        Decision("ending", False, "the job is FAILED")
    # no Reason field at all reads as scontrol's "None": a scancel
    assert decide({"JobState": "CANCELLED"}, NOW, True) == \
        Decision("scancel", False, "the job is CANCELLED")


def test_the_time_limit_window_is_15_minutes_inclusive_and_a_passed_limit_is_0_s():
    at_edge = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW + 900))
    assert decide(fields(end=at_edge), NOW, True) == \
        Decision("time limit", True, "900 s to the time limit")
    past_edge = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW + 901))
    assert decide(fields(end=past_edge), NOW, True).cause == "unexplained"
    assert decide(fields(end="2026-11-26T16:59:50"), NOW, True) == \
        Decision("time limit", True, "0 s to the time limit")
    assert decide({"JobState": "RUNNING"}, NOW, True) == Decision(
        "unexplained", False, "no time limit near, not preempted, not cancelled")


def test_a_preemption_is_named_with_its_time_and_kept_when_requeue_is_off():
    got = decide(fields(preempt="2026-11-26T16:59:58"), NOW, False)
    assert got == Decision("preemption", False,
                           "preempted at 2026-11-26T16:59:58; checkpoint.slurm_requeue=false")
    assert decide(fields(preempt="2026-11-26T16:59:58"), NOW, True) == \
        Decision("preemption", True, "preempted at 2026-11-26T16:59:58")


def test_slurm_requeue_false_keeps_the_cause_and_does_not_requeue():
    got = decide(fields(), NOW, False)
    assert (got.cause, got.requeue) == ("time limit", False)
    assert "checkpoint.slurm_requeue=false" in got.why


def test_an_srun_step_of_two_tasks_becomes_torchrun_ranks():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "42",
           "SLURM_STEP_NODELIST": "vm"}
    adopt_step_env(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "vm", "MASTER_PORT": "20042"}
    torchrun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
                "RANK": "3"}
    adopt_step_env(torchrun)  # torchrun inside an allocation: its variables stand
    assert torchrun["RANK"] == "3" and "WORLD_SIZE" not in torchrun


def test_a_step_of_one_task_or_of_an_unknown_count_stays_a_single_process():
    for tasks in ({}, {"SLURM_STEP_NUM_TASKS": "1"}, {"SLURM_NTASKS": "1"}):
        env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", **tasks}
        adopt_step_env(env)
        assert "RANK" not in env and "MASTER_ADDR" not in env
    no_step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # sbatch's script, not an srun step
    adopt_step_env(no_step)
    assert "RANK" not in no_step


def test_an_srun_step_falls_back_to_the_jobs_task_count_nodes_and_tasks_per_node():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "solo",
           "MASTER_PORT": "1234"}
    adopt_step_env(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "solo", "MASTER_PORT": "1234"}  # a port already set wins
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_NTASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_TASKS_PER_NODE": "4(x2)"}
    adopt_step_env(step)  # the step's own counts win over the job's
    assert (step["WORLD_SIZE"], step["LOCAL_WORLD_SIZE"]) == ("4", "2")
    bare = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3"}
    adopt_step_env(bare)
    assert (bare["LOCAL_WORLD_SIZE"], bare["MASTER_ADDR"], bare["MASTER_PORT"]) == \
        ("3", "127.0.0.1", "20000")


def test_a_warning_signal_while_the_run_is_built_stops_it_at_its_first_step():
    before = {sig: signal.getsignal(sig) for sig in EarlySignals.SIGNALS}
    try:
        EarlySignals().install()
        os.kill(os.getpid(), signal.SIGUSR1)  # would kill the process with the default action
        with Preemption(distributed=False) as stop:
            assert stop.should_stop()
            assert stop.stopped(1, True).signal_name == "SIGUSR1"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)



def fake_scontrol(bin_dir: Path, show: str) -> None:
    """A ``scontrol`` on PATH: ``show job`` prints ``show``; ``requeue`` succeeds."""
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = requeue ] && exit 0\necho '{show}'\n")
    script.chmod(0o755)


def stop_under_slurm(tmp_path: Path, monkeypatch, show: str, requeue: bool = True,
                     saved: bool = True) -> list[dict]:
    """``after_stop`` of a (saved) SIGUSR1 stop at step 7 of job 42; the events it wrote."""
    fake_scontrol(tmp_path / "bin", show)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("RANK", raising=False)  # no torchrun: this process is rank 0
    stop = Preempted("SIGUSR1", 7, saved=saved)
    before = {sig: signal.getsignal(sig) for sig in EarlySignals.SIGNALS}
    try:  # a requeue ignores SIGTERM and SIGUSR1 from here on
        after_stop(tmp_path, stop, requeue=requeue)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return events(tmp_path) if (tmp_path / "events.jsonl").exists() else []


def test_a_stop_outside_torchrun_records_its_cause_and_why_and_the_requeue_of_its_job(
        tmp_path, monkeypatch, capsys):
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 60))
    got = stop_under_slurm(tmp_path, monkeypatch, f"JobId=42 JobState=RUNNING EndTime={end} "
                                                  "PreemptTime=None Restarts=2")
    assert [e["event"] for e in got] == ["slurm_stop", "slurm_requeue"]
    assert got[0]["cause"] == "time limit" and got[0]["why"].endswith("s to the time limit")
    assert (got[0]["job"], got[0]["step"], got[0]["restarts"]) == ("42", 7, 2)
    assert (got[1]["job"], got[1]["ok"]) == ("42", True) and "error" not in got[1]
    out = capsys.readouterr().out
    assert re.fullmatch(r"ironloop: SLURM job 42: time limit \(\d+ s to the time limit\): "
                        r"requeued; it resumes from step 7\n", out), out


def test_a_job_is_requeued_only_with_slurm_requeue_on_and_a_checkpoint_saved(
        tmp_path, monkeypatch, capsys):
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 60))
    show = f"JobId=42 JobState=RUNNING EndTime={end} PreemptTime=None"
    for requeue, saved in ((False, True), (True, False)):
        run_dir = tmp_path / f"{requeue}-{saved}"
        run_dir.mkdir()
        got = stop_under_slurm(run_dir, monkeypatch, show, requeue=requeue, saved=saved)
        assert [(e["event"], e["cause"], e["requeue"]) for e in got] == \
            [("slurm_stop", "time limit", False)]
        assert got[0]["why"].endswith("s to the time limit; checkpoint.slurm_requeue=false")
        assert capsys.readouterr().out.endswith(
            "checkpoint.slurm_requeue=false): not requeued; continue it with --resume\n")


def test_only_rank_0_of_a_slurm_job_decides_and_a_missing_scontrol_is_the_requeue_s_error(
        tmp_path, monkeypatch):
    from ironloop.engine.slurm import _requeue

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("RANK", "1")  # torchrun's rank 1: rank 0 speaks for the job
    after_stop(tmp_path, Preempted("SIGUSR1", 7, saved=True), requeue=True)
    assert not (tmp_path / "events.jsonl").exists()
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert "scontrol" in _requeue("42")  # the OSError's text names what could not run


def test_a_scancel_records_why_it_was_not_requeued(tmp_path, monkeypatch, capsys):
    got = stop_under_slurm(tmp_path, monkeypatch, "JobId=42 JobState=CANCELLED Reason=None")
    assert [(e["event"], e["cause"], e["why"], e["requeue"]) for e in got] == \
        [("slurm_stop", "scancel", "the job is CANCELLED", False)]
    assert capsys.readouterr().out == ("ironloop: SLURM job 42: scancel (the job is CANCELLED): "
                                       "not requeued; continue it with --resume\n")


def test_a_failed_requeue_records_and_prints_what_scontrol_said(tmp_path, monkeypatch, capfd):
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 60))
    fake_scontrol(tmp_path / "bin", f"JobId=42 JobState=RUNNING EndTime={end} PreemptTime=None")
    # scontrol requeue refuses: its stdout and stderr are captured, not the run's console
    (tmp_path / "bin/scontrol").write_text(
        f"#!/bin/sh\nif [ \"$1\" = requeue ]; then echo chatter; echo 'Invalid job id' >&2; "
        f"exit 1; fi\necho 'JobId=42 JobState=RUNNING EndTime={end} PreemptTime=None'\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("RANK", raising=False)
    before = {sig: signal.getsignal(sig) for sig in EarlySignals.SIGNALS}
    try:
        after_stop(tmp_path, Preempted("SIGUSR1", 7, saved=True), requeue=True)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    got = events(tmp_path)
    assert [(e["event"], e.get("ok"), e.get("error")) for e in got] == \
        [("slurm_stop", None, None), ("slurm_requeue", False, "Invalid job id")]
    out, err = capfd.readouterr()
    assert "chatter" not in out and "Invalid job id" not in err
    assert out.endswith("): scontrol requeue failed (Invalid job id); resubmit the job to "
                        "continue from step 7\n")


# --------------------------------------------------------------------- the real cluster --
ARGS = ["examples/slow_reads.yaml", "data.kwargs={n: 512, delay: 0.004}", "log.progress=off",
        "doctor.preflight=false", "log.every_steps=1"]
# >= 70 s of reads: more than two attempts under --time=1 (SLURM sends the @20 warning at its
# first check, every 30 s, from 20 + 30 s before the limit: 10-40 s into a 60 s attempt). How
# far an attempt gets depends on how busy the machine is (ironloop's start takes 3 s idle, 30 s
# at load 14), so each job's time limit is lifted once it has been requeued as often as its test
# asks (``cuts``), and its last attempt runs to the end.
LONG = "train.epochs=30"
SHORT = "train.epochs=10"
# the time-limit jobs' 60 s attempts are often cut while they start on a loaded machine (the 2
# DDP ranks' nearly always), which checkpoint.slurm_min_steps' default rightly does not requeue
# (the no-progress job below): here the requeue itself is under test
ANY_PROGRESS = "checkpoint.slurm_min_steps=0"
FORMS = ("B:TERM@20", "B:USR1@20", "USR1@20")
TIMEOUT = 600.0  # seconds for a pass of side-by-side jobs; about 3 minutes on 2 idle cores
LOW_CPUS = 4  # the preempted job's: the high job asks for what is free plus these


@pytest.fixture(scope="module")
def cluster():
    reason = sc.why_not()
    if reason:
        pytest.skip(reason)
    started = sc.start()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(sc.SLURM_DIR / "slurm.conf")  # scontrol here and in jobs
    yield
    if saved is None:
        del os.environ["SLURM_CONF"]
    else:
        os.environ["SLURM_CONF"] = saved
    if started:
        sc.stop()


def job_env(**more: str) -> dict:
    """What a user's shell would hold: this venv's python on this checkout's source."""
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "IRONLOOP_CMD": f"{sys.executable} -m ironloop", **more}


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged(run_dir: Path) -> int:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() \
        if (run_dir / "metrics.jsonl").exists() else []
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except ValueError:  # a line half written
        return 0


def state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def same_training(a: dict, b: dict) -> bool:
    """Weights and optimizer state, tensor for tensor."""
    def flat(tree, out, key=""):
        if isinstance(tree, dict):
            for k, v in tree.items():
                flat(v, out, f"{key}/{k}")
        elif isinstance(tree, list | tuple):
            for i, v in enumerate(tree):
                flat(v, out, f"{key}/{i}")
        else:
            out[key] = tree
        return out
    x, y = flat({"m": a["model"], "o": a["optimizer"]}, {}), \
        flat({"m": b["model"], "o": b["optimizer"]}, {})
    return x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)


def reference(run_dir: Path, *extra: str) -> Path:
    """An uninterrupted run of the jobs' arguments, the reference their weights must equal: in
    this process (the CLI's main, one intra-op thread, as the jobs' OMP_NUM_THREADS=1), with
    reads that do not wait. examples/slow_reads.py draws the same samples whatever the delay,
    which only sleeps, so the weights and optimizer state are the same; it costs no process
    start and none of the jobs' 70 s of reads (issue 45)."""
    from ironloop.cli import main

    args = ["data.kwargs={n: 512, delay: 0}" if a.startswith("data.kwargs=") else a
            for a in ARGS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.chdir(REPO):
            assert main(["train", *args, *extra, f"run.dir={run_dir}"]) == 0
    finally:
        torch.set_num_threads(threads)
    return run_dir


class Local:
    """An ``ironloop train`` on this machine, outside SLURM (the resume by hand after a
    scancel)."""

    def __init__(self, run_dir: Path, *extra: str, resume: bool = False):
        self.run_dir, self.log = run_dir, run_dir.with_suffix(".log")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ironloop", "train", *ARGS, *extra, f"run.dir={run_dir}",
                 *(["--resume"] if resume else [])], cwd=REPO, env=job_env(), stdout=out,
                stderr=subprocess.STDOUT)

    def done(self) -> bool:
        return self.proc.poll() is not None


class Job:
    """One job of the template and what the driver saw of it."""

    def __init__(self, name: str, tmp: Path, options: list[str], extra: list[str],
                 env: dict | None = None, cuts: int = 0):
        self.name, self.run_dir, self.out = name, tmp / name, tmp / f"{name}.out"
        self.cuts = cuts  # after this many requeues, the time limit is lifted
        self.id = sc.sbatch(*options, args=[*ARGS, *extra, f"run.dir={self.run_dir}"],
                            out=self.out, env=env or job_env())
        self.released: list[float] = []  # when each requeued attempt was let start
        self.pending_since: float | None = None  # when the driver saw it wait on BeginTime
        self.fields: dict = {}

    def ended(self) -> bool:
        self.fields = sc.job(self.id)
        return self.fields["JobState"] in sc.ENDED

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def queue() -> dict[str, tuple[str, str]]:
    """Every job's (state, reason), in one squeue call: the driver polls it often."""
    r = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %T %r"], capture_output=True,
                       text=True, timeout=60)
    return {f[0]: (f[1], f[2]) for f in (line.split() for line in r.stdout.splitlines())}


def drive(jobs: list[Job], on_poll=lambda q: None) -> None:
    """Until every job has ended for good: start each requeued attempt at once, instead of
    after SLURM's ~120 s BeginTime."""
    def poll() -> bool:
        q = queue()
        on_poll(q)
        for j in jobs:
            if q.get(j.id) != ("PENDING", "BeginTime"):
                j.pending_since = None
            elif j.pending_since is None:
                j.pending_since = time.monotonic()
            elif time.monotonic() - j.pending_since > sc.REVOKED_S and sc.release(
                    # after the requeues its test asks for, the next attempt runs to the end
                    j.id, lift=bool(j.cuts) and sc.requeues(j.id) >= j.cuts):
                j.released.append(time.time())
                j.pending_since = float("inf")  # released: once, until it waits again
        if not all(q.get(j.id, ("?",))[0] in sc.ENDED for j in jobs):
            return False
        for j in jobs:
            j.ended()  # reads the final fields
        return True
    sc.wait(poll, "end of every job", TIMEOUT, every=0.5)  # a squeue a poll: not too often


def resumes(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == "resume"]


def timings(job: Job) -> list[str]:
    """Signal to checkpoint (the preemption's record written after the save) and requeue to
    resume (the attempt let start, to its resume record), from events.jsonl."""
    ev = events(job.run_dir)
    stops = [e for e in ev if e["event"] == "slurm_stop"]
    saved = [e for e in ev if e["event"] == "preempted"]
    lines = [f"signal->checkpoint {p['time'] - s['signalled_at']:.2f} s"
             for s, p in zip(stops, saved) if s.get("signalled_at")]
    lines += [f"requeue->resume {r['time'] - t:.1f} s"
              for t, r in zip(job.released, resumes(job.run_dir))]
    return lines


@pytest.fixture(scope="module")
def s3_env():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    import fsspec

    fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=env["AWS_ENDPOINT_URL"],
                      key="testing", secret="testing").mkdir("slurm")
    yield env
    server.stop()


@pytest.fixture(scope="module")
def scenarios(cluster, s3_env, tmp_path_factory):
    """Every scenario in one pass of side-by-side jobs; each test below reads its own. All run
    in the `high` partition but the one that a job of `high` preempts (`low`): it alone can be
    preempted, and only for CPUs nothing else frees."""
    tmp = tmp_path_factory.mktemp("slurm")
    high = ["--partition=high"]
    jobs = {form: Job(f"limit-{form.replace(':', '').replace('@', '-')}", tmp,
                      [*high, "--time=1", f"--signal={form}"], [LONG, ANY_PROGRESS], cuts=2)
            for form in FORMS}
    jobs["ddp-ref"] = Job("ddp-ref", tmp, [*high, "--ntasks=2"], [LONG])
    jobs["ddp"] = Job("ddp", tmp, [*high, "--ntasks=2", "--time=1", "--signal=USR1@20"],
                      [LONG, ANY_PROGRESS], cuts=1)
    jobs["cancel"] = Job("cancel", tmp, high, [SHORT])
    jobs["crash"] = Job("crash", tmp, high, [SHORT, "fault.crash_at_step=5"])
    jobs["bad-key"] = Job("bad-key", tmp, high, [SHORT, "train.epochz=3"])
    remote = "s3://slurm/run"
    jobs["remote"] = Job("remote", tmp, [*high, "--time=1", "--signal=USR1@20"],
                         [LONG, f"checkpoint.remote={remote}", ANY_PROGRESS],
                         env=job_env(**s3_env), cuts=1)
    jobs["low"] = Job("low", tmp, ["--partition=low", f"--cpus-per-task={LOW_CPUS}"], [SHORT])
    # its warnings sent by hand, as SLURM sends --signal=USR1@T's (to the step's tasks): one
    # after a few steps, one during the next attempt's start-up; SLURM's own comes 2 min in
    jobs["no-progress"] = Job("no-progress", tmp, [*high, "--time=3", "--signal=USR1@1"],
                              [SHORT])
    jobs["by-hand"] = Job("by-hand", tmp, high, [SHORT])  # a user's scontrol requeue
    cancel, low = jobs["cancel"], jobs["low"]
    cancelled, later, preemptor = [], [], []
    warned, requeued = [], []

    def on_poll(q):
        slow, by_hand = jobs["no-progress"], jobs["by-hand"]
        if q[slow.id][0] == "RUNNING" and len(warned) < 2 and (
                slow.text().count("loading torch") == 2 if warned else logged(slow.run_dir) >= 8):
            sc.cancel(slow.id, "--signal=USR1")
            warned.append(True)
        if not requeued and logged(by_hand.run_dir) >= 20:
            subprocess.run(["scontrol", "requeue", by_hand.id], check=True, capture_output=True,
                           timeout=60)
            requeued.append(True)
        if not cancelled and logged(cancel.run_dir) >= 20:
            sc.cancel(cancel.id)  # a user's scancel, plain: no --signal, no --batch
            cancelled.append(True)
        if cancelled and not later and q[cancel.id][0] in sc.ENDED:
            later.append(Local(cancel.run_dir, SHORT, resume=True))  # resumed by hand, later
        if logged(low.run_dir) >= 20 and unpreempted(q, low, preemptor) and all(
                q[jobs[j].id][0] in sc.ENDED for j in ("crash", "bad-key")):
            preemptor.append(preempt(low, stale=preemptor[-1] if preemptor else None))
        if q[jobs["remote"].id] == ("PENDING", "BeginTime"):
            # a requeued job lands on another node: nothing of run.dir is left there
            shutil.rmtree(jobs["remote"].run_dir, ignore_errors=True)

    drive(list(jobs.values()), on_poll)
    sc.wait(lambda: bool(later) and later[0].done(), "the resume after scancel", TIMEOUT)
    refs = {"long": reference(tmp / "ref-long", LONG), "short": reference(tmp / "ref-short", SHORT)}
    return {"jobs": jobs, "refs": refs, "later": later, "tmp": tmp, "remote": remote,
            "preemptor": sc.job(preemptor[-1])}


ASKED: dict[str, int] = {}  # the CPUs each preemptor asked for, by job id


def unpreempted(q: dict, low: Job, preemptor: list[str]) -> bool:
    """Whether to send a (new) preemptor: the low job runs, SLURM has not decided to preempt it,
    no other job waits to start (one the driver releases would take the CPUs counted as free),
    and the last preemptor, if any, waits for more CPUs than preempting the low job would free:
    a job started after it was sent and took CPUs it had counted as free (seen in CI)."""
    if q[low.id][0] != "RUNNING" or any(
            state == "PENDING" for job_id, (state, _) in q.items() if job_id not in preemptor):
        return False
    if preemptor and (q.get(preemptor[-1], ("",))[0] != "PENDING"
                      or ASKED[preemptor[-1]] <= free_cpus() + LOW_CPUS):
        return False  # it ran, or preempting the low job still lets it run
    return sc.job(low.id)["PreemptTime"] == "None"


def free_cpus() -> int:
    node = subprocess.run(["scontrol", "-o", "show", "node"], capture_output=True, text=True,
                          check=True).stdout
    return int(re.search(r"CPUTot=(\d+)", node)[1]) - int(re.search(r"CPUAlloc=(\d+)", node)[1])


def preempt(low: Job, stale: str | None = None) -> str:
    """Submit a job to `high` that needs every free CPU and the low job's too; ``stale``, an
    earlier one that can no longer start by preempting the low job alone, is cancelled."""
    if stale:
        sc.cancel(stale)
    free = free_cpus()
    r = subprocess.run(["sbatch", "--parsable", "--partition=high",
                        f"--cpus-per-task={free + LOW_CPUS}", f"--output={low.out}.high",
                        "--wrap=true"], env=job_env(), capture_output=True, text=True,
                       check=True)
    ASKED[r.stdout.strip()] = free + LOW_CPUS
    return r.stdout.strip()


def assert_requeued_and_exact(job: Job, ref: Path, at_least: int) -> None:
    out = job.text()
    assert job.fields["JobState"] == "COMPLETED", out[-3000:]
    assert int(job.fields["Restarts"]) >= at_least, out[-3000:]
    ev = events(job.run_dir)
    stops = [e for e in ev if e["event"] == "slurm_stop"]
    assert stops and all(e["requeue"] for e in stops), stops
    assert all(e["ok"] for e in ev if e["event"] == "slurm_requeue")
    saved = [e["step"] for e in ev if e["event"] == "preempted"]
    assert [s["step"] for s in stops] == saved  # each decision after its checkpoint
    resumed = resumes(job.run_dir)
    assert [r["step"] for r in resumed[-len(saved):]] == saved  # from the step it stopped at
    assert all(r["steps_redone"] == 0 for r in resumed)
    assert same_training(state(job.run_dir), state(ref))
    print(f"{job.name}: {len(saved)} requeues; " + "; ".join(timings(job)))


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_a_time_limit_checkpoints_requeues_and_completes_exactly(scenarios, form):
    job = scenarios["jobs"][form]
    assert_requeued_and_exact(job, scenarios["refs"]["long"], at_least=2)
    assert {e["cause"] for e in events(job.run_dir) if e["event"] == "slurm_stop"} == \
        {"time limit"}


@pytest.mark.slow
def test_two_ddp_ranks_through_srun_save_the_same_step_and_complete_exactly(scenarios):
    job, ref = scenarios["jobs"]["ddp"], scenarios["jobs"]["ddp-ref"]
    assert ref.fields["JobState"] == "COMPLETED", ref.text()[-3000:]
    assert_requeued_and_exact(job, ref.run_dir, at_least=1)
    # at each stop, both ranks exited with the preemption's code (srun names them together,
    # "tasks 0-1", or one by one)
    named = re.findall(r"tasks? (0-1|\d): Exited with exit code 75", job.text())
    exits = sum(2 if tasks == "0-1" else 1 for tasks in named)
    stops = [e for e in events(job.run_dir) if e["event"] == "slurm_stop"]
    assert exits == 2 * len(stops), job.text()
    assert state(ref.run_dir)["world_size"] == 2


@pytest.mark.slow
def test_a_scancel_checkpoints_ends_cancelled_unrequeued_and_resumes_exactly(scenarios):
    job, later = scenarios["jobs"]["cancel"], scenarios["later"][0]
    assert job.fields["JobState"] == "CANCELLED" and job.fields["Restarts"] == "0"
    stop = [e for e in events(job.run_dir) if e["event"] == "slurm_stop"]
    assert [(e["cause"], e["requeue"]) for e in stop] == [("scancel", False)]
    assert "slurm_requeue" not in {e["event"] for e in events(job.run_dir)}
    assert later.proc.returncode == 0, later.log.read_text()[-3000:]
    assert resumes(job.run_dir)[-1]["step"] == stop[0]["step"]
    assert same_training(state(job.run_dir), state(scenarios["refs"]["short"]))
    print("scancel: " + "; ".join(timings(job)))


@pytest.mark.slow
@pytest.mark.parametrize("name,code", [("crash", "1"), ("bad-key", "2")])
def test_a_crash_or_a_user_error_fails_once_and_is_never_requeued(scenarios, name, code):
    job = scenarios["jobs"][name]
    assert job.fields["JobState"] == "FAILED", job.text()[-3000:]
    assert job.fields["Restarts"] == "0" and job.fields["ExitCode"] == f"{code}:0"
    assert not [e for e in events(job.run_dir) if e["event"].startswith("slurm")]


@pytest.mark.slow
def test_a_requeued_job_on_an_empty_run_dir_resumes_from_the_remote_copy(scenarios):
    job = scenarios["jobs"]["remote"]
    out = job.text()
    assert job.fields["JobState"] == "COMPLETED", out[-3000:]
    requeued = int(job.fields["Restarts"])
    assert requeued >= 1, out[-3000:]
    # run.dir was emptied before each requeued attempt: every resume fetched the remote copy
    # (the events of the stops were written after their save, so only the console keeps them)
    assert out.count(f"fetched {scenarios['remote']}/step-") == requeued, out[-3000:]
    assert out.count("time limit") >= requeued and out.count("): requeued;") == requeued
    assert same_training(state(job.run_dir), state(scenarios["refs"]["long"]))


@pytest.mark.slow
def test_a_warning_during_start_up_is_not_requeued_again_after_an_attempt_without_progress(
        scenarios):
    job = scenarios["jobs"]["no-progress"]
    out = job.text()
    # the first attempt trained its steps and was requeued; the second stopped at its first
    # step, exit 75, and the job ended there instead of starting again
    assert (job.fields["JobState"], job.fields["Restarts"], job.fields["ExitCode"]) == \
        ("FAILED", "1", "75:0"), out[-3000:]
    ev = events(job.run_dir)
    stops = [e for e in ev if e["event"] == "slurm_stop"]
    assert [(e["cause"], e["requeue"]) for e in stops] == \
        [("time limit", True), ("time limit", False)], stops
    assert stops[0]["trained"] >= 8 and stops[1]["trained"] == 1, stops
    assert len([e for e in ev if e["event"] == "slurm_requeue"]) == 1
    held = [line for line in out.splitlines() if "not requeued" in line]
    assert len(held) == 1 and "no progress: this attempt trained 1 step, fewer than " \
        "checkpoint.slurm_min_steps=5): not requeued; the warning came during start-up (" \
        in held[0] and "--signal=USR1@T" in held[0], out[-3000:]
    assert resumes(job.run_dir)[-1]["step"] == stops[0]["step"]


@pytest.mark.slow
def test_a_requeue_by_hand_is_reported_as_a_requeue_and_completes_exactly(scenarios):
    job = scenarios["jobs"]["by-hand"]
    assert_requeued_and_exact(job, scenarios["refs"]["short"], at_least=1)
    stops = [e for e in events(job.run_dir) if e["event"] == "slurm_stop"]
    assert [(e["cause"], e["requeue"]) for e in stops] == [("requeue", True)]
    assert "slurm_requeue" not in {e["event"] for e in events(job.run_dir)}  # SLURM's own
    assert "requeue (the job is COMPLETING, requeued by SLURM: Restarts 0 -> 1): requeued; it " \
        f"resumes from step {stops[0]['step']}" in job.text()


@pytest.mark.slow
def test_a_preempted_low_job_checkpoints_in_its_grace_time_and_completes_exactly(scenarios):
    low = scenarios["jobs"]["low"]
    assert scenarios["preemptor"]["JobState"] == "COMPLETED"
    assert_requeued_and_exact(low, scenarios["refs"]["short"], at_least=1)
    assert {e["cause"] for e in events(low.run_dir) if e["event"] == "slurm_stop"} == \
        {"preemption"}


def test_a_signal_while_the_run_is_built_outside_slurm_stops_it_saying_so():
    from ironloop.engine.slurm import SetupSignals
    from ironloop.errors import StoppedInSetup

    with pytest.raises(StoppedInSetup, match="^stopped by SIGTERM during setup, before the "
                                             "first step: nothing was trained or saved"):
        SetupSignals()(signal.SIGTERM, None)  # in the process that installed it


def test_a_setup_signal_in_a_forked_child_takes_the_default_action_on_itself(monkeypatch):
    """A loader worker forked during setup inherits the handler: it must die of the signal
    as it would have (the default action, re-sent to itself), not raise in the parent's
    place."""
    from types import SimpleNamespace

    from ironloop.engine import slurm

    handler = slurm.SetupSignals()  # installed by this process
    done = []
    monkeypatch.setattr(slurm, "os", SimpleNamespace(getpid=lambda: handler.pid + 1,
                                                     kill=lambda pid, sig: done.append(
                                                         ("kill", pid, sig))))
    monkeypatch.setattr(slurm, "signal", SimpleNamespace(
        SIG_DFL=signal.SIG_DFL, signal=lambda sig, h: done.append(("signal", sig, h))))
    assert handler(signal.SIGTERM, None) is None
    assert done == [("signal", signal.SIGTERM, signal.SIG_DFL),
                    ("kill", handler.pid + 1, signal.SIGTERM)]


def test_the_rendezvous_is_the_first_host_of_the_node_list(tmp_path, monkeypatch):
    from ironloop.engine.slurm import _first_node

    assert _first_node("solo") == "solo" and _first_node("") == "127.0.0.1"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && "
                                      "printf 'node01\\nnode02\\ngpu7\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert _first_node("node[01-02],gpu7") == "node01"
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no scontrol: this host
    assert _first_node("node[01-02]") == "127.0.0.1"


def test_show_job_reads_scontrol_s_fields_and_is_empty_without_scontrol(tmp_path, monkeypatch):
    from ironloop.engine.slurm import _epoch, job_id, show_job

    # one line per job (-o), for the job asked about: anything else prints nothing
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n[ \"$*\" = '-o show job 42' ] && "
        "echo 'JobId=42 JobState=RUNNING Reason=None EndTime=Unknown'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert show_job("42") == {"JobId": "42", "JobState": "RUNNING", "Reason": "None",
                              "EndTime": "Unknown"}
    assert show_job("43") == {}
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert show_job("42") == {}
    assert _epoch("Unknown") is None
    assert _epoch("2026-11-26T17:00:00") == NOW
    monkeypatch.setenv("SLURM_JOB_ID", "")
    assert job_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert job_id() == "7"
