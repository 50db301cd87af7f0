"""The resume check's parts, in this process, on fabricated records: what each comparison names
(the step, the kind, the detail), the diagnosis it leads to, the plan, the scratch runs' specs
and launches, and what a scratch run records. The real scratch runs: test_resume_check.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ironloop.config import load_config
from ironloop.errors import UserError
from ironloop.tools.doctor import resume_check as rc, resume_record
from ironloop.tools.doctor.resume_compare import (
    Difference,
    Records,
    checkpoint_difference,
    first_module,
    first_step_difference,
    read_records,
    state_differences,
    stateless_callbacks,
    without_unread,
)
from ironloop.tools.doctor.resume_diagnose import (
    CALLBACK,
    DATA,
    FRESH,
    HIDDEN,
    MODEL,
    OPTIMIZER,
    UNREAD,
    cause_and_fix,
    findings_for,
)

CASES = "tests.resume_cases"


def rec(batches=("b",), losses=(1.0,), weights="w", modules=(("fc (Linear)", "h"),)) -> dict:
    """One step's record as resume_record writes it."""
    return {"batches": list(batches), "losses": list(losses), "weights": weights,
            "modules": [list(m) for m in modules]}


# --- resume_compare: reading records ---------------------------------------------------------

def test_reading_records_keeps_whole_steps_skips_a_torn_line_and_takes_the_end_state(tmp_path):
    assert read_records(tmp_path / "missing.jsonl") == Records({}, None)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"step": 1, **rec()}) + "\n" + '{"step": 2, "batc\n'
                    + json.dumps({"step": 3, **rec(weights="v")}) + "\n"
                    + json.dumps({"end": 3, "state": {"model": {"A.x": 1}}}) + "\n")
    records = read_records(path)
    assert sorted(records.steps) == [1, 3]
    assert records.steps[3] == {"step": 3, **rec(weights="v")}
    assert records.state == {"model": {"A.x": 1}}
    killed = tmp_path / "killed.jsonl"
    killed.write_text(json.dumps({"step": 1, **rec()}) + "\n")
    assert read_records(killed).state is None


def test_a_difference_is_written_as_its_step_kind_and_detail():
    assert Difference(4, "loss", "x").to_dict() == {"step": 4, "what": "loss", "detail": "x"}


# --- resume_compare: step by step --------------------------------------------------------------

def test_a_missing_step_names_the_run_that_has_no_record_of_it():
    a = {1: rec(), 2: rec()}
    assert first_step_difference(a, {1: rec()}, range(1, 3)) == Difference(
        2, "steps", "the resumed run has no record of step 2")
    assert first_step_difference({2: rec()}, a, range(1, 3)) == Difference(
        1, "steps", "the uninterrupted run has no record of step 1")
    assert first_step_difference(a, dict(a), range(1, 3)) is None
    assert first_step_difference(a, {}, range(3, 3)) is None  # no step to compare


def test_the_first_differing_step_of_the_range_is_named_not_a_later_one():
    a = {i: rec() for i in range(1, 6)}
    b = {**a, 3: rec(weights="v"), 4: rec(batches=["x"])}
    assert first_step_difference(a, b, range(1, 6)).step == 3
    assert first_step_difference(a, b, range(4, 6)) == Difference(
        4, "batch", "micro-batch 1 of 1 holds other tensors (hash x instead of b)")


def test_a_batch_difference_names_the_micro_batch_and_both_hashes():
    a = {1: rec(batches=["b1", "b2", "b3"], losses=[1.0] * 3)}
    b = {1: rec(batches=["b1", "c2", "c3"], losses=[2.0] * 3)}  # the batch, before the loss
    assert first_step_difference(a, b, range(1, 2)).detail == \
        "micro-batch 2 of 3 holds other tensors (hash c2 instead of b2)"
    longer = {1: rec(batches=["b1", "b2", "b3", "b4"], losses=[1.0] * 4)}
    assert first_step_difference(a, longer, range(1, 2)).detail == \
        "micro-batch 4 of 3 holds other tensors (hash b4 instead of none)"


