"""engine/step_fns.py's small parts, in this process: what a step may return, the label check's
bounds, and the one-line errors for a model whose output or inputs do not fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ironloop.engine import step_fns
from ironloop.errors import DataError, UserError


def test_describe_names_shapes_and_dtypes_two_levels_deep():
    batch = {"x": torch.zeros(4, 3), "y": [torch.zeros(4, dtype=torch.long), (1, 2)]}
    assert step_fns.describe(batch) == \
        "{x: Tensor[4, 3] float32, y: a list (Tensor[4] int64, a tuple)}"
    assert step_fns.describe(None) == "None" and step_fns.describe(3) == "a int"
    deep = {"a": {"b": {"c": torch.zeros(1)}}, "l": [[[1]]]}
    assert step_fns.describe(deep) == "{a: {b: a dict}, l: a list (a list)}"


def test_a_step_returns_a_loss_and_metrics_and_may_add_a_weight():
    loss = torch.tensor(1.0)
    assert step_fns.unpack((loss, {})) == (loss, {}, None)
    assert step_fns.unpack([loss, {"acc": loss}, 5]) == (loss, {"acc": loss}, 5)
    with pytest.raises(UserError, match=r"^train.step_fn returned a float; return \(loss, "):
        step_fns.unpack(1.0, "train.step_fn")
    with pytest.raises(UserError, match=r"^step_fn returned a tuple \(Tensor\[\] float32\)"):
        step_fns.unpack((loss,))
    with pytest.raises(UserError, match="returned a tuple"):
        step_fns.unpack((loss, [], 1))  # metrics not a dict


@pytest.mark.parametrize("labels, ok", [([0, 2], True), ([0, 3], False), ([-1, 1], False)])
def test_labels_must_be_class_indices_below_the_class_count(labels, ok):
    check = step_fns.label_checker(3)
    batch = (torch.zeros(2, 1), torch.tensor(labels))
    if ok:
        check(batch)
    else:
        with pytest.raises(DataError, match=rf"^labels must be class indices in \[0, 3\), found a "
                                            rf"batch with labels in \[{min(labels)}, "
                                            rf"{max(labels)}\]"):
            check(batch)


def test_the_label_check_passes_over_what_is_not_a_host_tensor_of_indices():
    check = step_fns.label_checker(3)
    check((torch.zeros(2), torch.tensor([5.0, 7.0])))  # soft or regression targets
    check((torch.zeros(0), torch.zeros(0, dtype=torch.long)))  # an empty split
    check((torch.zeros(2), torch.tensor([9], device="meta")))  # on a device: not read
    check((torch.zeros(2),))  # no targets
    check(torch.tensor([9]))  # not a pair


def test_a_scalar_output_is_told_to_return_a_row_per_sample():
    err = step_fns.misfit(torch.tensor(1.0), torch.zeros(4, dtype=torch.long),
                          RuntimeError("size mismatch\nmore"))
    assert str(err) == ("the model's output Tensor[] float32 does not fit the loss for targets "
                        "Tensor[4] int64 (size mismatch); the model returned one number for the "
                        "whole batch (a .sum() or .mean() in its forward?): return one row of "
                        "scores per sample, or set loss.name / pass a loss_fn or step_fn")


def test_column_class_targets_are_told_to_flatten_and_the_rest_to_fit_the_loss():
    out = torch.zeros(4, 3)
    column = str(step_fns.misfit(out, torch.zeros(4, 1, dtype=torch.long), RuntimeError("x")))
    assert "; class indices go in a [batch] tensor, not [batch, 1]: flatten the targets " \
           "(y.view(-1), or y.squeeze(1) in the dataset), or set loss.name" in column
    other = str(step_fns.misfit(out, torch.zeros(4, 1), RuntimeError("x")))  # float targets
    assert "; make the model's last layer output what the loss takes (cross_entropy: " \
           "[batch, classes] scores for [batch] class indices), or set" in other


def test_input_errors_name_the_fix_for_ints_other_floats_and_shapes():
    model = nn.Linear(3, 2)
    ints = step_fns.input_error(model, torch.zeros(4, 3, dtype=torch.long),
                                RuntimeError("mat1 and mat2 must have the same dtype type"))
    assert isinstance(ints, DataError) and "computes in floats" in str(ints)
    doubles = step_fns.input_error(model, torch.zeros(4, 3, dtype=torch.float64),
                                   RuntimeError("expected scalar type Float"))
    assert isinstance(doubles, DataError)
    assert "model's parameters are float32" in str(doubles)
    assert ".to(torch.float32)" in str(doubles) and "model.to(torch.float64)" in str(doubles)
    shape = step_fns.input_error(model, torch.zeros(4, 5),
                                 RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert type(shape) is UserError
    assert "make the model take samples of shape [5], the data's, in its first layer " \
           "(e.g. nn.Linear(5, ...))" in str(shape)
    images = step_fns.input_error(model, torch.zeros(4, 1, 5), RuntimeError("size mismatch"))
    assert images is not None and "shape [1, 5], the data's, in its first layer, or" in str(images)
    assert step_fns.input_error(model, torch.zeros(4, 3), RuntimeError("CUDA error")) is None
    assert step_fns.input_error(model, [torch.zeros(1)], RuntimeError("size")) is None


def test_an_output_without_a_loss_is_named():
    loss = torch.tensor(2.0)
    assert step_fns.output_loss({"loss": loss}) is loss
    assert step_fns.output_loss(type("Out", (), {"loss": loss})()) is loss
    with pytest.raises(UserError, match=r"^the model returned \{logits: Tensor\[1\] float32\}; "):
        step_fns.output_loss({"logits": torch.zeros(1)})


def test_an_error_s_first_line_is_cut_to_its_width_and_an_empty_message_stays_empty():
    assert step_fns._first_line(RuntimeError("  abcdef\nsecond  "), 3) == "abc"
    assert step_fns._first_line(RuntimeError("")) == ""
    assert step_fns._first_line(RuntimeError("  \n ")) == ""


def test_the_classification_step_turns_a_shape_error_of_the_loss_into_one_line():
    def shapes(out, y):
        raise ValueError("Expected input batch_size (4) to match target batch_size (5)")

    step = step_fns.classification_step(shapes)
    batch = (torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(UserError, match=r"^the model's output Tensor\[4, 2\] float32 does not "
                                        r"fit the loss for targets Tensor\[5\] int64 \(Expected "
                                        r"input batch_size \(4\) to match target batch_size"):
        step(nn.Linear(3, 2), batch)

    def other(out, y):  # not about shapes: the loss's own error, as it came
        raise ValueError("the loss is broken")

    with pytest.raises(ValueError, match="^the loss is broken$"):
        step_fns.classification_step(other)(nn.Linear(3, 2), batch)


class _Output:
    """A Hugging Face-style model output: the logits as an attribute."""

    def __init__(self, logits):
        self.logits = logits


class _Wrapped(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.how, self.embed = how, nn.Embedding(5, 5)

    def forward(self, idx):
        logits = self.embed(idx)
        return {"tensor": logits, "tuple": (logits, None), "object": _Output(logits),
                "none": _Output(None)}[self.how]


@pytest.mark.parametrize("how", ["tensor", "tuple", "object"])
def test_the_lm_step_reads_logits_from_a_tensor_a_tuple_or_an_output_s_logits(how):
    x = torch.tensor([[0, 1, 2], [3, 4, 0]])
    y = torch.tensor([[1, 2, 3], [4, 0, step_fns.IGNORE_INDEX]])
    loss, metrics, weight = step_fns.lm_step(_Wrapped(how), (x, y))
    want = torch.nn.functional.cross_entropy(_Wrapped("tensor")(x).flatten(0, 1), y.flatten(),
                                             ignore_index=step_fns.IGNORE_INDEX)
    assert (metrics, int(weight)) == ({}, 5)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    with pytest.raises(UserError, match=r"^train.step_fn=lm: the model returned a _Output; it "
                                        r"needs logits"):
        step_fns.lm_step(_Wrapped("none"), (x, y))


def test_the_step_kind_says_which_step_computes_the_metrics():
    assert step_fns.step_kind(None, "") == "classification"
    assert step_fns.step_kind(None, "lm") == step_fns.step_kind(step_fns.lm_step, "") == "lm"
    assert step_fns.step_kind(lambda m, b: None, "") == "user"
    assert step_fns.step_kind(None, "pkg:step") == "user"


class _CausalLM(nn.Module):
    """A Hugging Face-style causal LM: keyword inputs, an output carrying its own loss."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, input_ids, labels=None):
        return {"loss": self.scale * input_ids.float().mean(), "logits": None}


