"""tools.doctor.resume_compare in this process, on fabricated records: what each comparison names
(the step, the kind, the detail) in the records, the checkpoints and the state kept outside them."""

from __future__ import annotations

import json
import math

import torch

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
from tests.tools.doctor.resume_helpers import held_state, rec

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


def test_hidden_state_differences_name_the_value_after_the_resume_and_uninterrupted():
    a = held_state({"M.calls": 9, "M.k": 1}, {"D.reads": 5}, {"m.N": 1})
    b = held_state({"M.calls": 4, "M.k": 1, "M.new": 2}, {"D.reads": 3}, {"m.N": 2})
    assert state_differences(a, b) == [
        Difference(0, "model", "M.calls is 4 after the resume, 9 uninterrupted"),
        Difference(0, "model", "M.new is 2 after the resume, None uninterrupted"),
        Difference(0, "data", "D.reads is 3 after the resume, 5 uninterrupted"),
        Difference(0, "global", "m.N is 2 after the resume, 1 uninterrupted")]
    assert state_differences(a, None) == [] and state_differences(None, b) == []
    assert state_differences({}, b) == []


def test_a_callback_without_state_dict_names_the_attributes_that_differ():
    a = held_state(callbacks={"0:C": {"state_dict": False,
                                  "attributes": {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}},
                          "1:S": {"state_dict": True, "attributes": {"a": 1}},
                          "2:Gone": {"state_dict": False, "attributes": {"n": 1}}})
    b = held_state(callbacks={"0:C": {"state_dict": False,
                                  "attributes": {"a": 1, "b": 0, "c": 0, "d": 0, "e": 0}},
                          "1:S": {"state_dict": True, "attributes": {"a": 2}}})
    assert state_differences(a, b) == [
        Difference(0, "callback", "0:C has no state_dict, and its b, c, d, e differ after the "
                                  "resume (b: 0 vs 2; c: 0 vs 3; d: 0 vs 4)"),
        Difference(0, "callback", "2:Gone has no state_dict, and its n differ after the resume "
                                  "(n: None vs 1)")]


def test_stateless_callbacks_are_those_with_attributes_and_no_state_dict():
    state = held_state(callbacks={"0:C": {"state_dict": False, "attributes": {"n": 1}},
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