def test_a_loss_difference_names_the_value_the_micro_batch_and_the_first_module():
    a = {2: rec(losses=[0.5, 1.25], modules=[("0 (Linear)", "h0"), ("1 (ReLU)", "h1")])}
    b = {2: rec(losses=[0.5, 1.123456789012], modules=[("0 (Linear)", "h0"), ("1 (ReLU)", "z")])}
    assert first_step_difference(a, b, range(2, 3)) == Difference(
        2, "loss", "loss 1.12345679 instead of 1.25 on micro-batch 2; the first module whose "
                   "output differs is '1 (ReLU)'")
    same_modules = {2: rec(losses=[0.5, 3.0], modules=[("0 (Linear)", "h0"), ("1 (ReLU)", "h1")])}
    assert first_step_difference(a, same_modules, range(2, 3)).detail == \
        "loss 3 instead of 1.25 on micro-batch 2"  # every module equal: nothing more to name
    fewer = {2: rec(losses=[0.5], modules=[("0 (Linear)", "h0"), ("1 (ReLU)", "h1")])}
    assert first_step_difference(a, fewer, range(2, 3)).detail == \
        "loss none instead of 1.25 on micro-batch 2"


def test_a_weights_difference_comes_only_when_batches_and_losses_are_equal():
    a = {1: rec()}
    assert first_step_difference(a, {1: rec(weights="v")}, range(1, 2)) == Difference(
        1, "weights", "the losses are equal, the weights after the optimizer step are not (the "
                      "gradients, the optimizer's state, the LR or the gradient scaler differ)")
    assert first_step_difference(a, {1: rec(losses=[2.0], weights="v")},
                                 range(1, 2)).what == "loss"


def test_the_first_module_is_the_first_whose_output_differs_or_is_missing():
    a = [["inner (Linear)", "h1"], ["the model (Sequential)", "h2"]]
    assert first_module(a, list(a)) is None
    assert first_module(a, [["inner (Linear)", "h1"], ["the model (Sequential)", "x"]]) == \
        "'the model (Sequential)'"
    assert first_module(a, a[:1]) == "'the model (Sequential)'"  # b is shorter: a's entry
    assert first_module(a[:1], a) == "'the model (Sequential)'"  # a is shorter: b's entry
    assert first_module([], []) is None


# --- resume_compare: checkpoints -----------------------------------------------------------------

def test_checkpoints_compare_key_by_key_skipping_what_differs_between_exact_runs():
    varying = {k: 1 for k in ("config", "integrity", "loggers", "ironloop_version",
                              "torch_version", "seconds", "train_seconds", "time",
                              "wall_seconds")}
    assert checkpoint_difference({**varying, "a": 1}, {"a": 1}) is None
    assert checkpoint_difference({"a": 1, "b": 2}, {"a": 1}) == "b (only in the uninterrupted run)"
    assert checkpoint_difference({"a": 1}, {"a": 1, "c": 2}) == "c (only in the resumed run)"
    assert checkpoint_difference({"x": {"b": 1, "a": 1}}, {"x": {"b": 2, "a": 2}}) == "x.a"
    assert checkpoint_difference({"s": {1: 2, "k": 3}}, {"s": {1: 2, "k": 4}}) == "s.k"


def test_checkpoint_lists_compare_length_then_each_entry():
    assert checkpoint_difference({"g": [1, 2]}, {"g": [1, 2, 3]}) == "g (length 3 instead of 2)"
    assert checkpoint_difference({"g": (1, {"lr": 0.1})}, {"g": [1, {"lr": 0.2}]}) == "g.1.lr"
    assert checkpoint_difference({"g": [1, 2]}, {"g": [1, 2]}) is None
    assert checkpoint_difference([1], [2]) == "0"
    assert checkpoint_difference([1], [1, 2]) == "(root) (length 2 instead of 1)"


def test_checkpoint_tensors_are_equal_only_bit_for_bit_in_dtype_and_shape():
    t = torch.arange(4.0)
    assert checkpoint_difference({"w": t}, {"w": t.clone()}) is None
    assert checkpoint_difference({"w": t}, {"w": t.double()}) == "w"
    assert checkpoint_difference({"w": t}, {"w": t.reshape(2, 2)}) == "w"
    assert checkpoint_difference({"w": t}, {"w": t + 1}) == "w"
    assert checkpoint_difference(t, t.clone()) is None


def test_checkpoint_scalars_equal_in_type_and_value_and_nan_equals_nan():
    assert checkpoint_difference({"v": math.nan}, {"v": math.nan}) is None
    assert checkpoint_difference({"v": math.nan}, {"v": 1.0}) == "v"
    assert checkpoint_difference({"v": 1.0}, {"v": math.nan}) == "v"
    assert checkpoint_difference({"v": 1}, {"v": 1.0}) == "v"  # an int saved as a float
    assert checkpoint_difference({"v": 1}, {"v": 1}) is None
    assert checkpoint_difference(1, 2) == "(root)"