def test_a_dict_batch_goes_to_the_model_and_its_loss_is_weighted_by_the_shifted_labels():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    labels = torch.tensor([[5, 6, -100, 7], [-100, 1, 2, -100]])
    loss, metrics, weight = step_fns.lm_step(_CausalLM(), {"input_ids": ids, "labels": labels})
    assert float(loss.detach()) == pytest.approx(2.0 * 4.5) and metrics == {}
    assert int(weight) == 4  # the model shifts by one: the first label never counts
    loss, metrics, weight = step_fns.lm_step(_CausalLM(), {"input_ids": ids})
    assert float(loss.detach()) == pytest.approx(9.0) and weight is None  # no labels: unweighted


class _OwnLoss(nn.Module):
    """nanoGPT's kind of forward(idx, targets), returning an object with .loss."""

    def forward(self, idx, targets=None):
        return _LossOutput(idx.float().sum() / 10)


class _LossOutput:
    def __init__(self, loss):
        self.loss = loss


def test_a_model_taking_targets_gives_its_own_loss_weighted_by_the_targets_that_count():
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    y = torch.tensor([[2, 3, -1], [5, 6, 7]])  # nanoGPT ignores -1
    loss, metrics, weight = step_fns.lm_step(_OwnLoss(), (x, y))
    assert float(loss) == pytest.approx(2.1) and metrics == {} and int(weight) == 5


