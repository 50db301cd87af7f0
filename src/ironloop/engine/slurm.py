"""SLURM: what a stop under a SLURM job means, and the requeue SLURM would not do itself.

A signal ends the run at a step, with a checkpoint (engine/preempt.py, exit 75). Under a SLURM
job that signal has one of three causes, and the scheduler says which (``scontrol show job``):

* a **time limit** near: the job is RUNNING (or SIGNALING) and its EndTime is at most
  ``TIME_LIMIT_WINDOW_S`` away (the ``--signal=...@T`` warning comes T seconds before the
  limit, up to 60 s earlier);
* a **preemption** by a job of a higher PriorityTier: RUNNING, with a PreemptTime;
* a user's **scancel**: the job is already COMPLETING or CANCELLED (any other state: the job is
  ending on its own, e.g. killed at its time limit without a warning signal, too late to
  requeue);
* a **requeue** SLURM did itself (a user's ``scontrol requeue``, PreemptMode=REQUEUE at the end
  of a GraceTime): COMPLETING as after a scancel, but its ``Restarts`` count is past the one
  this attempt started with (``SLURM_RESTART_COUNT``).

For the first two the run must go on later, and SLURM would not requeue it: a job that exits by
itself ends FAILED whatever ``--requeue`` says, and one that exits within a preemption's
GraceTime is not requeued either. So rank 0 runs ``scontrol requeue`` (``checkpoint.
slurm_requeue``); the requeued attempt resumes with ``--resume``. Not for a time limit whose
attempt trained fewer than ``checkpoint.slurm_min_steps`` steps: a warning that lands while the
run starts (a time limit too close to the signal's lead) would land there again in every
attempt, each one a start-up for a step or two, forever. A scancel, or a signal the scheduler
does not explain (a ``kill`` by hand, ``scancel --signal``), stops the run without a requeue. A
crash or a user error never gets here: only a checkpointed stop does.

``adopt_step_env`` lets ``srun --ntasks=N ironloop train`` run DDP without torchrun: it sets the
variables torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) from SLURM's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ironloop.errors import Preempted, StoppedInSetup
from ironloop.outputs.readers import read_jsonl
from ironloop.state.run_dir import RunDir  # no torch: the CLI imports this module before it

#: a signal this close to the time limit is the limit's warning (SLURM sends it up to 60 s
#: before the ``--signal`` lead asked for, and leads of a few minutes are the common choice)
TIME_LIMIT_WINDOW_S = 900.0
#: a job still running: SIGNALING while SLURM delivers the warning signal
RUNNING = ("RUNNING", "SIGNALING")
SCONTROL_TIMEOUT_S = 30.0  # a busy slurmctld answers in well under a second
PORT_BASE = 20000  # MASTER_PORT = PORT_BASE + job id % 10000: two jobs on a node rarely collide


@dataclass(frozen=True)
class Decision:
    """What a checkpointed stop under SLURM means, and whether the job goes back in the queue."""

    cause: str  # "time limit", "preemption", "requeue", "scancel", "ending" or "unexplained"
    requeue: bool  # the job goes back in the queue (for "requeue": SLURM put it there)
    why: str  # what the scheduler said, for the console and events.jsonl
    fix: str = ""  # for a job not requeued: what to do instead of --resume, where it differs


class EarlySignals:
    """The signal handler from the CLI's start to the loop's (engine/preempt.py): SLURM's
    warning signal may come while torch loads and the run is built (it is sent up to 60 s
    early, so a requeued attempt can get it at once), and SIGUSR1's default action would kill
    the process, with nothing saved and no requeue. Kept here, it stops the run at its first
    step, with a checkpoint, as any stop does."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # Ctrl-C (SIGINT) still interrupts at once

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # time.time() of the first

    def __call__(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.time()

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self)