# --- resume_compare: what the processes held outside the checkpoint ----------------------------

def _state(model=None, data=None, globals_=None, callbacks=None) -> dict:
    return {"model": model or {}, "data": data or {}, "globals": globals_ or {},
            "callbacks": callbacks or {}}


def test_hidden_state_differences_name_the_value_after_the_resume_and_uninterrupted():
    a = _state({"M.calls": 9, "M.k": 1}, {"D.reads": 5}, {"m.N": 1})
    b = _state({"M.calls": 4, "M.k": 1, "M.new": 2}, {"D.reads": 3}, {"m.N": 2})
    assert state_differences(a, b) == [
        Difference(0, "model", "M.calls is 4 after the resume, 9 uninterrupted"),
        Difference(0, "model", "M.new is 2 after the resume, None uninterrupted"),
        Difference(0, "data", "D.reads is 3 after the resume, 5 uninterrupted"),
        Difference(0, "global", "m.N is 2 after the resume, 1 uninterrupted")]
    assert state_differences(a, None) == [] and state_differences(None, b) == []
    assert state_differences({}, b) == []


def test_a_callback_without_state_dict_names_the_attributes_that_differ():
    a = _state(callbacks={"0:C": {"state_dict": False,
                                  "attributes": {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}},
                          "1:S": {"state_dict": True, "attributes": {"a": 1}},
                          "2:Gone": {"state_dict": False, "attributes": {"n": 1}}})
    b = _state(callbacks={"0:C": {"state_dict": False,
                                  "attributes": {"a": 1, "b": 0, "c": 0, "d": 0, "e": 0}},
                          "1:S": {"state_dict": True, "attributes": {"a": 2}}})
    assert state_differences(a, b) == [
        Difference(0, "callback", "0:C has no state_dict, and its b, c, d, e differ after the "
                                  "resume (b: 0 vs 2; c: 0 vs 3; d: 0 vs 4)"),
        Difference(0, "callback", "2:Gone has no state_dict, and its n differ after the resume "
                                  "(n: None vs 1)")]


def test_stateless_callbacks_are_those_with_attributes_and_no_state_dict():
    state = _state(callbacks={"0:C": {"state_dict": False, "attributes": {"n": 1}},
                              "1:Empty": {"state_dict": False, "attributes": {}},
                              "2:S": {"state_dict": True, "attributes": {"n": 1}},
                              "3:D": {"state_dict": False, "attributes": {"k": 0}}})
    assert stateless_callbacks(state) == ["0:C", "3:D"]
    assert stateless_callbacks(None) == [] and stateless_callbacks({}) == []


def test_unread_attributes_are_set_apart_only_when_every_step_is_equal():
    model, data = Difference(0, "model", "m"), Difference(0, "data", "d")
    glob, cb = Difference(0, "global", "g"), Difference(0, "callback", "c")
    assert without_unread([model, glob, data]) == ([glob], [model, data])
    assert without_unread([cb]) == ([cb], [])
    assert without_unread([]) == ([], [])
    ckpt = Difference(0, "checkpoint", "k")
    assert without_unread([model, ckpt]) == ([model, ckpt], [])


# --- resume_diagnose ---------------------------------------------------------------------------

def test_a_batch_difference_is_blamed_on_the_data_with_how_far_after_the_resume():
    cause, fix = cause_and_fix(Difference(9, "batch", "..."), 8)
    assert cause == f"the batches differ at the first step after the resume, so {DATA[0]}"
    assert fix == DATA[1]
    cause, _ = cause_and_fix(Difference(11, "batch", "..."), 8)
    assert cause == f"the batches differ 3 steps after the resume, so {DATA[0]}"


