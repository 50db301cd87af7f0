"""``ironloop doctor CONFIG --resume-check``: a certificate that a crash costs nothing on the
user's own pipeline, or the first thing that a resume does not restore.

Three scratch runs of the config, each a process of its own (resume_record.py), in a temporary
directory (never run.dir):

    straight   N optimizer steps, uninterrupted, checkpoints every E steps
    crashed    the same, killed by fault.crash_at_step=K (os._exit: nothing more is written)
    resumed    a NEW process: --resume from the crashed run's last checkpoint (step C < K)

The first two run side by side. Then, step by step, the crashed run against the straight one
(two fresh processes must agree before any crash, or the run is not reproducible at all), the
resumed run against the straight one from step C + 1 (the batch each step saw, its losses,
the modules' outputs, the weights after it), the two last checkpoints key by key, and what each
process held outside the checkpoint (module, dataset and callback attributes, the user's
module globals). The first difference is reported with its likely cause and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ironloop.config import Config
from ironloop.errors import CheckpointError, UserError
from ironloop.tools.doctor.findings import Finding
from ironloop.tools.doctor.resume_compare import (
    Difference,
    checkpoint_difference,
    first_step_difference,
    read_records,
    state_differences,
    stateless_callbacks,
    without_unread,
)
from ironloop.tools.doctor.resume_diagnose import findings_for

#: Optimizer steps by default: checkpoints at 8 and 16, a kill at 12, and on the digits config
#: (23 steps an epoch) an epoch boundary crossed, in a few seconds of CPU.
DEFAULT_STEPS = 24


class ResumeCheckError(UserError):
    """A scratch run failed on its own (the config or the user's code), so nothing was
    compared."""


@dataclass(frozen=True)
class CheckPlan:
    """N steps, a checkpoint every E steps, a kill right after step K (not a checkpoint)."""

    steps: int
    every: int
    kill: int

    @property
    def resume_from(self) -> int:
        """The checkpoint the resume starts from: the last one written before the kill (the
        kill comes before step K's own checkpoint would be written)."""
        return self.every * ((self.kill - 1) // self.every)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "checkpoint_every": self.every, "kill_at": self.kill,
                "resumed_from": self.resume_from}


def plan_for(steps: int) -> CheckPlan:
    """Checkpoints every N // 3 steps; the kill half-way between the first two, so that the
    resume redoes steps, then writes and crosses checkpoints of its own."""
    if steps < 3:
        raise UserError(f"--steps {steps}: the resume check needs at least 3 steps (a "
                        f"checkpoint, a kill after it, a step after the resume); pass --steps 3 "
                        f"or more (default {DEFAULT_STEPS})")
    every = max(1, steps // 3)
    return CheckPlan(steps, every, every + max(1, every // 2))


@dataclass
class ResumeCheck:
    """The outcome: ``exact``, the plan, the first difference, the findings."""

    exact: bool
    plan: CheckPlan
    nproc: int
    first: Difference | None
    findings: list[Finding]
    seconds: float
    scratch: str | None = None  # kept when not exact, for a look at the records
    differences: list[Difference] = field(default_factory=list)
    unread: list[Difference] = field(default_factory=list)  # differ, changed no step

    @property
    def headline(self) -> str:
        p = self.plan
        ranks = f", {self.nproc} ranks each checked" if self.nproc > 1 else ""
        what = "resume is exact" if self.exact else "resume is NOT exact"
        return (f"{what} ({p.steps} steps, kill at step {p.kill}, resumed from step "
                f"{p.resume_from} in a new process{ranks})")

    def to_dict(self) -> dict:
        return {"exact": self.exact, **self.plan.to_dict(), "ranks": self.nproc,
                "first_difference": self.first.to_dict() if self.first else None,
                "differences": [d.to_dict() for d in self.differences],
                "unread": [d.to_dict() for d in self.unread],
                "findings": [f.to_dict() for f in self.findings],
                "seconds": round(self.seconds, 3), "scratch": self.scratch}


def scratch_config(cfg: Config, plan: CheckPlan, run_dir: Path, crash: bool) -> dict:
    """The user's config for a scratch run: its own directory, N steps, checkpoints every E,
    nothing sent to trackers, the kill when ``crash``. None of these keys changes the weights
    (state/drift.py FREE), except the run's length, the same in every scratch run."""
    return cfg.with_overrides({
        "run.dir": str(run_dir), "train.max_steps": plan.steps,
        "checkpoint.enabled": True, "checkpoint.every_steps": plan.every,
        "checkpoint.remote": "",  # scratch checkpoints stay local: never the user's bucket
        "log.progress": "off", "log.tensorboard": False, "log.wandb": False,
        "log.mlflow": False, "doctor.preflight": False,
        "fault.crash_at_step": plan.kill if crash else 0,
    }).to_dict()


class Forked:
    """A scratch run forked from this process (resume_record.forked), waited on like a Popen."""

    def __init__(self, spec_path: Path, log_path: Path, threads: int):
        from ironloop.tools.doctor.resume_record import forked

        sys.stdout.flush()  # nothing buffered here may be written twice
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                forked(str(spec_path), str(log_path), threads)
            finally:
                os._exit(70)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, 9)


def _launch(spec: dict, scratch: Path, name: str, nproc: int, env: dict,
            fork_threads: int | None):
    """One scratch run: forked from this process with ``fork_threads`` threads, or started as
    ``python -m`` (under torchrun with ``nproc`` ranks, each rank recording its own file)."""
    spec_path = scratch / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    if fork_threads is not None:
        return Forked(spec_path, scratch / f"{name}.log", fork_threads)
    module = ["-m", "ironloop.tools.doctor.resume_record", str(spec_path)]
    if nproc > 1:
        module = ["-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={nproc}", *module]
    out = open(scratch / f"{name}.log", "w")  # noqa: SIM115 - the child writes it
    try:
        return subprocess.Popen([sys.executable, *module], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    finally:
        out.close()


def _child_env(parallel: int) -> dict:
    """The children's environment: threads split between the processes that run side by side
    (the same count in every scratch run, so the math is the same in all of them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not env.get("OMP_NUM_THREADS", "").isdigit():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
    return env


def fork_threads(cfg: Config, nproc: int, env: dict) -> int | None:
    """The threads of scratch runs forked from this process, or None where they must start as
    new interpreters: under torchrun, without fork, or once CUDA is initialized here (it does
    not survive a fork). A process that imported torch before the check may have run OpenMP
    regions with a team of threads, which GNU OpenMP cannot use again after a fork: its forked
    runs get one thread (as DataLoader workers do). Otherwise the doctor imports what the runs
    import first (torch, the loop, the config's modules), once for the three."""
    if nproc > 1 or not hasattr(os, "fork"):
        return None
    fresh = "torch" not in sys.modules
    from ironloop.tools.doctor.resume_record import warm_imports

    warm_imports(cfg)
    import torch

    if torch.cuda.is_initialized():
        return None
    return int(env["OMP_NUM_THREADS"]) if fresh else 1


def _wait(proc: subprocess.Popen, scratch: Path, name: str, expect: int, plan: CheckPlan) -> None:
    code = proc.wait()
    if code == expect:
        return
    lines = (scratch / f"{name}.log").read_text(errors="replace").strip().splitlines()
    last = lines[-1] if lines else "(no output)"
    if name == "crashed" and code == 0:
        raise ResumeCheckError(f"the scratch run ended before step {plan.kill}, where the check "
                               f"kills it: the config's run is shorter than --steps "
                               f"{plan.steps}; pass a smaller --steps")
    raise ResumeCheckError(f"the resume check's {name} run exited {code}: {last} (its whole "
                           f"output: {scratch / (name + '.log')})")


def run_scratch(cfg: Config, plan: CheckPlan, scratch: Path, callbacks: list[str],
                nproc: int) -> None:
    """The three runs: straight and crashed side by side, then the resume in a new process."""
    def spec(name: str, crash: bool, resume: bool, run: str) -> dict:
        return {"config": scratch_config(cfg, plan, scratch / run, crash),
                "record": str(scratch / f"{name}-rank{{rank}}.jsonl"),
                "callbacks": callbacks, "resume": resume}

    env = _child_env(parallel=2 * nproc)
    threads = fork_threads(cfg, nproc, env)

    def launch(name: str, crash: bool, resume: bool, run: str):
        return _launch(spec(name, crash, resume, run), scratch, name, nproc, env, threads)

    runs = [launch("straight", False, False, "straight"), launch("crashed", True, False,
                                                                 "crashed")]
    try:
        _wait(runs[1], scratch, "crashed", 1, plan)  # os._exit(1): fault.crash_at_step
        _wait(runs[0], scratch, "straight", 0, plan)
        runs.append(launch("resumed", False, True, "crashed"))  # the crashed run's directory
        _wait(runs[2], scratch, "resumed", 0, plan)
    finally:  # an error or Ctrl-C here: no scratch run outlives the check
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def compare_rank(scratch: Path, plan: CheckPlan, rank: int) -> list[Difference]:
    """Every difference found for one rank, the first one first."""
    straight = read_records(scratch / f"straight-rank{rank}.jsonl")
    crashed = read_records(scratch / f"crashed-rank{rank}.jsonl")
    resumed = read_records(scratch / f"resumed-rank{rank}.jsonl")
    last = max(straight.steps, default=0)
    if last < plan.steps:
        raise ResumeCheckError(f"the scratch run took {last} steps, fewer than the check's "
                               f"{plan.steps}: the config's run is shorter; pass --steps {last}")
    fresh = first_step_difference(straight.steps, crashed.steps, range(1, plan.kill))
    if fresh is not None:
        fresh.what = f"fresh {fresh.what}"  # before any crash: not reproducible at all
        return [fresh]
    found = [d for d in [first_step_difference(straight.steps, resumed.steps,
                                               range(plan.resume_from + 1, plan.steps + 1)),
                         _checkpoints(scratch)] if d is not None]
    return found + state_differences(straight.state, resumed.state)


def _checkpoints(scratch: Path) -> Difference | None:
    from ironloop.state.checkpointer import Checkpointer
    from ironloop.state.dcp import is_sharded
    from ironloop.state.run_dir import RunDir

    def last(run: str) -> dict | None:
        try:
            found = Checkpointer(RunDir(scratch / run)).latest()
        except CheckpointError:  # every one damaged: the per-step records said where
            return None
        # a sharded (DCP) one holds this rank's extras only: its weights were compared per step
        return found.state if found is not None and not is_sharded(found.path) else None

    a, b = last("straight"), last("crashed")
    if a is None or b is None:  # sharded (DCP) checkpoints: the weights were compared per step
        return None
    key = checkpoint_difference(a, b)
    return None if key is None else Difference(0, "checkpoint", f"the last checkpoints differ "
                                               f"at {key}")


def resume_check(cfg: Config, steps: int = DEFAULT_STEPS, callbacks: list[str] | None = None,
                 nproc: int = 1, scratch_root: Path | None = None) -> ResumeCheck:
    """Run the check on ``cfg`` (its model.name and data.name are built in each process, as
    ``ironloop train`` builds them); ``callbacks`` are 'module:Class' specs built in each
    process too. The scratch runs go to a new directory in ``scratch_root`` (default: the
    system's temporary directory), removed when the resume is exact and kept, for a look at the
    records and logs, when it is not. Raises ResumeCheckError when a scratch run fails on its
    own."""
    plan = plan_for(steps)
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: the scratch runs need at least 1 process; pass "
                        f"--nproc 1 (the default) or the ranks the run trains on")
    started = time.perf_counter()
    if scratch_root is not None:
        Path(scratch_root).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ironloop-resume-check-", dir=scratch_root))
    try:
        run_scratch(cfg, plan, scratch, list(callbacks or []), nproc)
        differences, unread = without_unread(earliest_first([
            d for rank in range(nproc) for d in _ranked(compare_rank(scratch, plan, rank), rank,
                                                         nproc)]))
        state = read_records(scratch / "straight-rank0.jsonl").state
    except BaseException:
        print(f"resume check: scratch runs kept in {scratch}", file=sys.stderr)
        raise
    exact = not differences
    if exact:
        shutil.rmtree(scratch, ignore_errors=True)
    result = ResumeCheck(exact, plan, nproc, differences[0] if differences else None, [],
                         time.perf_counter() - started, None if exact else str(scratch),
                         differences, unread)
    result.findings = findings_for(result.headline, differences, plan.resume_from, plan.steps,
                                   stateless_callbacks(state), unread)
    return result


#: At one step, what differs first: the batch makes the loss differ, the loss the weights (and
#: under DDP one rank's batch makes every rank's weights differ).
ORDER = ("batch", "loss", "weights", "steps")


def earliest_first(found: list[Difference]) -> list[Difference]:
    """The ranks' differences by step (the end of the run last), then by what comes first."""
    def key(d: Difference) -> tuple:
        what = d.what.removeprefix("fresh ")
        return (d.step == 0, d.step, ORDER.index(what) if what in ORDER else len(ORDER))
    return sorted(found, key=key)


def _ranked(found: list[Difference], rank: int, nproc: int) -> list[Difference]:
    if nproc > 1:
        for d in found:
            d.detail = f"rank {rank}: {d.detail}"
    return found


def doctor_resume_check(cfg: Config, steps: int = DEFAULT_STEPS, nproc: int = 1,
                        callbacks: list[str] | None = None) -> ResumeCheck:
    """``ironloop doctor CONFIG --resume-check``: print the verdict and put it under
    ``resume_check`` in run.dir/doctor.json (the other checks' findings there stay)."""
    plan = plan_for(steps)
    print(f"resume check: {plan.steps} steps with a checkpoint every {plan.every}, killed after "
          f"step {plan.kill} and resumed in a new process, against an uninterrupted run "
          f"(scratch runs in a temporary directory)...", flush=True)
    result = resume_check(cfg, steps, callbacks, nproc)
    lines = [f.render() for f in result.findings]
    if result.scratch:
        lines.append(f"    the scratch runs' records and logs: {result.scratch}")
    print("\n".join(lines) + f"\n({result.seconds:.1f} s; written to "
          f"{Path(cfg.run.dir) / 'doctor.json'})", flush=True)
    write_entry(Path(cfg.run.dir) / "doctor.json", result.to_dict())
    return result


def write_entry(path: Path, entry: dict) -> None:
    """doctor.json with ``resume_check`` set to ``entry``, whatever else it held kept."""
    from ironloop.state.io import write_atomic
    from ironloop.state.prepare import unwritable

    try:
        held = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        held = {}  # a torn doctor.json is ours to rewrite: the doctor writes it atomically
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**held, "resume_check": entry}, indent=2) + "\n")
    except OSError as e:
        raise unwritable(path.parent, e) from e
