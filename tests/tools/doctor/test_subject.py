"""tools.doctor.subject: what the checks are given (the first batches, a fresh copy of the model,
its loss through the run's step, the labels) on tiny models and data built here."""

from __future__ import annotations

import torch

from ironloop.data.loader import TensorData
from ironloop.tools.doctor.subject import head, labels_of, repeated
from tests.conftest import blobs, tiny_mlp
from tests.tools.doctor.helpers import batch_of, config, make

# -- subject --------------------------------------------------------------------------------------

def test_the_subject_reads_the_run_s_first_batch_at_its_batch_size_or_the_one_asked():
    data = blobs(10)
    s = make(train=data)
    x, y = s.batch()
    assert torch.equal(x, data.x[:4]) and torch.equal(y, data.y[:4])  # data.shuffle=false
    assert len(s.batch(3)[0]) == 3
    shuffled = make(train=data, data__shuffle=True, run__seed=5)
    order = [i for b in shuffled.loader() for i in b[1].tolist()]
    xs = torch.cat([b[0] for b in shuffled.loader()])
    assert sorted(order) == sorted(data.y.tolist()) and not torch.equal(xs, data.x)
    assert torch.equal(xs, torch.cat([b[0] for b in shuffled.loader()]))  # the run's own order


def test_the_subject_s_copy_is_a_fresh_model_in_train_mode_with_the_configured_optimizer():
    model = tiny_mlp().eval()
    s = make(model, optim__lr=0.25)
    copy, opt = s.copy()
    assert copy is not model and copy.training and not model.training
    assert opt.param_groups[0]["lr"] == 0.25
    assert {id(p) for g in opt.param_groups for p in g["params"]} == \
        {id(p) for p in copy.parameters()}
    with torch.no_grad():
        next(copy.parameters()).add_(1)
    assert not torch.equal(next(copy.parameters()), next(model.parameters()))


def test_the_subject_s_loss_runs_the_step_with_a_fresh_state_when_the_step_takes_one():
    states = []

    def stateful(model, batch, state):
        states.append(state)
        return model(batch[0]).sum(), {"m": torch.tensor(1.0)}

    s = make(step=stateful)
    loss, metrics = s.loss(s.model, batch_of())
    s.loss(s.model, batch_of())
    assert loss.ndim == 0 and list(metrics) == ["m"]
    assert len(states) == 2 and states[0] is not states[1]
    plain = make(step=lambda model, batch: (torch.tensor(2.5), {}))
    assert float(plain.loss(plain.model, batch_of())[0]) == 2.5


def test_the_val_batch_is_none_without_validation_and_the_first_batch_with_it():
    from ironloop.data.source import eval_split

    assert make().val_batch() is None
    cfg = config()
    val, batching = eval_split(blobs(6, seed=1), "val_data", cfg, None, 1)
    s = make(val=val)
    assert s.val_batch() is None  # no batching: evaluation was not set up
    s.val_batching = batching
    x, y = s.val_batch()
    first = blobs(6, seed=1)
    assert torch.equal(y, first.y[:len(y)]) and torch.equal(x, first.x[:len(y)]) and len(y) > 0
    s.val = TensorData(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert s.val_batch() is None


def test_classification_needs_classes_and_a_classification_loss():
    assert make(num_classes=3).classification
    assert not make(num_classes=None).classification
    assert not make(num_classes=0).classification
    for name in ("bce_logits", "kl_div"):
        assert make(loss__name=name).classification
    assert not make(loss__name="mse").classification


def test_labels_of_reads_integer_labels_in_memory_or_sample_by_sample():
    y = torch.tensor([2, 0, 1, 1])
    assert labels_of(None) is None
    assert torch.equal(labels_of(TensorData(torch.zeros(4, 2), y)), y)
    as_ints = [(torch.zeros(2), int(v)) for v in y]
    assert torch.equal(labels_of(as_ints), y)
    assert torch.equal(labels_of(as_ints, cap=2), y[:2])
    assert torch.equal(labels_of(as_ints, cap=10), y)
    as_tensors = [(torch.zeros(2), v) for v in y]
    assert torch.equal(labels_of(as_tensors, cap=3), y[:3])
    empty = labels_of([])
    assert empty is not None and empty.dtype == torch.long and len(empty) == 0
    assert labels_of(TensorData(torch.zeros(2, 2), torch.tensor([0.5, 1.0]))) is None
    assert labels_of(TensorData(torch.zeros(2, 2), torch.zeros(2, 3, dtype=torch.long))) is None


def test_head_and_repeated_slice_and_grow_every_tensor_of_a_nested_batch():
    x = torch.arange(6).reshape(3, 2)
    batch = {"a": x, "b": (x[:, 0], [x[:, 1]]), "n": 7}
    h = head(batch, 2)
    assert torch.equal(h["a"], x[:2]) and torch.equal(h["b"][0], x[:2, 0])
    assert isinstance(h["b"], tuple) and isinstance(h["b"][1], list)
    assert torch.equal(h["b"][1][0], x[:2, 1]) and h["n"] == 7
    r = repeated(batch, 7)
    assert torch.equal(r["a"], x[[0, 1, 2, 0, 1, 2, 0]])
    assert torch.equal(r["b"][0], x[[0, 1, 2, 0, 1, 2, 0], 0]) and r["n"] == 7
    assert isinstance(r["b"], tuple) and isinstance(r["b"][1], list)
    assert torch.equal(repeated(torch.tensor([1, 2]), 3), torch.tensor([1, 2, 1]))
    assert torch.equal(repeated(torch.tensor([1, 2]), 2), torch.tensor([1, 2]))