def test_an_lm_model_that_returns_no_scalar_loss_is_refused_naming_what_it_returned():
    with pytest.raises(UserError) as e:
        step_fns.own_loss((torch.zeros(2, 3), torch.zeros(2)))
    assert str(e.value) == (
        "train.step_fn=lm: the model's forward takes targets, and returned a tuple "
        "(Tensor[2, 3] float32, Tensor[2] float32) when given them; return (logits, loss) with "
        "the loss a scalar mean over the tokens, as nanoGPT does")


def test_a_zero_token_id_target_counts_in_an_own_loss_model_s_weight():
    x = torch.tensor([[1, 2, 3]])
    y = torch.tensor([[0, 0, -1]])  # token id 0 is a real token; only negatives are ignored
    assert int(step_fns.lm_step(_OwnLoss(), (x, y))[2]) == 2


def test_an_own_loss_model_returning_only_logits_in_a_tuple_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^train.step_fn=lm: the model's forward takes targets, "
                                        r"and returned a tuple \(Tensor\[2, 3\] float32\) when "):
        step_fns.own_loss((torch.zeros(2, 3),))


@pytest.mark.parametrize("message", ["size mismatch", "bad shape", "wrong dimension",
                                     "expected input of rank 2", "expected target of rank 1",
                                     "invalid type for target", "the target tensor is long"])
def test_each_shape_phrase_marks_a_loss_error_as_a_shape_error(message):
    assert step_fns._is_shape_error(ValueError(message.upper()))  # case does not matter
    assert not step_fns._is_shape_error(ValueError("the loss is broken"))


def test_a_cannot_be_multiplied_error_of_the_first_layer_names_the_data_s_shape():
    err = step_fns.input_error(nn.Linear(3, 2), torch.zeros(4, 5),
                               RuntimeError("mat1 and mat2 cannot be multiplied (4x5 and 3x2)"))
    assert type(err) is UserError and "take samples of shape [5]" in str(err)


def _data(train, val=None):
    from ironloop.data.source import RunData

    return RunData(source=None, train=train, val_sets={"": val} if val is not None else {},
                   test=None, collate_fn=None)


def test_the_classification_step_infers_the_class_count_only_when_none_is_given():
    from ironloop.config import load_config
    from ironloop.data.loader import TensorData

    cfg = load_config(None, [])
    data = _data(TensorData(torch.zeros(6, 3), torch.tensor([0, 1, 2, 3, 0, 1])))
    model = nn.Linear(3, 4)
    _step, check, classes = step_fns.classification(cfg, model, torch.device("cpu"), None, None,
                                                    data)
    assert classes == 4 and check is None  # in memory: every label checked here, once
    with pytest.raises(DataError, match=r"in \[0, 3\), found a batch with labels in \[0, 3\]"):
        step_fns.classification(cfg, model, torch.device("cpu"), None, 3, data)
    assert step_fns.infer_num_classes(model, data.train, torch.device("cpu")) == 4


def test_a_loss_or_step_named_by_a_spec_that_does_not_import_names_its_config_key():
    from ironloop.config import load_config
    from ironloop.data.loader import TensorData
    from ironloop.errors import ConfigError

    cfg = load_config(None, []).with_overrides({"loss.name": "no_such_module_x:loss"})
    data = _data(TensorData(torch.zeros(2, 3), torch.tensor([0, 1])))
    with pytest.raises(ConfigError, match=r"^loss.name='no_such_module_x:loss': cannot import"):
        step_fns.classification(cfg, nn.Linear(3, 2), torch.device("cpu"), None, 2, data)
    with pytest.raises(ConfigError, match=r"^train.step_fn='no_such_module_x:step': cannot"):
        step_fns.named_step("no_such_module_x:step")
    assert step_fns.named_step("lm") is step_fns.lm_step


def test_accuracy_is_measured_in_evaluation_for_class_scores_and_index_targets_only():
    step = step_fns.classification_step(lambda out, y: out.sum())
    model = nn.Linear(3, 2).eval()
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    scores = model(x)
    y = scores.argmax(-1)
    y[1] = 1 - y[1]  # one of two right
    assert float(step(model, (x, y))[1]["acc"]) == 0.5
    assert step(model, (x, y.float()))[1] == {}  # float targets: regression, no accuracy
    seq = nn.Sequential(nn.Linear(3, 2), nn.Unflatten(1, (1, 2))).eval()  # (N, 1, C) output
    assert step(seq, (x, torch.zeros(2, 1, dtype=torch.long)))[1] == {}
    assert step(model.train(), (x, y))[1] == {}  # training: no metrics at all
