"""``ironloop doctor --resume-check``: real scratch runs, a real kill (os._exit in the crashed
process) and a resume in a new process, on pipelines that are exact and on pipelines that keep
state a crash loses (tests/resume_cases.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ironloop.config import load_config
from ironloop.errors import UserError
from ironloop.tools.doctor.resume_check import CheckPlan, plan_for, resume_check
from ironloop.tools.doctor.resume_compare import (
    Difference,
    checkpoint_difference,
    first_step_difference,
    state_differences,
    without_unread,
)
from ironloop.tools.doctor.resume_diagnose import findings_for
from tests.conftest import REPO

CASES = "tests.resume_cases"
#: 6 steps an epoch: 9 steps cross an epoch end; checkpoints at 3, 6, 9, the kill at 4.
STEPS = 9


def config(tmp_path, data="clean_data", *extra: str):
    return load_config(None, [f"data.name={CASES}:{data}", f"run.dir={tmp_path / 'run'}",
                              "model.name=mlp", "model.kwargs={hidden: [16]}",
                              "train.batch_size=16", "train.epochs=3", "optim.lr=0.05",
                              "log.every_steps=1", *extra])


def check(tmp_path, cfg, **kwargs):
    """The check, its scratch runs under tmp_path (kept there when the resume is not exact)."""
    return resume_check(cfg, scratch_root=tmp_path / "scratch", **kwargs)


# --- the plan and the comparisons, without a run -------------------------------------------

def test_plan_kills_between_checkpoints_and_resumes_from_the_one_before():
    for steps in range(3, 60):
        p = plan_for(steps)
        assert p.resume_from < p.kill < p.steps
        assert p.resume_from >= 1 and (p.every == 1 or p.kill % p.every)
    assert plan_for(24) == CheckPlan(24, 8, 12) and plan_for(24).resume_from == 8
    with pytest.raises(UserError, match="--steps 2"):
        plan_for(2)


def _rec(batch="b", loss=1.0, weights="w", modules=(("fc (Linear)", "h"),)):
    return {"batches": [batch], "losses": [loss], "weights": weights,
            "modules": [list(m) for m in modules]}


def test_step_comparison_blames_the_batch_before_the_loss_and_names_the_module():
    a = {1: _rec(), 2: _rec(), 3: _rec()}
    assert first_step_difference(a, dict(a), range(1, 4)) is None
    d = first_step_difference(a, {**a, 2: _rec(batch="x", loss=2.0)}, range(1, 4))
    assert (d.step, d.what) == (2, "batch")
    d = first_step_difference(a, {**a, 3: _rec(loss=2.0, modules=(("fc (Linear)", "z"),))},
                              range(1, 4))
    assert (d.step, d.what) == (3, "loss") and "fc (Linear)" in d.detail
    d = first_step_difference(a, {**a, 2: _rec(weights="v")}, range(1, 4))
    assert (d.step, d.what) == (2, "weights")
    assert first_step_difference(a, {1: a[1]}, range(1, 4)).what == "steps"


def test_checkpoint_comparison_names_the_first_key_that_differs():
    a = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}},
         "meter": {"train_seconds": 1.0}, "config": {"run": {"dir": "a"}}}
    b = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}},
         "meter": {"train_seconds": 2.0}, "config": {"run": {"dir": "b"}}}
    assert checkpoint_difference(a, b) is None  # timings and the config differ between runs
    b["optimizer"]["state"][0]["step"] = torch.tensor(5.0)
    assert checkpoint_difference(a, b) == "optimizer.state.0.step"
    b["model"]["w"] = torch.tensor([1.0, 1.0, 1.0 + 1e-7])
    assert checkpoint_difference(a, b) == "model.w"


def test_state_comparison_names_attributes_that_a_checkpoint_does_not_hold():
    a = {"model": {"Scale.calls": 9}, "data": {}, "globals": {"m.N": 1},
         "callbacks": {"0:Counter": {"state_dict": False, "attributes": {"seen": 9}},
                       "1:Saved": {"state_dict": True, "attributes": {"seen": 9}}}}
    b = {"model": {"Scale.calls": 4}, "data": {}, "globals": {"m.N": 1},
         "callbacks": {"0:Counter": {"state_dict": False, "attributes": {"seen": 4}},
                       "1:Saved": {"state_dict": True, "attributes": {"seen": 9}}}}
    found = state_differences(a, b)
    assert [d.what for d in found] == ["model", "callback"]
    assert "Scale.calls" in found[0].detail and "0:Counter" in found[1].detail
    assert state_differences(a, a) == []
    b["globals"]["m.N"] = 2  # a module-level counter in the user's step
    assert "m.N is 2 after the resume, 1 uninterrupted" in state_differences(a, b)[1].detail


def test_an_attribute_that_changed_no_step_is_named_but_not_counted_against_the_resume():
    model = Difference(0, "model", "CallCounter.calls (module 1) is 10 after the resume, 13 "
                                   "uninterrupted")
    data, callback = Difference(0, "data", "Set.reads ..."), Difference(0, "callback", "0:C ...")
    assert without_unread([model, data]) == ([], [model, data])  # every step equal: unread
    assert without_unread([model, callback]) == ([callback], [model])  # a callback: recorded
    loss = Difference(4, "loss", "loss 1.2 instead of 1.1")
    assert without_unread([loss, model]) == ([loss, model], [])  # the likely cause: kept
    found = findings_for("resume is exact (...)", [], 3, 9, [], [model])
    assert [f.severity for f in found] == ["info", "warning"]
    assert "CallCounter.calls" in found[1].measured and "unread" in found[1].measured


def test_a_step_whose_resumed_run_saw_fewer_micro_batches_names_the_missing_one_none():
    a = {1: {**_rec(), "batches": ["b1", "b2"], "losses": [1.0, 1.0]}}
    d = first_step_difference(a, {1: _rec(batch="b1")}, range(1, 2))
    assert (d.step, d.what) == (1, "batch")
    assert d.detail == "micro-batch 2 of 2 holds other tensors (hash none instead of b2)"


class FakeScratch:
    """Stands in for the scratch processes (resume_check._launch): each run writes the record
    its spec asks for, from its config. The crashed run leaves its last checkpoint's step in
    its run.dir; the resumed run starts after the step it finds there, and with ``drift`` its
    batches differ from there on (a counter its checkpoint lost)."""

    def __init__(self, drift: bool):
        self.drift, self.specs = drift, {}

    def __call__(self, spec, scratch, name, nproc, env, fork_threads):
        self.specs[name] = spec
        cfg = spec["config"]
        run_dir, kill = Path(cfg["run"]["dir"]), cfg["fault"]["crash_at_step"]
        steps = range(1, (kill or cfg["train"]["max_steps"]) + 1)
        if kill:
            every = cfg["checkpoint"]["every_steps"]
            run_dir.mkdir(parents=True)
            (run_dir / "last-checkpoint").write_text(str(every * ((kill - 1) // every)))
        if spec["resume"]:
            steps = range(int((run_dir / "last-checkpoint").read_text()) + 1, steps.stop)
        drift = "x" if spec["resume"] and self.drift else ""
        lines = [{"step": i, **_rec(batch=f"b{i}{drift}")} for i in steps]
        if not kill:
            lines.append({"end": steps[-1], "state": {"model": {}, "data": {}, "callbacks": {},
                                                      "globals": {}}})
        Path(spec["record"].format(rank=0)).write_text(
            "".join(json.dumps(line) + "\n" for line in lines))
        return FakeProcess(1 if kill else 0)


class FakeProcess:
    def __init__(self, code: int):
        self.returncode = code

    def wait(self) -> int:
        return self.returncode

    def poll(self) -> int:
        return self.returncode


@pytest.mark.parametrize("drift", [False, True])
def test_the_check_compares_the_resumed_run_with_the_straight_one_from_its_checkpoint_on(
        tmp_path, monkeypatch, drift):
    """The plan, the three runs' specs, the comparison of their records and the verdict, with
    the processes faked (the slow tests below run real ones)."""
    import ironloop.tools.doctor.resume_check as rc

    scratch = FakeScratch(drift)
    monkeypatch.setattr(rc, "_launch", scratch)
    result = check(tmp_path, config(tmp_path), steps=STEPS)
    runs = {name: Path(spec["config"]["run"]["dir"]).name for name, spec in scratch.specs.items()}
    assert runs == {"straight": "straight", "crashed": "crashed", "resumed": "crashed"}
    assert result.exact is not drift
    if drift:  # resumed from step 3: step 4 is the first one that can differ
        assert (result.first.step, result.first.what) == (4, "batch")
        assert (Path(result.scratch) / "resumed-rank0.jsonl").exists()  # kept for a look
    else:
        assert result.headline.startswith("resume is exact (9 steps, kill at step 4")
        assert not any((tmp_path / "scratch").iterdir())


def test_the_recorder_writes_each_step_as_it_ends(tmp_path):
    """A line per optimizer step, on disk when the step ends (a kill keeps it): the hash of
    each training micro-batch, its loss, and the weights after the step."""
    from ironloop.engine.step_fns import classification_step
    from ironloop.tools.doctor.resume_compare import read_records
    from ironloop.tools.doctor.resume_record import Recorder, digest
    from tests.conftest import blobs, tiny_mlp

    model, data = tiny_mlp(), blobs(8)
    path = tmp_path / "straight-rank0.jsonl"
    recorder = Recorder(path, model, data, [], None)
    step = recorder.wrap(classification_step(torch.nn.functional.cross_entropy))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = []
    for i in (1, 2):
        batch = (data.x[4 * i - 4:4 * i], data.y[4 * i - 4:4 * i])
        step(model, batch)[0].backward()
        opt.step()
        recorder.on_step_end(None, {"step": i})
        weights.append(digest(list(model.parameters())))
        record = read_records(path).steps[i]  # before the run ends
        assert record["batches"] == [digest(batch)] and len(record["losses"]) == 1
        assert record["weights"] == weights[-1]
    assert weights[0] != weights[1]
    recorder.file.close()


def test_the_user_modules_are_those_of_the_users_own_classes_and_functions():
    import sys

    from ironloop.tools.doctor.resume_record import user_modules
    from tests import resume_cases

    found = user_modules(resume_cases.counting_step, resume_cases.CountingData,
                         torch.nn.Linear, load_config, type(None))
    assert found == [resume_cases]
    assert user_modules(resume_cases.CountingData(), sys.modules[__name__].config) == \
        [resume_cases, sys.modules[__name__]]



def _record_run(tmp_path, *extra: str) -> Path:
    """One scratch run, straight, in this process (resume_record.record_run): its records."""
    from ironloop.tools.doctor.resume_check import scratch_config
    from ironloop.tools.doctor.resume_record import record_run

    spec = {"config": scratch_config(config(tmp_path, "clean_data", *extra), plan_for(STEPS),
                                     tmp_path / "straight", crash=False),
            "record": str(tmp_path / "straight-rank{rank}.jsonl"), "callbacks": [],
            "resume": False}
    record_run(spec)
    return tmp_path


def test_each_rank_of_a_scratch_run_records_to_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # what torchrun sets in rank 1's process
    _record_run(tmp_path)
    assert [p.name for p in tmp_path.glob("straight-rank*.jsonl")] == ["straight-rank1.jsonl"]


def test_a_scratch_runs_end_record_holds_the_globals_of_the_users_step_fn(tmp_path, monkeypatch):
    from tests import resume_cases

    monkeypatch.setattr(resume_cases, "CALLS", 0)  # the step counts its calls in a global
    _record_run(tmp_path, f"train.step_fn={CASES}:counting_step")
    from ironloop.tools.doctor.resume_compare import read_records

    state = read_records(tmp_path / "straight-rank0.jsonl").state
    assert state["globals"]["tests.resume_cases.CALLS"] == resume_cases.CALLS > 0

def test_a_forked_scratch_run_writes_its_output_to_its_log_and_exits_with_its_code(
        tmp_path, monkeypatch):
    """resume_record.forked, in this process: fds 1 and 2 and Python's own streams go to the
    log (a failing spec's traceback lands there), then os._exit with main's code."""
    import os
    import sys

    from ironloop.tools.doctor import resume_record

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(resume_record.os, "_exit", exit_)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    saved = os.dup(1), os.dup(2)
    log = tmp_path / "crashed.log"
    try:
        with pytest.raises(Exited) as e:
            resume_record.forked(str(tmp_path / "missing.json"), str(log),
                                 torch.get_num_threads())
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    assert e.value.args == (70,)
    assert "FileNotFoundError" in log.read_text()


# --- real scratch runs --------------------------------------------------------------------

@pytest.mark.slow
def test_clean_pipeline_is_exact(tmp_path):
    result = check(tmp_path, config(tmp_path), steps=STEPS,
                   callbacks=[f"{CASES}:SavedStepCounter"])
    assert result.exact, [f.render() for f in result.findings]
    assert result.findings[0].severity == "info"
    assert result.headline == ("resume is exact (9 steps, kill at step 4, resumed from step 3 "
                               "in a new process)")
    assert not (tmp_path / "run" / "checkpoints").exists()  # scratch runs only
    assert not any((tmp_path / "scratch").iterdir())  # and removed once exact


@pytest.mark.slow
def test_lbfgs_by_name_is_exact(tmp_path):
    # optim.name takes any torch.optim class: the check reaches a closure optimizer (issue 44)
    cfg = config(tmp_path, "clean_data", "optim.name=LBFGS", "optim.args={max_iter: 3}")
    result = check(tmp_path, cfg, steps=STEPS)
    assert result.exact, [f.render() for f in result.findings]


@pytest.mark.slow
def test_a_two_optimizer_gan_from_its_config_is_exact(tmp_path):
    # configs/gan.yaml: the step updates both optimizers itself (engine/several.py); the check's
    # recorder wraps that step too, and the resume is exact with both optimizers' states
    cfg = load_config(str(REPO / "configs" / "gan.yaml"),
                      [f"run.dir={tmp_path / 'run'}", "train.batch_size=16"])
    result = check(tmp_path, cfg, steps=STEPS)
    assert result.exact, [f.render() for f in result.findings]


@pytest.mark.slow
def test_dataset_counter_is_caught_and_blamed_on_the_data(tmp_path):
    result = check(tmp_path, config(tmp_path, "counting_data"), steps=STEPS)
    assert not result.exact
    assert (result.first.step, result.first.what) == (4, "batch")  # the first after the resume
    head = result.findings[0]
    assert head.severity == "error" and "resume is NOT exact" in head.measured
    assert head.cause.startswith("the batches differ at the first step after the resume, so "
                                 "the data")
    assert any("CountingData.reads" in f.measured for f in result.findings[1:])  # named
    assert (Path(result.scratch) / "straight-rank0.jsonl").exists()  # kept for a look


@pytest.mark.slow
def test_model_python_counter_is_caught(tmp_path):
    cfg = config(tmp_path, "clean_data", f"model.name={CASES}:counting_model")
    result = check(tmp_path, cfg, steps=STEPS)
    assert not result.exact
    assert (result.first.step, result.first.what) == (4, "loss")  # the batches are equal
    assert "CountingScale" in result.first.detail  # the module whose output differs first
    assert result.findings[0].cause.startswith("the model or the step")
    assert any("CountingScale.calls" in f.measured for f in result.findings)


@pytest.mark.slow
def test_a_call_counter_that_forward_never_reads_leaves_the_resume_exact(tmp_path):
    # #42 finding 11: "NOT exact ... every step is equal" (exit 1) where a real crash and
    # resume is torch.equal: the counter differs, nothing the run computes reads it.
    cfg = config(tmp_path, "clean_data", f"model.name={CASES}:call_counting_model")
    result = check(tmp_path, cfg, steps=STEPS)
    assert result.exact, [f.render() for f in result.findings]
    assert [d.detail.split(" ")[0] for d in result.unread] == ["CallCounter.calls"]
    assert [f.severity for f in result.findings] == ["info", "warning"]


@pytest.mark.slow
def test_callback_hidden_state_is_named(tmp_path):
    result = check(tmp_path, config(tmp_path), steps=STEPS, callbacks=[f"{CASES}:StepCounter"])
    assert not result.exact
    assert result.first.what == "callback"  # every step and the checkpoints are equal
    assert "0:StepCounter" in result.first.detail and "seen" in result.first.detail
    assert "state_dict" in result.findings[0].fix


@pytest.mark.slow
def test_unseeded_rng_is_blamed_before_any_crash(tmp_path):
    result = check(tmp_path, config(tmp_path, "unseeded_data"), steps=STEPS)
    assert not result.exact
    assert (result.first.step, result.first.what) == (1, "fresh batch")
    assert result.findings[0].cause.startswith("two fresh processes")


@pytest.mark.slow
def test_stream_is_exact(tmp_path):
    cfg = config(tmp_path, "stream_data", "train.accumulation_steps=2")
    result = check(tmp_path, cfg, steps=STEPS)
    assert result.exact, [f.render() for f in result.findings]


@pytest.mark.slow
def test_tbptt_step_is_exact(tmp_path):
    from tests.e2e.test_tbptt_lstm import CORPUS

    (tmp_path / "input.txt").write_text(CORPUS)
    cfg = load_config("configs/tbptt_lstm.yaml", [
        f"data.root={tmp_path}", f"run.dir={tmp_path / 'run'}",
        "data.kwargs={streams: 4, bptt: 8}", "model.kwargs={dim: 16, hidden: 24}",
        "train.batch_size=4", "train.epochs=2"])
    result = check(tmp_path, cfg, steps=STEPS)
    assert result.exact, [f.render() for f in result.findings]


@pytest.mark.slow
def test_cli_exits_1_when_not_exact_and_adds_to_doctor_json(tmp_path, capsys, monkeypatch):
    import tempfile

    from ironloop.cli import main

    # The command in this process (cli.main, what `python -m ironloop` runs): its scratch runs
    # are the processes that matter, and one interpreter start less per check.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept scratch runs go there
    run = tmp_path / "run"
    run.mkdir()
    (run / "doctor.json").write_text(json.dumps({"seconds": 1.0, "findings": ["kept"]}))
    args = ["doctor", f"data.name={CASES}:counting_data", f"run.dir={run}", "model.name=mlp",
            "model.kwargs={hidden: [16]}", "train.batch_size=16", "--resume-check",
            "--steps", str(STEPS)]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "resume is NOT exact" in out and "cause: the batches differ" in out
    doctor = json.loads((run / "doctor.json").read_text())
    assert doctor["findings"] == ["kept"]  # the other checks' findings stay
    assert doctor["resume_check"]["exact"] is False
    assert doctor["resume_check"]["first_difference"]["what"] == "batch"
    args[1] = f"data.name={CASES}:clean_data"
    code, out = main(args), capsys.readouterr().out
    assert code == 0, out
    assert "resume is exact (9 steps, kill at step 4" in out
    assert json.loads((run / "doctor.json").read_text())["resume_check"]["exact"] is True


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_accumulation_is_exact(tmp_path, precision):
    cfg = config(tmp_path, "clean_data", f"train.precision={precision}",
                 "train.accumulation_steps=2")
    result = check(tmp_path, cfg, steps=STEPS)
    assert result.exact, [f.render() for f in result.findings]


@pytest.mark.slow
def test_every_rank_is_checked_under_torchrun(tmp_path):
    # Rank 0's data is clean, rank 1's keeps a counter: only rank 1's records can tell.
    cfg = config(tmp_path, "rank1_counting_data", "train.batch_size=8")
    result = check(tmp_path, cfg, steps=STEPS, nproc=2)
    assert not result.exact
    assert result.first.what == "batch" and result.first.detail.startswith("rank 1: ")
    assert "2 ranks each checked" in result.headline



def test_under_torchrun_every_scratch_run_starts_with_all_its_ranks(tmp_path, monkeypatch):
    """The three scratch runs of --nproc 2, launched without running them: each is a torchrun
    of 2 ranks (the crashed one exits 1, as fault.crash_at_step makes it)."""
    import ironloop.tools.doctor.resume_check as rc

    started = []

    class Exited:
        def __init__(self, argv, **_kwargs):
            started.append(argv)
            self.code = 1 if argv[-1].endswith("crashed.json") else 0

        def wait(self):
            return self.code

        poll = wait

    monkeypatch.setattr(rc.subprocess, "Popen", Exited)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rc.run_scratch(config(tmp_path), rc.plan_for(STEPS), scratch, [], nproc=2)
    assert [Path(argv[-1]).name for argv in started] == ["straight.json", "crashed.json",
                                                         "resumed.json"]
    assert all("--nproc-per-node=2" in argv for argv in started), started

def test_preflight_points_a_long_run_to_the_resume_check(tmp_path, capsys):
    from ironloop.data.bundle import DataBundle
    from ironloop.tools.doctor.run import preflight
    from tests.conftest import blobs, tiny_mlp

    bundle = DataBundle(blobs(128), blobs(32, seed=1), None, (8,), 3)
    for epochs, long in ((10, False), (2000, True)):  # 4 steps an epoch: 40 or 8,000 steps
        run_dir = tmp_path / str(epochs)
        preflight(load_config(None, [f"run.dir={run_dir}", f"train.epochs={epochs}",
                                     "train.batch_size=32"]),
                  tiny_mlp(), bundle)
        closing = capsys.readouterr().out.strip().splitlines()[-1]
        assert closing.startswith("doctor: ")
        assert ("--resume-check" in closing) is long, closing
        if long:
            assert "a long run (8000 steps)" in closing


@pytest.mark.slow
def test_scratch_runs_started_as_new_interpreters_catch_the_counter_too(tmp_path, monkeypatch):
    # Where nothing can be forked (CUDA initialised in the doctor, no fork): python -m.
    import ironloop.tools.doctor.resume_check as rc

    monkeypatch.setattr(rc, "fork_threads", lambda *args: None)
    result = check(tmp_path, config(tmp_path, "counting_data"), steps=STEPS)
    assert (result.first.step, result.first.what) == (4, "batch")


@pytest.mark.slow
def test_step_with_a_global_is_caught_and_the_global_named(tmp_path):
    cfg = config(tmp_path, "clean_data", f"train.step_fn={CASES}:counting_step")
    result = check(tmp_path, cfg, steps=STEPS)
    assert (result.first.step, result.first.what) == (4, "loss")
    assert "module" not in result.first.detail  # every module's output is equal: the step
    assert result.findings[0].cause.startswith("the step: ")
    assert any("tests.resume_cases.CALLS" in f.measured and "(global)" in f.measured
               for f in result.findings)


def test_bad_steps_or_nproc_is_one_line_exit_2(tmp_path, capsys):
    from ironloop.cli import main

    code = main(["doctor", f"run.dir={tmp_path / 'run'}", "--resume-check", "--nproc", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--nproc 0" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