def test_each_kind_of_difference_has_its_cause_and_fix():
    assert cause_and_fix(Difference(3, "fresh batch", ""), 8) == FRESH
    assert cause_and_fix(Difference(3, "fresh weights", ""), 8) == FRESH
    assert cause_and_fix(Difference(9, "loss", "loss 2 instead of 1 on micro-batch 1"), 8) == (
        "the step: the batches and every module's output are equal, the loss is not: the step "
        "keeps a global or some state outside its `state`", MODEL[1])
    assert cause_and_fix(Difference(9, "loss", "...; the first module whose output differs is "
                                               "'0 (Linear)'"), 8) == MODEL
    assert cause_and_fix(Difference(9, "weights", ""), 8) == OPTIMIZER
    assert cause_and_fix(Difference(9, "steps", ""), 8) == OPTIMIZER
    for kind in ("model", "data", "global", "callback"):
        assert cause_and_fix(Difference(0, kind, ""), 8) == HIDDEN[kind]
    assert HIDDEN["callback"] == CALLBACK


def test_a_checkpoint_difference_in_a_callback_is_blamed_on_its_load_state_dict():
    callback = ("a callback's state_dict does not give back what it held",
                "make the callback's load_state_dict restore everything its state_dict saves")
    part = ("a part's state_dict misses state that the training changes (see the key)",
            "keep that part's whole state in its state_dict")
    assert cause_and_fix(Difference(0, "checkpoint", "the last checkpoints differ at "
                                                     "callbacks.0:C.seen"), 8) == callback
    assert cause_and_fix(Difference(0, "checkpoint", "x.callbacks.seen"), 8) == callback
    assert cause_and_fix(Difference(0, "checkpoint", "callbacks.0.seen"), 8) == callback
    assert cause_and_fix(Difference(0, "checkpoint", "the last checkpoints differ at "
                                                     "optimizer.state.0.step"), 8) == part


def test_an_exact_resume_is_an_info_then_unread_and_stateless_warnings():
    unread = [Difference(0, "model", "M.calls is 1 after the resume, 4 uninterrupted")]
    found = findings_for("resume is exact (...)", [], 8, 24, ["0:Counter"], unread)
    assert [(f.check, f.severity, f.measured, f.cause, f.fix) for f in found] == [
        ("resume_check", "info", "resume is exact (...)", "", ""),
        ("resume_check", "warning", "model attribute differs after the resume, unread: M.calls "
                                    "is 1 after the resume, 4 uninterrupted", *UNREAD),
        ("resume_check", "warning", "callback 0:Counter holds attributes and has no "
                                    "state_dict; they did not change these 24 steps", *CALLBACK)]
    assert len(findings_for("h", [], 8, 24, [])) == 1


def test_a_resume_that_is_not_exact_names_the_first_difference_then_what_else_was_not_restored():
    differences = [Difference(9, "batch", "micro-batch 1 of 1 holds other tensors"),
                   Difference(10, "weights", "w"),
                   Difference(0, "checkpoint", "the last checkpoints differ at data.reads"),
                   Difference(0, "data", "D.reads is 3 after the resume, 5 uninterrupted"),
                   Difference(0, "callback", "0:C has no state_dict")]
    found = findings_for("resume is NOT exact (...)", differences, 8, 24, ["0:C"])
    assert [(f.check, f.severity, f.measured) for f in found] == [
        ("resume_check", "error", "resume is NOT exact (...): step 9 is the first that differs: "
                                  "batch: micro-batch 1 of 1 holds other tensors"),
        ("resume_check", "error", "also: the last checkpoints differ at data.reads"),
        ("resume_check", "error", "not restored (data): D.reads is 3 after the resume, 5 "
                                  "uninterrupted"),
        ("resume_check", "error", "not restored (callback): 0:C has no state_dict")]
    assert (found[0].cause, found[0].fix) == cause_and_fix(differences[0], 8)
    assert (found[1].cause, found[1].fix) == cause_and_fix(differences[2], 8)
    assert (found[2].cause, found[2].fix) == HIDDEN["data"]
    assert (found[3].cause, found[3].fix) == HIDDEN["callback"]
    at_end = findings_for("h", [Difference(0, "global", "m.N is 2")], 8, 24, [])
    assert at_end[0].measured == "h: every step is equal: global: m.N is 2"
    assert (at_end[0].cause, at_end[0].fix) == HIDDEN["global"]


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


# --- resume_check: the scratch runs ----------------------------------------------------------

def config(tmp_path, *extra: str):
    return load_config(None, [f"data.name={CASES}:clean_data", f"run.dir={tmp_path / 'run'}",
                              "model.name=mlp", "model.kwargs={hidden: [16]}",
                              "train.batch_size=16", "train.epochs=3", *extra])


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


