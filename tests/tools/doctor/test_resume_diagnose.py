"""tools.doctor.resume_diagnose on fabricated differences: the cause and fix each one leads to."""

from __future__ import annotations

from ironloop.tools.doctor.resume_compare import Difference
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
