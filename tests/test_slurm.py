"""ironloop under a real SLURM (engine/slurm.py, examples/slurm/train.sbatch).

The decision is tested first as the pure function it is. Then the shipped template meets a real
one-node cluster (scripts/slurm-up; tests/slurm_cluster.py): a time limit in each of the three
signal forms, a scancel, two DDP ranks through srun, a crash, a bad key and a requeue that
resumes from S3 run side by side (``scenarios``, one pass); a preemption follows alone, since a
job of the high partition needs the whole node. The runs read slowly (examples/slow_reads.py:
a sleep per sample), so they take wall time without taking the 2 cores, and each attempt under
``--time=1`` is cut by its warning signal. Asserted: job states, requeue counts, events.jsonl
and torch.equal weights and optimizer state; the timings are printed, never asserted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ironloop.engine.slurm import Decision, adopt_step_env, decide
from tests import slurm_cluster as sc
from tests.conftest import REPO

# ------------------------------------------------------------------------ the decision --
NOW = time.mktime(time.strptime("2026-11-26T17:00:00", "%Y-%m-%dT%H:%M:%S"))


def fields(state="RUNNING", end="2026-11-26T17:00:40", preempt="None", reason="None") -> dict:
    return {"JobState": state, "EndTime": end, "PreemptTime": preempt, "Reason": reason,
            "Restarts": "0"}


def test_a_signal_near_the_time_limit_requeues():
    assert decide(fields(), NOW, True) == Decision("time limit", True, "40 s to the time limit")


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
    assert decide({}, NOW, True).requeue is False  # scontrol did not answer


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


# --------------------------------------------------------------------- the real cluster --
ARGS = ["examples/slow_reads.yaml", "data.kwargs={n: 512, delay: 0.004}", "log.progress=off",
        "doctor.preflight=false", "log.every_steps=1"]
LONG = "train.epochs=50"  # >= 115 s of reads: more than two attempts under --time=1
SHORT = "train.epochs=10"
FORMS = ("B:TERM@10", "B:USR1@10", "USR1@10")  # 10 s: sent 20-50 s into a 60 s attempt
TIMEOUT = 480.0  # seconds for a pass of side-by-side jobs; about 3 minutes on 2 idle cores


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


class Local:
    """An uninterrupted ``ironloop train`` on this machine, the reference."""

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
                 env: dict | None = None):
        self.name, self.run_dir, self.out = name, tmp / name, tmp / f"{name}.out"
        self.id = sc.sbatch(*options, args=[*ARGS, *extra, f"run.dir={self.run_dir}"],
                            out=self.out, env=env or job_env())
        self.released: list[float] = []  # when each requeued attempt was let start
        self.fields: dict = {}

    def ended(self) -> bool:
        self.fields = sc.job(self.id)
        return self.fields["JobState"] in sc.ENDED

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def drive(jobs: list[Job], locals_: list[Local], on_poll=lambda: None) -> None:
    """Until every job has ended for good and every local run has exited: start each requeued
    attempt at once, instead of after SLURM's ~120 s BeginTime."""
    def poll() -> bool:
        on_poll()
        for j in jobs:
            if sc.release(j.id):
                j.released.append(time.time())
        return all(j.ended() for j in jobs) and all(r.done() for r in locals_)
    sc.wait(poll, "end of every job", TIMEOUT)


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
    """Every side-by-side scenario in one pass; each test below reads its own."""
    tmp = tmp_path_factory.mktemp("slurm")
    refs = {"long": Local(tmp / "ref-long", LONG), "short": Local(tmp / "ref-short", SHORT)}
    jobs = {form: Job(f"limit-{form.replace(':', '').replace('@', '-')}", tmp,
                      ["--time=1", f"--signal={form}"], [LONG]) for form in FORMS}
    jobs["ddp-ref"] = Job("ddp-ref", tmp, ["--ntasks=2"], [LONG])
    jobs["ddp"] = Job("ddp", tmp, ["--ntasks=2", "--time=1", "--signal=USR1@10"], [LONG])
    jobs["cancel"] = Job("cancel", tmp, [], [SHORT])
    jobs["crash"] = Job("crash", tmp, ["--time=1"], [SHORT, "fault.crash_at_step=5"])
    jobs["bad-key"] = Job("bad-key", tmp, [], [SHORT, "train.epochz=3"])
    remote = "s3://slurm/run"
    jobs["remote"] = Job("remote", tmp, ["--time=1", "--signal=USR1@10"],
                         [LONG, f"checkpoint.remote={remote}"], env=job_env(**s3_env))
    cancel, cancelled, later = jobs["cancel"], [], []

    def on_poll():
        if not cancelled and logged(cancel.run_dir) >= 20:
            sc.cancel(cancel.id)  # a user's scancel, plain: no --signal, no --batch
            cancelled.append(True)
        if cancelled and not later and cancel.ended():
            later.append(Local(cancel.run_dir, SHORT, resume=True))  # resumed by hand, later
        remote_job = jobs["remote"]
        f = sc.job(remote_job.id)
        if f["JobState"] == "PENDING" and f.get("Reason") == "BeginTime":
            # a requeued job lands on another node: nothing of run.dir is left there
            shutil.rmtree(remote_job.run_dir, ignore_errors=True)

    drive(list(jobs.values()), list(refs.values()), on_poll)
    sc.wait(lambda: bool(later) and later[0].done(), "the resume after scancel", TIMEOUT)
    return {"jobs": jobs, "refs": refs, "later": later, "tmp": tmp, "remote": remote}


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
    assert_requeued_and_exact(job, scenarios["refs"]["long"].run_dir, at_least=2)
    assert {e["cause"] for e in events(job.run_dir) if e["event"] == "slurm_stop"} == \
        {"time limit"}


@pytest.mark.slow
def test_two_ddp_ranks_through_srun_save_the_same_step_and_complete_exactly(scenarios):
    job, ref = scenarios["jobs"]["ddp"], scenarios["jobs"]["ddp-ref"]
    assert ref.fields["JobState"] == "COMPLETED", ref.text()[-3000:]
    assert_requeued_and_exact(job, ref.run_dir, at_least=1)
    # both ranks stopped with the preemption's exit code, at the step the events name
    assert "tasks 0-1: Exited with exit code 75" in job.text()
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
    assert same_training(state(job.run_dir), state(scenarios["refs"]["short"].run_dir))
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
    assert same_training(state(job.run_dir), state(scenarios["refs"]["long"].run_dir))


@pytest.mark.slow
def test_a_preempted_low_job_checkpoints_in_its_grace_time_and_completes_exactly(scenarios,
                                                                                 tmp_path):
    low = Job("low", tmp_path, ["--partition=low"], [SHORT])
    sc.wait(lambda: logged(low.run_dir) >= 20, "step 20 of the low job", TIMEOUT, low.out)
    high = subprocess.run(["sbatch", "--parsable", "--partition=high", "--exclusive",
                           f"--output={tmp_path / 'high.out'}", "--wrap=true"],
                          env=job_env(), capture_output=True, text=True, check=True)
    drive([low], [])
    assert sc.job(high.stdout.strip())["JobState"] == "COMPLETED"
    assert_requeued_and_exact(low, scenarios["refs"]["short"].run_dir, at_least=1)
    assert {e["cause"] for e in events(low.run_dir) if e["event"] == "slurm_stop"} == \
        {"preemption"}