class Exited:
    """A finished scratch process."""

    def __init__(self, code: int | None):
        self.returncode, self.killed = code, False

    def wait(self) -> int:
        return -9 if self.killed else self.returncode

    def poll(self):
        return self.returncode

    def kill(self) -> None:
        self.killed = True


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


def write_records(path: Path, steps, state=None, **changed) -> None:
    """A scratch run's record: a step line per step (``changed``: {step: record}), then its
    end state."""
    lines = [{"step": i, **changed.get(f"s{i}", rec(batches=[f"b{i}"]))} for i in steps]
    if state is not None:
        lines.append({"end": steps[-1], "state": state})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_rank_is_compared_fresh_before_the_kill_then_resumed_after_its_checkpoint(
        tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "_checkpoints", lambda scratch: None)
    plan = rc.CheckPlan(9, 3, 4)
    write_records(tmp_path / "straight-rank0.jsonl", range(1, 10), _state())
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5))
    write_records(tmp_path / "resumed-rank0.jsonl", range(4, 10), _state())
    assert rc.compare_rank(tmp_path, plan, 0) == []
    # the crashed run's step 4 (the kill's step) is not compared; the resumed run's is
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5), s4=rec(batches=["x"]))
    write_records(tmp_path / "resumed-rank0.jsonl", range(4, 10), _state({"M.calls": 1}),
                  s9=rec(batches=["b9"], weights="v"))
    assert rc.compare_rank(tmp_path, plan, 0) == [
        Difference(9, "weights", first_step_difference({1: rec()}, {1: rec(weights="v")},
                                                       range(1, 2)).detail),
        Difference(0, "model", "M.calls is 1 after the resume, None uninterrupted")]
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5), s3=rec(batches=["x"]))
    assert rc.compare_rank(tmp_path, plan, 0) == [Difference(
        3, "fresh batch", "micro-batch 1 of 1 holds other tensors (hash x instead of b3)")]
    write_records(tmp_path / "crashed-rank0.jsonl", range(1, 5))
    write_records(tmp_path / "resumed-rank0.jsonl", range(5, 10), _state())
    assert rc.compare_rank(tmp_path, plan, 0) == [
        Difference(4, "steps", "the resumed run has no record of step 4")]


def test_a_rank_whose_last_checkpoints_differ_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "_checkpoints",
                        lambda scratch: Difference(0, "checkpoint", f"at {scratch.name}"))
    plan = rc.CheckPlan(9, 3, 4)
    for name, steps in (("straight", range(1, 10)), ("crashed", range(1, 5)),
                        ("resumed", range(4, 10))):
        write_records(tmp_path / f"{name}-rank1.jsonl", steps, _state())
    assert rc.compare_rank(tmp_path, plan, 1) == [
        Difference(0, "checkpoint", f"at {tmp_path.name}")]


