"""tools.doctor.run and findings in process: a finding's lines, each check's outcome, the summary,
doctor.json, --strict, the preflight and `ironloop doctor` on tiny models and data."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from ironloop.config import Config
from ironloop.engine.step_fns import lm_step
from ironloop.errors import UserError
from ironloop.tools.doctor import data_checks, env_checks, lr_find, model_checks as mc, run as drun
from ironloop.tools.doctor.findings import Finding, info
from tests.conftest import blobs, tiny_mlp
from tests.tools.doctor.helpers import Scripted, batch_of, config, labelled, make

# -- findings -------------------------------------------------------------------------------------

def test_a_finding_renders_its_cause_and_fix_lines_only_when_it_has_them():
    f = Finding("probabilities", "error", "measured 1", "the cause", "the fix")
    assert f.render() == ("error: [probabilities] measured 1\n    cause: the cause\n"
                          "    fix:   the fix")
    assert Finding("x", "warning", "m", "", "f").render() == "warning: [x] m\n    fix:   f"
    assert Finding("x", "warning", "m", "c", "").render() == "warning: [x] m\n    cause: c"
    assert info("x", "m") == Finding("x", "info", "m", "", "")
    assert info("x", "m").render() == "info: [x] m"
    assert f.to_dict() == {"check": "probabilities", "severity": "error", "measured": "measured 1",
                           "cause": "the cause", "fix": "the fix"}


def test_a_finding_refuses_an_unknown_severity():
    for sev in ("error", "warning", "info", "skipped"):
        Finding("x", sev, "", "", "")
    with pytest.raises(ValueError, match="severity must be one of .*'fatal'"):
        Finding("x", "fatal", "", "", "")


# -- running the checks ---------------------------------------------------------------------------

def test_a_check_s_outcome_is_its_worst_finding():
    def f(check, severity):
        return Finding(check, severity, "", "", "")

    found = [info("a", ""), f("a", "warning"), f("b", "skipped"), info("b", ""), f("c", "error"),
             f("c", "warning"), info("d", "")]
    assert drun.outcomes(found) == {"a": "warning", "b": "skipped", "c": "error", "d": "passed"}
    assert list(drun.outcomes(found)) == ["a", "b", "c", "d"]


def test_the_summary_counts_the_checks_by_outcome_and_says_why_some_were_skipped():
    found = [info("a", "fine"), Finding("b", "warning", "w", "c", "f"),
             Finding("c", "skipped", "no cuda", "", ""), Finding("d", "error", "e", "", ""),
             Finding("e", "error", "e2", "", "")]
    assert drun.render(found, verbose=False) == "\n".join([
        "warning: [b] w\n    cause: c\n    fix:   f", "error: [d] e", "error: [e] e2",
        "doctor: 2 error(s), 1 warning(s), 1 passed, 1 skipped: c (no cuda)"])
    assert drun.render(found, verbose=True).startswith("info: [a] fine\nwarning: [b] w")
    assert drun.render([info("a", "x"), info("b", "y")], verbose=False) == \
        "doctor: 2 checks passed"
    assert drun.render([info("a", "x"), Finding("b", "skipped", "why", "", "")], False) == \
        "doctor: 1 passed, 1 skipped: b (why)"


def test_doctor_json_holds_the_seconds_and_every_finding(tmp_path):
    out = tmp_path / "new" / "doctor.json"
    drun.write_json([info("a", "x")], out, 1.23456)
    assert json.loads(out.read_text()) == {"seconds": 1.235, "findings": [
        {"check": "a", "severity": "info", "measured": "x", "cause": "", "fix": ""}]}
    assert out.read_text().endswith("}\n") and '\n  "seconds"' in out.read_text()
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot be created or written"):
        drun.write_json([], tmp_path / "file" / "doctor.json", 0.0)


def test_strict_stops_on_the_first_error_with_its_fix():
    found = [Finding("a", "warning", "w", "", ""), Finding("b", "error", "m1", "", "f1"),
             Finding("c", "error", "m2", "", "f2")]
    with pytest.raises(drun.DoctorError) as e:
        drun.stop_if_strict(found, True)
    assert str(e.value) == "doctor found 2 error(s) and --strict is set; first: [b] m1; fix: f1"
    drun.stop_if_strict(found, False)
    drun.stop_if_strict(found[:1], True)


def test_the_resume_hint_is_for_runs_of_five_thousand_steps_or_more(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config(train__batch_size=10, train__epochs=1)
    assert drun.resume_hint(cfg, 49990) == ""
    assert drun.resume_hint(cfg, 49991) == (
        "; a long run (5000 steps): `ironloop doctor` with these arguments and --resume-check "
        "proves in seconds that a crash will cost nothing")
    assert "(10000 steps)" in drun.resume_hint(config(train__batch_size=10, train__epochs=2),
                                                50000)
    assert drun.resume_hint(config(train__batch_size=10, train__epochs=1,
                                   train__accumulation_steps=2), 50000) \
        == ""
    assert drun.resume_hint(config(train__batch_size=10, train__epochs=2,
                                   train__max_steps=4999), 50000) == ""
    assert "(5000 steps)" in drun.resume_hint(config(train__batch_size=10, train__epochs=2,
                                                     train__max_steps=5000), 50000)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert drun.resume_hint(cfg, 50000) == ""


def test_a_check_that_raises_is_skipped_with_the_error_or_an_oom_error():
    def raises(e):
        def fn(*a, **k):
            assert a == (1, 2) and k == {"x": 3}
            raise e
        return fn

    assert drun._guard("c", raises(ValueError("boom")), 1, 2, x=3) == [
        Finding("c", "skipped", "it raised ValueError: boom", "", "")]
    (f,) = drun._guard("c", raises(torch.OutOfMemoryError("CUDA out of memory.\nmore")), 1, 2,
                       x=3)
    assert f == Finding("c", "error", "out of device memory during the c check (CUDA out of "
                                      "memory.)", "one training step at this batch size does "
                                      "not fit", "lower train.batch_size and raise "
                        "train.accumulation_steps, or use train.precision=bf16")
    (f,) = drun._guard("c", raises(torch.OutOfMemoryError()), 1, 2, x=3)
    assert f.measured == "out of device memory during the c check (OOM)"
    assert drun._guard("c", lambda *a, **k: [a, k], 1, x=2) == [(1,), {"x": 2}]


def test_the_probe_says_which_batch_raised_and_lets_an_oom_through():
    calls = []

    def step(model, batch):
        calls.append((model.training, torch.is_inference_mode_enabled()))
        if batch[0].shape[0] == 3:
            raise RuntimeError("val broke")
        return model(batch[0]).sum(), {}

    from ironloop.data.source import eval_split

    val, batching = eval_split(blobs(3, seed=1), "val_data", config(), None, 1)
    s = make(step=step, val=val)
    s.val_batching = batching
    with pytest.raises(RuntimeError) as e:
        drun.probe_step(s, batch_of())
    assert calls == [(True, False), (False, True)]
    assert e.value.__notes__ == ["ironloop: raised in the preflight, running the run's step on "
                                 "the first validation batch; the run itself would raise the "
                                 "same"]
    s.step_fn = lambda m, b: (_ for _ in ()).throw(UserError("bad"))
    with pytest.raises(UserError) as e:
        drun.probe_step(s, batch_of())
    assert not hasattr(e.value, "__notes__")
    s.step_fn = lambda m, b: (_ for _ in ()).throw(KeyError("k"))
    with pytest.raises(KeyError) as e:
        drun.probe_step(s, batch_of())
    assert "the first training batch" in e.value.__notes__[0]
    s.step_fn = lambda m, b: (_ for _ in ()).throw(torch.OutOfMemoryError("oom"))
    assert drun.probe_step(s, batch_of()) is None


def test_the_checks_get_the_cap_the_small_batch_the_steps_and_the_budget(monkeypatch):
    seen = {}

    def record(name):
        def fn(*a, **k):
            seen[name] = (a[1:], k)
            return [info(name, "")]
        return fn

    for name in ("check_labels", "check_finite_inputs", "check_leakage", "check_input_bound"):
        monkeypatch.setattr(data_checks, name, record(name))
    for name in ("check_initial_loss", "check_probabilities", "check_overfit_batch",
                 "check_dead_parameters", "check_memory"):
        monkeypatch.setattr(mc, name, record(name))
    s = make(train=blobs(40), train__batch_size=20, doctor__max_batches=3,
             doctor__overfit_steps=7, doctor__memory_search=True)
    found = drun.check(s, quick=True)
    assert [f.check for f in found] == [
        "check_labels", "check_finite_inputs", "check_leakage", "threads", "check_initial_loss",
        "check_probabilities", "check_overfit_batch", "check_dead_parameters",
        "check_input_bound", "check_memory"]
    assert seen["check_labels"] == ((60,), {}) and seen["check_leakage"] == ((60,), {})
    small, steps = seen["check_overfit_batch"][0]
    assert len(small[0]) == 16 and steps == 7 and len(seen["check_initial_loss"][0][0][0]) == 20
    assert seen["check_input_bound"][0][1] == 3 and seen["check_input_bound"][1] == {
        "budget": 0.05}
    assert seen["check_memory"][1] == {"search": True}
    drun.check(s, quick=False)
    assert seen["check_labels"] == ((None,), {}) and seen["check_input_bound"][1] == {
        "budget": 0.3}


def test_label_errors_stop_the_checks_before_the_model_checks():
    s = labelled([0, 5, 1, 2])
    found = drun.check(s)
    assert [f.check for f in found if f.check not in ("finite_inputs",)] == [
        "labels", "labels", "threads"]
    s = labelled([0, 0, 1, 1], c=4)  # a warning only: the model checks run
    assert "initial_loss" in {f.check for f in drun.check(s)}


def test_no_batch_or_a_step_that_raises_ends_the_checks_with_a_finding():
    s = make(train=[])
    found = drun.check(s)
    assert found[-1].check == "model" and found[-1].severity == "skipped"
    assert found[-1].measured.startswith("no training batch to check with: it raised ")

    def broken(model, batch):
        raise ValueError("no forward")

    s = make(step=broken)
    last = drun.check(s)[-1]
    assert last == Finding("step", "error", "the run's step raised ValueError: no forward",
                           "the run would stop with this error at its first step or its first "
                           "evaluation", "fix the model's forward or pass the step it needs "
                           "(train.step_fn)")
    with pytest.raises(ValueError, match="no forward"):
        drun.check(s, raise_step=True)


def test_the_subject_runs_the_named_step_or_the_default_one_with_the_inferred_classes():
    s = drun.subject(tiny_mlp(c=5), blobs(16), cfg=config(train__step_fn="lm"))
    assert s.step_fn is lm_step and s.user_step and s.num_classes is None
    s = drun.subject(tiny_mlp(c=5), blobs(16), cfg=config())
    assert not s.user_step and s.num_classes == 5 and s.device == torch.device("cpu")
    assert s.cfg.train.batch_size == 4 and s.val is None and s.test is None
    assert drun.subject(tiny_mlp(c=5), blobs(16), num_classes=3).num_classes == 3
    mine = Scripted(1.0)
    s = drun.subject(tiny_mlp(), blobs(16), step_fn=mine)
    assert s.step_fn is mine and s.user_step and s.num_classes is None
    s = drun.subject(tiny_mlp(), blobs(16), loss_fn=F.mse_loss)
    assert s.loss_fn is F.mse_loss
    s = drun.subject(tiny_mlp(), blobs(16), cfg=config(loss__name="torch.nn.functional:l1_loss"))
    assert s.loss_fn is F.l1_loss
    assert drun.subject(tiny_mlp(), blobs(16), val=blobs(4)).val_batching is not None


def test_the_subject_refuses_a_stream():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(UserError, match=r"^the doctor reads samples by index, and the training "
                                        r"data is a stream \(an IterableDataset\); check a "
                                        r"map-style sample of it instead$"):
        drun.subject(tiny_mlp(), Stream())


def test_the_preflight_is_skipped_when_off_on_other_ranks_and_on_a_resume_that_ran_it(
        tmp_path, monkeypatch, capsys):
    bundle = SimpleNamespace(train=blobs(16), first_val=None, test=None, num_classes=3)
    cfg = config(run__dir=str(tmp_path), doctor__preflight=True)
    monkeypatch.setenv("RANK", "0")
    assert drun.preflight(config(run__dir=str(tmp_path), doctor__preflight=False),
                          tiny_mlp(), bundle) == []
    monkeypatch.setenv("RANK", "1")
    assert drun.preflight(cfg, tiny_mlp(), bundle) == []
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "doctor.json").write_text("{}")
    assert drun.preflight(cfg, tiny_mlp(), bundle, resume=True) == []
    assert capsys.readouterr().out == ""
    found = drun.preflight(cfg, tiny_mlp(), bundle, resume=False)
    out = capsys.readouterr().out
    assert found and out.startswith("preflight: the doctor's quick checks")
    assert f"details in {tmp_path / 'doctor.json'})" in out
    assert len(json.loads((tmp_path / "doctor.json").read_text())["findings"]) == len(found)


def synthetic_config(tmp_path, **over) -> Config:
    return config(run__dir=str(tmp_path / "run"), data__name="synthetic", data__num_samples=40,
                  data__input_shape=[8], data__num_classes=3, model__name="mlp", **over)


def test_ironloop_doctor_runs_every_check_at_full_size_and_writes_doctor_json(
        tmp_path, monkeypatch, capsys):
    seen = []
    found = [info("a", "fine"), Finding("b", "error", "bad", "", "the fix")]
    monkeypatch.setattr(drun, "check", lambda s, quick: seen.append((s, quick)) or list(found))
    monkeypatch.setattr(lr_find, "check_lr_find", lambda s, out: seen.append(out) or [
        info("lr_find", "swept")])
    cfg = synthetic_config(tmp_path)
    out = drun.doctor_config(cfg, lr_find=True)
    (s, quick), plot = seen
    assert quick is False and s.cfg is cfg and s.num_classes == 3 and len(s.train) == 32
    assert len(s.val) == 8 and plot == tmp_path / "run" / "lr_find.png"
    assert out == [*found, info("lr_find", "swept")]
    doctor_json = tmp_path / "run" / "doctor.json"
    assert [f["check"] for f in json.loads(doctor_json.read_text())["findings"]] == [
        "a", "b", "lr_find"]
    printed = capsys.readouterr().out
    assert printed.startswith("info: [a] fine\nerror: [b] bad\n    fix:   the fix\n"
                              "info: [lr_find] swept\ndoctor: 1 error(s), 2 passed (")
    assert printed.endswith(f" s; written to {doctor_json})\n")
    seen.clear()
    drun.doctor_config(cfg)
    assert len(seen) == 1  # no LR range test unless asked
    with pytest.raises(drun.DoctorError):
        drun.doctor_config(cfg, strict=True)
    with pytest.raises(drun.DoctorError):
        drun.doctor_config(synthetic_config(tmp_path, doctor__strict=True))


def test_the_preflight_prints_its_summary_and_stops_on_an_error_only_when_strict(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    seen = []
    found = [Finding("b", "error", "bad", "", "the fix")]
    monkeypatch.setattr(drun, "check", lambda s, quick, raise_step: seen.append(
        (s, quick, raise_step)) or list(found))
    bundle = SimpleNamespace(train=blobs(16), first_val=blobs(4, seed=1), test=blobs(2, seed=2),
                             num_classes=4)  # the data's class count, not the model's 3
    cfg = synthetic_config(tmp_path)
    step = Scripted(1.0)
    assert drun.preflight(cfg, tiny_mlp(), bundle, step_fn=step, loss_fn=F.mse_loss) == found
    ((s, quick, raise_step),) = seen
    assert quick is True and raise_step is True and s.step_fn is step and s.loss_fn is F.mse_loss
    assert s.num_classes == 4
    assert len(s.val) == 4 and len(s.test) == 2
    out = capsys.readouterr().out
    assert "error: [b] bad" in out and "doctor: 1 error(s) (" in out
    with pytest.raises(drun.DoctorError):
        drun.preflight(cfg, tiny_mlp(), bundle, strict=True)
    with pytest.raises(drun.DoctorError):
        drun.preflight(synthetic_config(tmp_path, doctor__strict=True), tiny_mlp(), bundle)
    drun.preflight(synthetic_config(tmp_path, doctor__strict=True), tiny_mlp(), bundle,
                   strict=False)


def test_a_check_that_raises_is_listed_under_its_own_name(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom")

    for name in ("check_labels", "check_finite_inputs", "check_leakage", "check_input_bound"):
        monkeypatch.setattr(data_checks, name, boom)
    for name in ("check_initial_loss", "check_probabilities", "check_overfit_batch",
                 "check_dead_parameters", "check_memory"):
        monkeypatch.setattr(mc, name, boom)
    monkeypatch.setattr(env_checks, "check_threads", boom)
    assert drun.outcomes(drun.check(make())) == {name: "skipped" for name in (
        "labels", "finite_inputs", "leakage", "threads", "initial_loss", "probabilities",
        "overfit_batch", "dead_parameters", "input_bound", "memory")}
