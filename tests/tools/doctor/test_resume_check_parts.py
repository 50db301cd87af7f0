"""tools.doctor.resume_check's parts in this process: the plan and the verdict, the scratch runs'
configs, specs and launches (new interpreter or fork), their threads, exits and failures, and the
comparison of their records. The real scratch runs: test_resume_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ironloop.errors import UserError
from ironloop.tools.doctor import resume_check as rc, resume_record
from ironloop.tools.doctor.resume_compare import Difference, first_step_difference
from ironloop.tools.doctor.resume_diagnose import DATA
from tests.tools.doctor.resume_helpers import Exited, config, held_state, rec, write_records

# --- resume_check: the plan and the verdict ------------------------------------------------------

def test_the_plan_checkpoints_every_third_of_the_run_and_kills_half_way_to_the_second():
    assert rc.plan_for(3) == rc.CheckPlan(3, 1, 2)
    assert rc.plan_for(5) == rc.CheckPlan(5, 1, 2)
    assert rc.plan_for(6) == rc.CheckPlan(6, 2, 3)
    assert rc.plan_for(11) == rc.CheckPlan(11, 3, 4)
    assert rc.plan_for(24) == rc.CheckPlan(24, 8, 12)
    assert rc.DEFAULT_STEPS == 24
    with pytest.raises(UserError) as e:
        rc.plan_for(2)
    assert str(e.value) == ("--steps 2: the resume check needs at least 3 steps (a checkpoint, a "
                            "kill after it, a step after the resume); pass --steps 3 or more "
                            "(default 24)")


def test_the_resume_starts_from_the_last_checkpoint_written_before_the_kill():
    assert rc.CheckPlan(24, 8, 12).resume_from == 8
    assert rc.CheckPlan(24, 8, 16).resume_from == 8  # killed before step 16's checkpoint
    assert rc.CheckPlan(24, 8, 17).resume_from == 16
    assert rc.CheckPlan(3, 1, 2).resume_from == 1
    assert rc.CheckPlan(24, 8, 12).to_dict() == {"steps": 24, "checkpoint_every": 8,
                                                 "kill_at": 12, "resumed_from": 8}


def test_the_headline_says_exact_or_not_with_the_plan_and_the_ranks():
    plan = rc.CheckPlan(9, 3, 4)
    assert rc.ResumeCheck(True, plan, 1, None, [], 1.0).headline == (
        "resume is exact (9 steps, kill at step 4, resumed from step 3 in a new process)")
    assert rc.ResumeCheck(False, plan, 2, None, [], 1.0).headline == (
        "resume is NOT exact (9 steps, kill at step 4, resumed from step 3 in a new process, "
        "2 ranks each checked)")


def test_the_verdict_is_written_with_the_plan_the_differences_and_the_findings():
    from ironloop.tools.doctor.findings import Finding

    first, unread = Difference(4, "batch", "b"), Difference(0, "model", "m")
    finding = Finding("resume_check", "error", "x", "c", "f")
    result = rc.ResumeCheck(False, rc.CheckPlan(9, 3, 4), 1, first, [finding], 1.23456,
                            "/tmp/s", [first], [unread])
    assert result.to_dict() == {
        "exact": False, "steps": 9, "checkpoint_every": 3, "kill_at": 4, "resumed_from": 3,
        "ranks": 1, "first_difference": {"step": 4, "what": "batch", "detail": "b"},
        "differences": [{"step": 4, "what": "batch", "detail": "b"}],
        "unread": [{"step": 0, "what": "model", "detail": "m"}],
        "findings": [finding.to_dict()], "seconds": 1.235, "scratch": "/tmp/s"}
    exact = rc.ResumeCheck(True, rc.CheckPlan(9, 3, 4), 1, None, [], 0.5)
    assert exact.to_dict()["first_difference"] is None
    assert exact.scratch is None and exact.differences == [] and exact.unread == []


def test_the_differences_go_by_step_then_batch_loss_weights_steps_and_the_end_last():
    found = [Difference(0, "model", "m"), Difference(5, "steps", "s"),
             Difference(5, "weights", "w"), Difference(5, "module", "x"),
             Difference(5, "fresh loss", "l"), Difference(5, "batch", "b"),
             Difference(4, "weights", "w4"), Difference(0, "checkpoint", "c")]
    assert [(d.step, d.what) for d in rc.earliest_first(found)] == [
        (4, "weights"), (5, "batch"), (5, "fresh loss"), (5, "weights"), (5, "steps"),
        (5, "module"), (0, "model"), (0, "checkpoint")]


def test_under_several_ranks_each_difference_names_its_rank():
    one = [Difference(4, "batch", "b")]
    assert rc._ranked(one, 1, 1)[0].detail == "b"
    assert rc._ranked(one, 1, 2)[0].detail == "rank 1: b"


def test_a_scratch_config_is_the_users_with_its_own_dir_length_checkpoints_and_no_trackers(
        tmp_path):
    cfg = config(tmp_path, "log.tensorboard=true", "checkpoint.remote=s3://bucket/x",
                 "checkpoint.every_steps=100", "doctor.preflight=true")
    plan = rc.CheckPlan(9, 3, 4)
    crashed = rc.scratch_config(cfg, plan, tmp_path / "crashed", crash=True)
    assert crashed["run"]["dir"] == str(tmp_path / "crashed")
    assert crashed["train"]["max_steps"] == 9 and crashed["train"]["batch_size"] == 16
    assert crashed["checkpoint"]["enabled"] is True and crashed["checkpoint"]["every_steps"] == 3
    assert crashed["checkpoint"]["remote"] == ""
    assert crashed["log"]["progress"] == "off"
    assert (crashed["log"]["tensorboard"], crashed["log"]["wandb"], crashed["log"]["mlflow"]) \
        == (False, False, False)
    assert crashed["doctor"]["preflight"] is False
    assert crashed["fault"]["crash_at_step"] == 4
    straight = rc.scratch_config(cfg, plan, tmp_path / "straight", crash=False)
    assert straight["fault"]["crash_at_step"] == 0
    assert {k: v for k, v in straight.items() if k not in ("run", "fault")} == \
        {k: v for k, v in crashed.items() if k not in ("run", "fault")}


def test_a_scratch_run_started_as_a_new_interpreter_writes_its_spec_and_log(tmp_path,
                                                                          monkeypatch):
    started = []

    def popen(argv, **kwargs):
        started.append((argv, kwargs))
        return "proc"

    monkeypatch.setattr(rc.subprocess, "Popen", popen)
    env = {"OMP_NUM_THREADS": "3"}
    assert rc._launch({"resume": True}, tmp_path, "resumed", 1, env, None) == "proc"
    assert json.loads((tmp_path / "resumed.json").read_text()) == {"resume": True}
    argv, kwargs = started[0]
    assert argv == [sys.executable, "-m", "ironloop.tools.doctor.resume_record",
                    str(tmp_path / "resumed.json")]
    assert kwargs["stdout"].name == str(tmp_path / "resumed.log") and kwargs["stdout"].closed
    assert kwargs["stderr"] == subprocess.STDOUT and kwargs["env"] is env
    assert (tmp_path / "resumed.log").exists()
    rc._launch({}, tmp_path, "straight", 2, env, None)
    assert started[1][0] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", "-m", "ironloop.tools.doctor.resume_record",
                             str(tmp_path / "straight.json")]


def test_a_scratch_run_forked_from_this_process_gets_its_spec_log_and_threads(tmp_path,
                                                                            monkeypatch):
    forks = []
    monkeypatch.setattr(rc, "Forked", lambda *args: forks.append(args) or "forked")
    assert rc._launch({"x": 1}, tmp_path, "crashed", 1, {}, 3) == "forked"
    assert forks == [(tmp_path / "crashed.json", tmp_path / "crashed.log", 3)]
    assert json.loads((tmp_path / "crashed.json").read_text()) == {"x": 1}


def test_a_forked_scratch_run_is_polled_killed_and_waited_on_like_a_process(tmp_path):
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)  # the child blocks reading its spec until it is killed
    proc = rc.Forked(fifo, tmp_path / "blocked.log", 1)
    assert proc.pid > 0 and proc.poll() is None
    proc.kill()
    assert proc.wait() == -9 and proc.poll() == -9
    failing = rc.Forked(tmp_path / "missing.json", tmp_path / "failing.log", 1)
    assert failing.wait() == 70  # the spec is missing: main's code for the user's code failing
    assert "FileNotFoundError" in (tmp_path / "failing.log").read_text()
    done = rc.Forked(tmp_path / "missing.json", tmp_path / "done.log", 1)
    deadline = time.monotonic() + 60
    while done.poll() is None:
        assert time.monotonic() < deadline, "the forked run never ended"
    assert done.returncode == 70 and done.wait() == 70


def test_the_scratch_runs_share_the_threads_unless_the_user_set_them(monkeypatch):
    monkeypatch.setattr(rc.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = rc._child_env(parallel=2)
    assert env["OMP_NUM_THREADS"] == "4" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == os.environ["PATH"]
    assert rc._child_env(parallel=16)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(rc.os, "cpu_count", lambda: None)
    assert rc._child_env(parallel=1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    assert rc._child_env(parallel=1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert rc._child_env(parallel=2)["OMP_NUM_THREADS"] == "6"


def test_scratch_runs_are_forked_with_one_thread_once_torch_has_run_here(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    env = {"OMP_NUM_THREADS": "5"}
    assert rc.fork_threads(cfg, 2, env) is None  # torchrun: new interpreters
    assert rc.fork_threads(cfg, 1, env) == 1  # torch is imported in this process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert rc.fork_threads(cfg, 1, env) is None  # CUDA does not survive a fork
    monkeypatch.undo()
    monkeypatch.delattr(rc.os, "fork")
    assert rc.fork_threads(cfg, 1, env) is None


def test_scratch_runs_forked_from_a_fresh_process_get_the_threads_of_the_environment(
        tmp_path, monkeypatch):
    warmed = []
    held = sys.modules["torch"]

    def warm(cfg):  # imports torch, as the real one does
        warmed.append(cfg)
        sys.modules["torch"] = held

    monkeypatch.setattr(resume_record, "warm_imports", warm)
    monkeypatch.delitem(sys.modules, "torch")
    cfg = config(tmp_path)
    assert rc.fork_threads(cfg, 1, {"OMP_NUM_THREADS": "5"}) == 5
    assert warmed == [cfg]


def test_a_scratch_run_that_exits_otherwise_than_expected_is_an_error_with_its_last_line(
        tmp_path):
    plan = rc.CheckPlan(9, 3, 4)
    (tmp_path / "straight.log").write_text("starting\nValueError: bad batch\n\n")
    rc._wait(Exited(0), tmp_path, "straight", 0, plan)  # what was expected: nothing to say
    with pytest.raises(rc.ResumeCheckError) as e:
        rc._wait(Exited(70), tmp_path, "straight", 0, plan)
    assert str(e.value) == (f"the resume check's straight run exited 70: ValueError: bad batch "
                            f"(its whole output: {tmp_path / 'straight.log'})")
    (tmp_path / "crashed.log").write_text("")
    with pytest.raises(rc.ResumeCheckError) as e:
        rc._wait(Exited(2), tmp_path, "crashed", 1, plan)
    assert str(e.value) == (f"the resume check's crashed run exited 2: (no output) (its whole "
                            f"output: {tmp_path / 'crashed.log'})")
    with pytest.raises(rc.ResumeCheckError) as e:
        rc._wait(Exited(0), tmp_path, "crashed", 1, plan)
    assert str(e.value) == ("the scratch run ended before step 4, where the check kills it: the "
                            "config's run is shorter than --steps 9; pass a smaller --steps")
    (tmp_path / "resumed.log").write_text("done\n")
    with pytest.raises(rc.ResumeCheckError, match="resumed run exited 0: done"):
        rc._wait(Exited(0), tmp_path, "resumed", 1, plan)


def test_the_scratch_runs_are_straight_and_crashed_side_by_side_then_the_resume(
        tmp_path, monkeypatch):
    launched, envs = [], []
    monkeypatch.setattr(rc, "fork_threads", lambda cfg, nproc, env: envs.append(env) or 7)

    def launch(spec, scratch, name, nproc, env, threads):
        launched.append((name, spec, nproc, env, threads))
        return Exited(1 if name == "crashed" else 0)

    monkeypatch.setattr(rc, "_launch", launch)
    monkeypatch.setattr(rc, "_child_env", lambda parallel: {"parallel": parallel})
    cfg, plan = config(tmp_path), rc.CheckPlan(9, 3, 4)
    rc.run_scratch(cfg, plan, tmp_path, ["m:Cb"], 1)
    assert [run[0] for run in launched] == ["straight", "crashed", "resumed"]
    assert all(run[2:] == (1, {"parallel": 2}, 7) for run in launched)
    assert envs == [{"parallel": 2}]
    specs = {name: spec for name, spec, *_ in launched}
    for name, crash, resume, run in (("straight", False, False, "straight"),
                                     ("crashed", True, False, "crashed"),
                                     ("resumed", False, True, "crashed")):
        assert specs[name] == {
            "config": rc.scratch_config(cfg, plan, tmp_path / run, crash),
            "record": str(tmp_path / f"{name}-rank{{rank}}.jsonl"), "callbacks": ["m:Cb"],
            "resume": resume}
    launched.clear()
    rc.run_scratch(cfg, plan, tmp_path, [], 3)
    assert all(run[2:] == (3, {"parallel": 6}, 7) for run in launched)


def test_a_failed_scratch_run_stops_the_check_and_leaves_no_run_behind(tmp_path, monkeypatch):
    runs = {}

    def launch(spec, scratch, name, nproc, env, threads):
        runs[name] = Exited(2 if name == "crashed" else None)  # the straight one still runs
        return runs[name]

    monkeypatch.setattr(rc, "fork_threads", lambda *args: None)
    monkeypatch.setattr(rc, "_launch", launch)
    (tmp_path / "crashed.log").write_text("ironloop: error: no such data\n")
    with pytest.raises(rc.ResumeCheckError, match="crashed run exited 2: ironloop: error: no "):
        rc.run_scratch(config(tmp_path), rc.CheckPlan(9, 3, 4), tmp_path, [], 1)
    assert sorted(runs) == ["crashed", "straight"]  # no resume started
    assert runs["straight"].killed and not runs["crashed"].killed


def test_a_straight_run_that_fails_after_the_crashed_one_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "fork_threads", lambda *args: None)
    monkeypatch.setattr(rc, "_launch", lambda spec, scratch, name, *args: Exited(
        {"straight": 70, "crashed": 1}.get(name, 0)))
    (tmp_path / "straight.log").write_text("Traceback ...\nKeyError: 'x'\n")
    with pytest.raises(rc.ResumeCheckError) as e:
        rc.run_scratch(config(tmp_path), rc.CheckPlan(9, 3, 4), tmp_path, [], 1)
    assert str(e.value) == (f"the resume check's straight run exited 70: KeyError: 'x' (its "
                            f"whole output: {tmp_path / 'straight.log'})")


def test_a_rank_is_compared_fresh_before_the_kill_then_resumed_after_its_checkpoint(
        tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "_checkpoints", lambda scratch: None)
    plan = rc.CheckPlan(9, 3, 4)
    write_records(tmp_path / "straight-rank0.jsonl", range(1, 10), held_state())
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5))
    write_records(tmp_path / "resumed-rank0.jsonl", range(4, 10), held_state())
    assert rc.compare_rank(tmp_path, plan, 0) == []
    # the crashed run's step 4 (the kill's step) is not compared; the resumed run's is
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5), s4=rec(batches=["x"]))
    write_records(tmp_path / "resumed-rank0.jsonl", range(4, 10), held_state({"M.calls": 1}),
                  s9=rec(batches=["b9"], weights="v"))
    assert rc.compare_rank(tmp_path, plan, 0) == [
        Difference(9, "weights", first_step_difference({1: rec()}, {1: rec(weights="v")},
                                                       range(1, 2)).detail),
        Difference(0, "model", "M.calls is 1 after the resume, None uninterrupted")]
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5), s3=rec(batches=["x"]))
    assert rc.compare_rank(tmp_path, plan, 0) == [Difference(
        3, "fresh batch", "micro-batch 1 of 1 holds other tensors (hash x instead of b3)")]
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5))
    write_records(tmp_path / "resumed-rank0.jsonl", range(5, 10), held_state())
    assert rc.compare_rank(tmp_path, plan, 0) == [
        Difference(4, "steps", "the resumed run has no record of step 4")]


def test_a_rank_whose_last_checkpoints_differ_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "_checkpoints",
                        lambda scratch: Difference(0, "checkpoint", f"at {scratch.name}"))
    plan = rc.CheckPlan(9, 3, 4)
    for name, steps in (("straight", range(1, 10)), ("crashed", range(1, 5)),
                        ("resumed", range(4, 10))):
        write_records(tmp_path / f"{name}-rank1.jsonl", steps, held_state())
    assert rc.compare_rank(tmp_path, plan, 1) == [
        Difference(0, "checkpoint", f"at {tmp_path.name}")]


def test_a_scratch_run_shorter_than_the_check_is_an_error_naming_its_steps(tmp_path):
    write_records(tmp_path / "straight-rank0.jsonl", range(1, 7), held_state())
    with pytest.raises(rc.ResumeCheckError) as e:
        rc.compare_rank(tmp_path, rc.CheckPlan(9, 3, 4), 0)
    assert str(e.value) == ("the scratch run took 6 steps, fewer than the check's 9: the "
                            "config's run is shorter; pass --steps 6")
    write_records(tmp_path / "straight-rank0.jsonl", range(1, 9), held_state())
    with pytest.raises(rc.ResumeCheckError, match="took 8 steps"):
        rc.compare_rank(tmp_path, rc.CheckPlan(9, 3, 4), 0)
    with pytest.raises(rc.ResumeCheckError, match="took 0 steps"):
        rc.compare_rank(tmp_path / "nothing", rc.CheckPlan(9, 3, 4), 0)


def test_the_last_checkpoints_of_the_straight_and_crashed_runs_are_compared(tmp_path,
                                                                          monkeypatch):
    import ironloop.state.checkpointer as checkpointer
    from ironloop.errors import CheckpointError

    held = {"straight": {"model": {"w": torch.ones(2)}, "step": 9},
            "crashed": {"model": {"w": torch.zeros(2)}, "step": 9}}
    asked = []

    def latest(self, fetch=True):
        asked.append(self.directory)
        run = self.directory.parent.name
        if run not in held:
            raise CheckpointError("every one damaged")
        return checkpointer.Found(self.directory / "last.pt", held[run]) if held[run] else None

    monkeypatch.setattr(checkpointer.Checkpointer, "latest", latest)
    assert rc._checkpoints(tmp_path) == Difference(0, "checkpoint",
                                                   "the last checkpoints differ at model.w")
    assert asked[:2] == [tmp_path / "straight" / "checkpoints",
                         tmp_path / "crashed" / "checkpoints"]
    held["crashed"] = {"model": {"w": torch.ones(2)}, "step": 9}
    assert rc._checkpoints(tmp_path) is None
    held["crashed"] = None  # no checkpoint at all
    assert rc._checkpoints(tmp_path) is None
    del held["crashed"]
    assert rc._checkpoints(tmp_path) is None
    held["crashed"] = held.pop("straight")
    assert rc._checkpoints(tmp_path) is None


class FakeRuns:
    """resume_check._launch without processes: each run of the 9-step plan writes a record
    from its spec (the crashed run stops at the kill, step 4; the resumed one starts after the
    checkpoint of step 3), on each of ``nproc`` ranks; from step ``drift`` on, the resumed run
    of rank ``nproc - 1`` sees other batches; with ``calls``, a module counts its calls in an
    attribute, from 0 again in the resumed run."""

    def __init__(self, drift: int = 0, nproc: int = 1, calls: bool = False):
        self.drift, self.nproc, self.calls, self.names = drift, nproc, calls, []

    def __call__(self, spec, scratch, name, nproc, env, threads):
        self.names.append(name)
        kill = spec["config"]["fault"]["crash_at_step"]
        steps = range(4 if spec["resume"] else 1, (kill or 9) + 1)
        for rank in range(self.nproc):
            drifts = spec["resume"] and self.drift and rank == self.nproc - 1
            changed = {f"s{i}": rec(batches=[f"x{i}"]) for i in steps
                       if drifts and i >= self.drift}
            state = held_state({"M.calls": len(steps)} if self.calls else {},
                           callbacks={"0:C": {"state_dict": False, "attributes": {"n": 1}}})
            write_records(Path(spec["record"].format(rank=rank)), steps,
                          None if kill else state, **changed)
        return Exited(1 if kill else 0)


def check(tmp_path, monkeypatch, runs: FakeRuns, **kwargs) -> rc.ResumeCheck:
    monkeypatch.setattr(rc, "_launch", runs)
    monkeypatch.setattr(rc, "fork_threads", lambda *args: None)
    monkeypatch.setattr(rc, "_checkpoints", lambda scratch: None)
    return rc.resume_check(config(tmp_path), 9, scratch_root=tmp_path / "new" / "scratch",
                           nproc=runs.nproc, **kwargs)


def test_an_exact_resume_removes_its_scratch_runs_and_warns_of_stateless_callbacks(
        tmp_path, monkeypatch):
    runs = FakeRuns(calls=True)
    result = check(tmp_path, monkeypatch, runs, callbacks=["m:C"])
    assert runs.names == ["straight", "crashed", "resumed"]
    unread = Difference(0, "model", "M.calls is 6 after the resume, 9 uninterrupted")
    assert (result.exact, result.first, result.differences, result.unread) == \
        (True, None, [], [unread])
    assert (result.plan, result.nproc, result.scratch) == (rc.CheckPlan(9, 3, 4), 1, None)
    assert list((tmp_path / "new" / "scratch").iterdir()) == []
    assert [(f.severity, f.measured) for f in result.findings] == [
        ("info", "resume is exact (9 steps, kill at step 4, resumed from step 3 in a new "
                 "process)"),
        ("warning", f"model attribute differs after the resume, unread: {unread.detail}"),
        ("warning", "callback 0:C holds attributes and has no state_dict; they did not change "
                    "these 9 steps")]
    assert 0 < result.seconds < 60


def test_a_resume_that_is_not_exact_keeps_its_scratch_runs_and_names_the_rank(
        tmp_path, monkeypatch):
    result = check(tmp_path, monkeypatch, FakeRuns(drift=6, nproc=2))
    assert not result.exact and result.nproc == 2
    assert result.first == Difference(6, "batch", "rank 1: micro-batch 1 of 1 holds other "
                                                  "tensors (hash x6 instead of b6)")
    assert result.differences == [result.first]
    assert Path(result.scratch).parent == tmp_path / "new" / "scratch"
    assert Path(result.scratch).name.startswith("ironloop-resume-check-")
    assert (Path(result.scratch) / "resumed-rank1.jsonl").exists()
    assert result.findings[0].measured.startswith(
        "resume is NOT exact (9 steps, kill at step 4, resumed from step 3 in a new process, 2 "
        "ranks each checked): step 6 is the first that differs: batch: rank 1: ")
    assert result.findings[0].cause == \
        f"the batches differ 3 steps after the resume, so {DATA[0]}"


def test_a_check_whose_scratch_run_fails_says_where_its_runs_are_kept(tmp_path, monkeypatch,
                                                                     capsys):
    def failing(*args):
        raise rc.ResumeCheckError("the straight run exited 2")

    monkeypatch.setattr(rc, "run_scratch", failing)
    with pytest.raises(rc.ResumeCheckError):
        rc.resume_check(config(tmp_path), 9, scratch_root=tmp_path)
    kept = next(tmp_path.glob("ironloop-resume-check-*"))
    assert capsys.readouterr().err == f"resume check: scratch runs kept in {kept}\n"


def test_the_check_needs_one_process_at_least(tmp_path):
    with pytest.raises(UserError) as e:
        rc.resume_check(config(tmp_path), 9, nproc=0, scratch_root=tmp_path)
    assert str(e.value) == ("--nproc 0: the scratch runs need at least 1 process; pass --nproc 1 "
                            "(the default) or the ranks the run trains on")
    assert list(tmp_path.iterdir()) == []  # refused before any scratch directory


def test_the_doctor_prints_the_verdict_and_adds_it_to_doctor_json(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(rc, "_launch", FakeRuns(drift=5))
    monkeypatch.setattr(rc, "fork_threads", lambda *args: None)
    monkeypatch.setattr(rc, "_checkpoints", lambda scratch: None)
    monkeypatch.setattr(rc.tempfile, "tempdir", str(tmp_path))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "doctor.json").write_text(json.dumps({"findings": [1]}))
    result = rc.doctor_resume_check(config(tmp_path), 9)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("resume check: 9 steps with a checkpoint every 3, killed after step 4 and "
                      "resumed in a new process, against an uninterrupted run (scratch runs in "
                      "a temporary directory)...")
    assert out[1:] == [*"\n".join(f.render() for f in result.findings).splitlines(),
                       f"    the scratch runs' records and logs: {result.scratch}",
                       f"({result.seconds:.1f} s; written to {tmp_path / 'run' / 'doctor.json'})"]
    assert out[1].startswith("error: [resume_check] resume is NOT exact")
    written = json.loads((tmp_path / "run" / "doctor.json").read_text())
    assert written["findings"] == [1]
    assert written["resume_check"] == json.loads(json.dumps(result.to_dict()))


def test_an_exact_verdict_names_no_scratch_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rc, "_launch", FakeRuns())
    monkeypatch.setattr(rc, "fork_threads", lambda *args: None)
    monkeypatch.setattr(rc, "_checkpoints", lambda scratch: None)
    monkeypatch.setattr(rc.tempfile, "tempdir", str(tmp_path))
    result = rc.doctor_resume_check(config(tmp_path), 9, callbacks=["m:C"])
    assert result.exact
    out = capsys.readouterr().out
    assert "scratch runs' records" not in out and "resume is exact" in out
    assert json.loads((tmp_path / "run" / "doctor.json").read_text())["resume_check"]["exact"]


def test_the_verdict_replaces_a_torn_doctor_json_and_a_read_only_dir_is_a_user_error(tmp_path):
    path = tmp_path / "new" / "run" / "doctor.json"
    rc.write_entry(path, {"exact": True})
    assert path.read_text() == json.dumps({"resume_check": {"exact": True}}, indent=2) + "\n"
    rc.write_entry(path, {"exact": False})
    assert json.loads(path.read_text()) == {"resume_check": {"exact": False}}
    path.write_text('{"findings": [')
    rc.write_entry(path, {"exact": True})
    assert json.loads(path.read_text()) == {"resume_check": {"exact": True}}
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match=f"run.dir {blocker} cannot be created or written"):
        rc.write_entry(blocker / "doctor.json", {})