class SetupSignals:
    """Outside SLURM, the signal handler from the CLI's start to the loop's: a SIGTERM or
    SIGUSR1 while torch loads and the run is built stops it at once with a line that says so
    (``StoppedInSetup``), where the default action killed the process without a word. The
    exception unwinds like Ctrl-C's: run.dir's lock gives back what a run that never claimed it
    had created, and a temporary file is removed. Under SLURM ``EarlySignals`` keeps the signal
    instead (a requeued job must save a checkpoint and requeue)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # Ctrl-C (SIGINT) raises KeyboardInterrupt

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __call__(self, signum: int, frame) -> None:
        if os.getpid() != self.pid:  # a forked child (a loader worker): the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise StoppedInSetup(signal.Signals(signum).name, signum)

    def install(self) -> dict:
        """Install it; returns the handlers it replaced (``restore`` puts them back)."""
        return {sig: signal.signal(sig, self) for sig in self.SIGNALS}


def restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def job_id() -> str | None:
    """The SLURM job this process belongs to, if any."""
    return os.environ.get("SLURM_JOB_ID") or None


def show_job(job: str) -> dict[str, str]:
    """``scontrol show job``'s key=value fields; empty if scontrol fails or is missing."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                             text=True, timeout=SCONTROL_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _epoch(stamp: str) -> float | None:
    """scontrol's local-time stamp (2026-11-26T17:25:29) as seconds, or None (None, Unknown)."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def decide(fields: dict[str, str], now: float, requeue: bool, restarts: int = 0) -> Decision:
    """The cause of a stop from ``scontrol show job``'s fields at the moment of the stop;
    ``restarts``: the job's requeue count when this attempt started (SLURM_RESTART_COUNT).

    Pure: the caller reads the scheduler and the clock."""
    state = fields.get("JobState", "")
    if not fields:
        return Decision("unexplained", False, "scontrol show job did not answer")
    seen = _count(fields.get("Restarts"))
    if state not in RUNNING and seen > restarts:
        # requeued during this attempt: COMPLETING (Reason=None) as after a scancel, but
        # SLURM counted the requeue at once (seen on the test cluster: Restarts 0 -> 1)
        return Decision("requeue", True, f"the job is {state}, requeued by SLURM: Restarts "
                                         f"{restarts} -> {seen}")
    if state not in RUNNING:
        # scancel turns a job COMPLETING at once, CANCELLED soon after; a job killed at its
        # time limit (no warning signal came) is COMPLETING for its TimeLimit reason
        reason = fields.get("Reason", "None")
        cause = "scancel" if state in ("COMPLETING", "CANCELLED") and reason == "None" \
            else "ending"
        return Decision(cause, False, f"the job is {state}" +
                        (f" for {reason}" if reason != "None" else ""))
    if _epoch(fields.get("PreemptTime", "None")) is not None:
        cause, why = "preemption", f"preempted at {fields['PreemptTime']}"
    else:
        end = _epoch(fields.get("EndTime", ""))
        left = None if end is None else end - now
        if left is None or left > TIME_LIMIT_WINDOW_S:
            return Decision("unexplained", False, "no time limit near, not preempted, "
                            "not cancelled")
        cause, why = "time limit", f"{max(0, round(left))} s to the time limit"
    if not requeue:
        return Decision(cause, False, why + "; checkpoint.slurm_requeue=false")
    return Decision(cause, True, why)


def held_back(decision: Decision, trained: int | None, min_steps: int,
              warned: str = "") -> Decision:
    """A time limit's requeue, held back when this attempt trained fewer than ``min_steps``
    steps (``checkpoint.slurm_min_steps``; 0: never held back; ``trained`` None: not known).
    The warning then came while the run started, and it would again in every attempt: the
    time limit is too close to the signal's lead. ``warned``: when it came, for the fix. Pure."""
    if decision.cause != "time limit" or not decision.requeue or trained is None or \
            trained >= min_steps:
        return decision
    steps = f"{trained} step{'' if trained == 1 else 's'}"
    return Decision(decision.cause, False,
                    f"{decision.why}; no progress: this attempt trained {steps}, fewer than "
                    f"checkpoint.slurm_min_steps={min_steps}",
                    f"the warning came during start-up{warned}: ask for a time limit (--time) "
                    f"longer than the signal's lead (--signal=USR1@T; it comes up to 60 s "
                    f"before T) plus the start-up and some steps, or a shorter T; then "
                    f"resubmit the job, which continues with --resume")