def test_a_scratch_run_shorter_than_the_check_is_an_error_naming_its_steps(tmp_path):
    write_records(tmp_path / "straight-rank0.jsonl", range(1, 7), _state())
    with pytest.raises(rc.ResumeCheckError) as e:
        rc.compare_rank(tmp_path, rc.CheckPlan(9, 3, 4), 0)
    assert str(e.value) == ("the scratch run took 6 steps, fewer than the check's 9: the "
                            "config's run is shorter; pass --steps 6")
    write_records(tmp_path / "straight-rank0.jsonl", range(1, 9), _state())
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
            state = _state({"M.calls": len(steps)} if self.calls else {},
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


# --- resume_record: what a scratch run records ----------------------------------------------

def test_a_digest_hashes_dtype_shape_bytes_and_the_structure_around_them():
    import hashlib

    class Output:  # a Hugging Face ModelOutput's way to give its tensors
        def to_tuple(self):
            return (torch.tensor([2], dtype=torch.int8),)

    t = torch.tensor([[1.0, 2.0]])
    h = hashlib.blake2b(digest_size=8)
    for part in (b"K'a'", b"L4", b"Ttorch.float32(1, 2)", t.numpy().tobytes(), b"3", b"'s'",
                 b"None", b"K'b'", b"L1", b"Ttorch.int8(1,)", b"\x02", b"K'c'", b"object"):
        h.update(part)
    assert resume_record.digest({"a": [t, 3, "s", None], "b": Output(), "c": object()}) == \
        h.hexdigest()


def test_a_digest_tells_apart_what_a_step_could_see_differently():
    d = resume_record.digest
    x = torch.zeros(2)
    assert d(x) == d(x.clone()) and len(d(x)) == 16
    assert d(torch.zeros(2)) != d(torch.zeros(1, dtype=torch.float64))  # the same 8 bytes
    assert d(torch.zeros(2)) != d(torch.zeros(1, 2))
    assert d([[1], [2]]) != d([[1, 2]])
    assert d({"a": 1}) != d({"b": 1})
    assert d((1, 2)) == d([1, 2])
    assert d(1) != d("1") and d(True) != d(1)
    t = torch.arange(6.0).reshape(2, 3)
    assert d(t.t()) == d(t.t().contiguous())  # values, not the memory layout
    assert d(t.requires_grad_()) == d(t.detach())


class Holder:
    pass


def test_plain_attributes_are_scalars_short_plain_lists_and_hashed_tensors():
    obj = Holder()
    obj.n, obj.s, obj.none, obj.flag, obj.rate = 3, "x", None, True, 0.5
    setattr(obj, "__private", 1)
    obj.ok_list, obj.ok_tuple = list(range(64)), (1, "a")
    obj.long, obj.mixed, obj.other = list(range(65)), [1, object()], object()
    obj.small = torch.arange(4.0)
    obj.limit = torch.zeros(1_000_000, dtype=torch.uint8)
    obj.big = torch.zeros(1_000_001, dtype=torch.uint8)
    obj.param = nn.Parameter(torch.ones(2))
    found = resume_record.plain_attributes(obj, frozenset({"rate"}))
    assert found == {"n": 3, "s": "x", "none": None, "flag": True, "ok_list": list(range(64)),
                     "ok_tuple": [1, "a"], "small": f"tensor {resume_record.digest(obj.small)}",
                     "limit": f"tensor {resume_record.digest(obj.limit)}"}
    assert list(found) == sorted(found)
    assert resume_record.plain_attributes(obj)["rate"] == 0.5
    assert resume_record.plain_attributes(5) == {}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.factor = 2.0

    def forward(self, x):
        return self.fc(x) * self.factor


def test_module_attributes_are_named_by_class_and_module_without_the_mode():
    found = resume_record.module_attributes(Scaled())
    assert found["Scaled.factor"] == 2.0
    assert found["Linear.in_features (module fc)"] == 2
    assert found["Linear.out_features (module fc)"] == 3
    assert not any(k.startswith(("Scaled.training", "Linear.training", "Scaled.calls",
                                 "Linear.weight")) for k in found)


def test_user_modules_follow_a_wrapped_function_and_skip_what_is_not_imported(monkeypatch):
    from tests import resume_cases

    class Wrapper:
        __wrapped__ = resume_cases.counting_step

    nameless = Holder()
    nameless.__module__ = None  # its class's module stands
    lost = Holder()
    lost.__module__ = "not_imported_anywhere"
    assert resume_record.user_modules(Wrapper()) == [resume_cases]
    assert resume_record.user_modules(nameless, lost) == [sys.modules[__name__]]
    assert resume_record.user_modules(nn.Linear, resume_record.digest, torch.zeros) == []


def test_module_globals_are_the_plain_module_level_values(monkeypatch):
    import types

    mod = types.ModuleType("my_counters")
    mod.N, mod.name, mod.rate, mod.off = 3, "x", 0.5, None
    mod.items, mod.fn, mod.__secret__ = [1], len, 1
    other = types.ModuleType("other_counters")
    other.A = 1
    found = resume_record.module_globals([mod, other])
    assert found == {"my_counters.N": 3, "my_counters.name": "x", "my_counters.off": None,
                     "my_counters.rate": 0.5, "other_counters.A": 1}
    assert list(found)[:4] == ["my_counters.N", "my_counters.name", "my_counters.off",
                               "my_counters.rate"]


def test_the_recorder_hashes_every_modules_training_output_not_evaluations(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    recorder = resume_record.Recorder(tmp_path / "r.jsonl", model, None, [], None)
    x = torch.ones(1, 2)
    hidden = model[0](x)
    recorder.outputs.clear()
    out = model(x)
    assert recorder.outputs == [["0 (Linear)", resume_record.digest(hidden)],
                                ["1 (ReLU)", resume_record.digest(out)],
                                ["the model (Sequential)", resume_record.digest(out)]]
    model.eval()
    model(x)
    assert len(recorder.outputs) == 3
    recorder.file.close()


def test_the_recorder_records_training_micro_batches_and_losses_of_either_kind_of_step(
        tmp_path):
    model = nn.Linear(2, 1)
    recorder = resume_record.Recorder(tmp_path / "r.jsonl", model, None, [], None)
    batch = (torch.ones(1, 2), torch.zeros(1))

    def plain(model, batch):
        return torch.tensor(0.25), {"acc": 1}

    def stateful(model, batch, state):
        return torch.tensor(1.5), {}, state + 1

    assert recorder.wrap(plain)(model, batch) == (torch.tensor(0.25), {"acc": 1})
    assert recorder.wrap(stateful)(model, batch, 4)[2] == 5
    model.eval()  # evaluation runs the step too: not recorded
    recorder.wrap(plain)(model, batch)
    assert recorder.batches == [resume_record.digest(batch)] * 2
    assert recorder.losses == [0.25, 1.5]
    recorder.on_step_end(None, {"step": 7})
    assert (recorder.batches, recorder.losses, recorder.outputs) == ([], [], [])
    recorder.file.close()
    line = json.loads((tmp_path / "r.jsonl").read_text())
    assert line == {"step": 7, "batches": [resume_record.digest(batch)] * 2,
                    "losses": [0.25, 1.5], "modules": [],
                    "weights": resume_record.digest(list(model.parameters()))}


def _module(monkeypatch, name: str, **values):
    import types

    mod = types.ModuleType(name)
    vars(mod).update(values)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_the_end_record_holds_the_attributes_and_globals_a_checkpoint_does_not(
        tmp_path, monkeypatch):
    from ironloop.callbacks import Callback

    for name in ("u_step", "u_model", "u_layer", "u_data", "u_callback"):
        _module(monkeypatch, name, VALUE=name)
    Net = type("Net", (nn.Module,), {"__module__": "u_model"})
    Layer = type("Layer", (nn.Identity,), {"__module__": "u_layer"})
    Data = type("Data", (), {"__module__": "u_data"})
    Saved = type("Saved", (Callback,), {"__module__": "u_callback", "state_dict": lambda s: {}})
    Counter = type("Counter", (Callback,), {"__module__": "tests.resume_cases"})

    def step(model, batch):
        return torch.tensor(0.0), {}

    step.__module__ = "u_step"
    model = Net()
    model.inner, model.calls = Layer(), 4
    data = Data()
    data.reads = 11
    saved, counter = Saved(), Counter()
    counter.seen = 2
    path = tmp_path / "r.jsonl"
    recorder = resume_record.Recorder(path, model, data, [counter, saved], step)
    recorder.on_train_end(None, {"step": 9})
    assert recorder.file.closed
    end = json.loads(path.read_text())
    assert end["end"] == 9
    from tests import resume_cases

    assert end["state"] == {
        "model": resume_record.module_attributes(model), "data": {"Data.reads": 11},
        "callbacks": {"0:Counter": {"state_dict": False, "attributes": {"seen": 2}},
                      "1:Saved": {"state_dict": True, "attributes": {}}},
        "globals": {**{f"{n}.VALUE": n for n in ("u_step", "u_model", "u_layer", "u_data",
                                                  "u_callback")},
                    "tests.resume_cases.CALLS": resume_cases.CALLS,
                    "tests.resume_cases.N": resume_cases.N}}
    assert end["state"]["model"]["Net.calls"] == 4


def test_the_recorded_step_is_the_one_fit_would_run(tmp_path, monkeypatch):
    from ironloop.data.bundle import DataBundle
    from ironloop.engine.step_fns import lm_step
    from ironloop.errors import ConfigError
    from tests import resume_cases

    bundle = DataBundle(None, None, None, (2,), 3)
    model = nn.Linear(2, 3)
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 2, 0])
    cfg = load_config(None, [])
    loss, _ = resume_record.run_step(cfg, model, bundle)(model, (x, y))
    assert torch.equal(loss, nn.functional.cross_entropy(model(x), y))
    smooth = load_config(None, ["loss.label_smoothing=0.2"])
    loss, _ = resume_record.run_step(smooth, model, bundle)(model, (x, y))
    assert torch.equal(loss, nn.functional.cross_entropy(model(x), y, label_smoothing=0.2))
    with pytest.raises(ConfigError, match="2 entries but the data has 3 classes"):
        resume_record.run_step(load_config(None, ["loss.class_weights=[1, 2]"]), model, bundle)
    _module(monkeypatch, "u_loss", seven=lambda out, target: torch.tensor(7.0))
    loss, _ = resume_record.run_step(load_config(None, ["loss.name=u_loss:seven"]), model,
                                     bundle)(model, (x, y))
    assert loss.item() == 7.0
    named = load_config(None, [f"train.step_fn={CASES}:counting_step"])
    assert resume_record.run_step(named, model, bundle) is resume_cases.counting_step
    assert resume_record.run_step(load_config(None, ["train.step_fn=lm"]), model,
                                  bundle) is lm_step