def after_stop(run_dir: Path, stop: Preempted, requeue: bool, min_steps: int = 0) -> None:
    """Rank 0, after a checkpointed stop under a SLURM job: decide, say it in one console line
    and in events.jsonl, and requeue the job where the decision says so."""
    job = job_id()
    if job is None or os.environ.get("RANK", "0") != "0":
        return
    fields = show_job(job)
    now = time.time()
    decision = decide(fields, now, requeue and stop.saved,
                      _count(os.environ.get("SLURM_RESTART_COUNT")))
    trained = None if (start := _started_at(run_dir)) is None else stop.step - start
    decision = held_back(decision, trained, min_steps, _warned(fields, stop.signalled_at))
    _event(run_dir, {"event": "slurm_stop", "job": job, "signal": stop.signal_name,
                     "signalled_at": stop.signalled_at, "step": stop.step,
                     "cause": decision.cause, "why": decision.why,
                     "requeue": decision.requeue, "restarts": _count(fields.get("Restarts")),
                     "trained": trained})
    head = f"ironloop: SLURM job {job}: {decision.cause} ({decision.why})"
    if decision.cause == "requeue":  # SLURM requeued it already: nothing to run
        print(f"{head}: requeued; it resumes from step {stop.step}", flush=True)
        return
    if not decision.requeue:
        print(f"{head}: not requeued; {decision.fix or 'continue it with --resume'}",
              flush=True)
        return
    # The requeue ends this job at once, SIGTERM to every process: this one has its checkpoint
    # and only the record of the requeue left to write, so it lets the signal pass.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    error = _requeue(job)
    _event(run_dir, {"event": "slurm_requeue", "job": job, "ok": error is None,
                     **({"error": error} if error else {})})
    if error is None:
        print(f"{head}: requeued; it resumes from step {stop.step}", flush=True)
    else:
        print(f"{head}: scontrol requeue failed ({error}); resubmit the job to continue from "
              f"step {stop.step}", flush=True)


def _count(text: str | None) -> int:
    """A count SLURM wrote (Restarts, SLURM_RESTART_COUNT); 0 when missing or not a number."""
    return int(text) if text and text.isascii() and text.isdigit() else 0


def _started_at(run_dir: Path) -> int | None:
    """The step this attempt started from: events.jsonl's last ``start`` line (every start
    writes one, after the resume found its step); None when there is none."""
    starts = [e.get("step") for e in read_jsonl(RunDir(run_dir).log("events"))
              if e.get("event") == "start"]
    return starts[-1] if starts and isinstance(starts[-1], int) else None


def _warned(fields: dict[str, str], signalled_at: float | None) -> str:
    """When the warning came, as the fix names it: ``" (12 s after this attempt started, 48 s
    before its 60 s time limit)"``, or "" where the scheduler or the signal did not say."""
    start, end = _epoch(fields.get("StartTime", "")), _epoch(fields.get("EndTime", ""))
    if start is None or end is None or signalled_at is None:
        return ""
    return (f" ({max(0, round(signalled_at - start))} s after this attempt started, "
            f"{max(0, round(end - signalled_at))} s before its {round(end - start)} s time "
            f"limit)")


def _requeue(job: str) -> str | None:
    """``scontrol requeue JOB``; the error it printed, or None."""
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                           timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def _event(run_dir: Path, row: dict) -> None:
    """One line in events.jsonl; the run's log is closed by now, so it is appended here."""
    try:
        with open(RunDir(run_dir).log("events"), "a") as f:
            f.write(json.dumps({**row, "time": time.time()}) + "\n")
    except OSError as e:  # the stop is saved: a log line must not turn it into a crash
        print(f"ironloop: warning: could not write events.jsonl ({e})", flush=True)


def adopt_step_env(environ: dict | None = None) -> None:
    """Inside an ``srun`` step of several tasks, set torchrun's variables from SLURM's, so that
    each task joins the process group as a torchrun rank would. Variables already set win."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env or "RANK" in env:
        return
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if tasks <= 1:
        return
    per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", "")) or \
        re.match(r"\d+", env.get("SLURM_TASKS_PER_NODE", ""))
    env.setdefault("MASTER_ADDR", _first_node(env.get("SLURM_STEP_NODELIST")
                                              or env.get("SLURM_JOB_NODELIST", "")))
    env.setdefault("MASTER_PORT", str(PORT_BASE + int(env.get("SLURM_JOB_ID", 0)) % 10000))
    env.update({"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(tasks),
                "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": per_node.group() if per_node else str(tasks)})


def _first_node(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[01-04],gpu7``): rank 0's, the rendezvous."""
    if not re.search(r"[\[,]", nodelist):
        return nodelist or "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=SCONTROL_TIMEOUT_S).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return out[0] if out else "127.0.0.1"