def test_warm_imports_import_the_modules_the_config_names_and_skip_broken_ones(
        tmp_path, monkeypatch):
    for name in ("warm_data", "warm_model", "warm_step", "warm_loss"):
        (tmp_path / f"{name}.py").write_text("X = 1\n")
    (tmp_path / "warm_broken.py").write_text("raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("warm_data", "warm_model", "warm_step", "warm_loss", "warm_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    cfg = load_config(None, ["data.name=warm_data:d", "model.name=warm_model:m",
                             "train.step_fn=warm_step:s", "loss.name=warm_loss:l"])
    try:
        resume_record.warm_imports(cfg)
        assert all(n in sys.modules for n in ("warm_data", "warm_model", "warm_step",
                                              "warm_loss"))
        resume_record.warm_imports(load_config(None, ["data.name=warm_broken:d",
                                                      "model.name=warm_missing:m"]))
        assert "warm_broken" not in sys.modules
    finally:
        for name in ("warm_data", "warm_model", "warm_step", "warm_loss"):
            sys.modules.pop(name, None)


def test_a_scratch_run_that_fails_on_a_user_error_exits_2_with_the_error_in_its_log(
        tmp_path, monkeypatch):
    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    threads = []
    monkeypatch.setattr(resume_record.os, "_exit", exit_)
    monkeypatch.setattr(resume_record.torch, "set_num_threads", threads.append)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps({"config": {"nosuch": {}}}))
    saved = os.dup(1), os.dup(2)
    try:
        with pytest.raises(Exited) as e:
            resume_record.forked(str(spec), str(tmp_path / "bad.log"), 3)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    # one line-buffered stream on fd 1 for both: a kill keeps every line; fd 1 stays open
    assert sys.stdout is sys.stderr and sys.stdout.fileno() == 1
    assert sys.stdout.line_buffering and not sys.stdout.buffer.raw.closefd
    assert e.value.args == (2,) and threads == [3]
    assert (tmp_path / "bad.log").read_text().startswith(
        "ironloop: error: unknown config section 'nosuch'")


def test_a_scratch_run_records_every_step_and_resumes_in_its_own_directory(tmp_path,
                                                                         monkeypatch):
    """record_run in this process, as each scratch process runs it: the config's model and
    data, the spec's callbacks, the record of the rank, and the resume flag."""
    monkeypatch.delenv("RANK", raising=False)  # rank 0's record when not under torchrun
    cfg = config(tmp_path, "train.step_fn=tests.resume_cases:counting_step")
    spec = {"config": rc.scratch_config(cfg, rc.plan_for(3), tmp_path / "straight", False),
            "record": str(tmp_path / "straight-rank{rank}.jsonl"),
            "callbacks": [f"{CASES}:StepCounter"], "resume": False}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert resume_record.main([str(path)]) == 0
    records = read_records(tmp_path / "straight-rank0.jsonl")
    assert sorted(records.steps) == [1, 2, 3]
    assert all(len(r["batches"]) == len(r["losses"]) == 1 for r in records.steps.values())
    assert records.state["callbacks"] == {"0:StepCounter": {"state_dict": False,
                                                            "attributes": {"seen": 3}}}
    assert "tests.resume_cases.CALLS" in records.state["globals"]  # the step's module
    assert records.state["data"]["TensorData.x"].startswith("tensor ")
    # the same run resumed: nothing left to train, only the end of the run recorded again
    path.write_text(json.dumps({**spec, "resume": True}))
    assert resume_record.main([str(path)]) == 0
    again = read_records(tmp_path / "straight-rank0.jsonl")
    assert again.steps == records.steps
    assert (tmp_path / "straight-rank0.jsonl").read_text().count('"end"') == 2
    assert resume_record.main([str(tmp_path / "missing.json")]) == 70
