"""tools.doctor.data_checks one at a time, in process: labels, non-finite and leaked inputs and the
loader's speed, at both sides of every threshold."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ironloop.data.loader import TensorData
from ironloop.tools.doctor import data_checks, run as drun
from ironloop.tools.doctor.findings import Finding, info
from tests.conftest import blobs
from tests.tools.doctor.helpers import Scripted, batch_of, config, labelled, make


def test_labels_outside_the_classes_are_an_error_named_by_sample():
    out, balance = data_checks.check_labels(labelled([0, 1, 2, 3, -1, 0, 1, 2]))
    assert out.severity == "error"
    assert out.measured == "train: 2 label(s) outside [0, 3) (range -1..3; e.g. samples [3, 4])"
    assert out.cause == ("the targets are not class indices 0..2: 1-based labels, or more "
                         "classes than the model's 3 outputs")
    assert out.fix == "map the labels to 0..2 or give the model as many outputs as there are " \
                      "classes"
    # the balance is of the labels in range
    assert balance == info("labels", "train class balance: 6 samples, smallest class 33.3%, "
                                     "largest 33.3%")
    (first,) = data_checks.check_labels(labelled(list(range(-6, 0))))
    assert first.measured.endswith("e.g. samples [0, 1, 2, 3, 4])")


def test_labels_all_outside_the_classes_are_the_error_not_a_crash_of_the_check():
    # labels 3 and 4 for a 2-output model: nothing left to count the balance of
    s = labelled([3, 4, 3], c=2)
    (f,) = data_checks.check_labels(s)
    assert f.severity == "error" and f.measured.startswith("train: 3 label(s) outside [0, 2)")
    found = drun.check(s)  # the error, not a skipped check; the model checks do not run
    assert [f.check for f in found] == ["labels", "threads"] and found[0].severity == "error"


def test_labels_are_checked_only_for_classification():
    assert data_checks.check_labels(labelled([5, 5], c=None)) == []
    assert data_checks.check_labels(labelled([5, 5], loss__name="mse")) == []


def test_classes_missing_from_train_are_listed():
    missing, balance = data_checks.check_labels(labelled([0, 0, 1, 1], c=4))
    assert missing.severity == "warning"
    assert missing.measured == "train: 2 of 4 classes never appear: [2, 3]"
    assert "wrong num_classes" in missing.cause and balance.severity == "info"
    assert missing.fix == "check the split and the number of classes"
    (ten, _) = data_checks.check_labels(labelled([0], c=11))
    assert ten.measured == f"train: 10 of 11 classes never appear: {list(range(1, 11))}"


def test_a_class_more_than_ten_times_as_common_as_another_is_a_warning():
    # shares 10/16, 1/16, 5/16: exactly 10x is fine, 11/16 against 1/16 is not
    (f,) = data_checks.check_labels(labelled([0] * 10 + [1] + [2] * 5))
    assert f == info("labels", "train class balance: 16 samples, smallest class 6.2%, "
                               "largest 62.5%")
    (f,) = data_checks.check_labels(labelled([0] * 11 + [1] + [2] * 4))
    assert f.severity == "warning" and f.measured == (
        "train class balance: 16 samples, smallest class 6.2%, largest 68.8%")
    assert f.fix == "set loss.class_weights, or resample the training set"


def test_validation_labels_are_checked_for_range_only_not_for_balance():
    findings = data_checks.check_labels(labelled([0, 1, 2], val=[0] * 11 + [1, 7]))
    assert [(f.severity, f.measured.split(":")[0]) for f in findings] == [
        ("info", "train class balance"), ("error", "val"), ("info", "val class balance")]
    assert findings[1].measured.startswith("val: 1 label(s) outside [0, 3)")
    assert data_checks.check_labels(labelled([0, 1, 2], val=[])) == \
        data_checks.check_labels(labelled([0, 1, 2]))


def test_the_labels_of_data_not_in_memory_are_read_up_to_the_cap():
    data = [(torch.zeros(2), v) for v in (0, 1, 2, 9)]
    s = make(train=data, num_classes=3)
    assert data_checks.check_labels(s, cap=3)[0].severity == "info"
    assert data_checks.check_labels(s)[0].severity == "error"


# -- data checks: inputs and leakage --------------------------------------------------------------

def test_samples_with_nan_or_inf_inputs_are_named_in_every_split():
    x = torch.zeros(8, 2)
    x[[1, 2, 3, 5, 6, 7], 0] = math.nan
    v = torch.zeros(3, 2)
    v[2, 1] = -math.inf
    s = make(train=TensorData(x, torch.zeros(8, dtype=torch.long)),
             val=TensorData(torch.zeros(2, 2), torch.zeros(2)))
    s.test = [(row, 0) for row in v]
    train, test = data_checks.check_finite_inputs(s)
    assert train.severity == "error" and train.measured == (
        "train: 6 sample(s) with NaN or inf inputs, e.g. samples [1, 2, 3, 5, 6]")
    assert test.measured == "test: 1 sample(s) with NaN or inf inputs, e.g. samples [2]"
    assert "guard would skip" in train.cause and train.fix.startswith("clean or drop")
    assert data_checks.check_finite_inputs(s, cap=2) == [train]  # the test sample is the 3rd


def test_the_inputs_of_samples_are_their_float_parts_of_one_shape():
    assert torch.equal(data_checks._inputs([(torch.ones(2, 2), 0), (torch.zeros(2, 2), 1)], None),
                       torch.tensor([[1.0] * 4, [0.0] * 4]))
    assert data_checks._inputs([(torch.ones(2), 0)] * 5, 3).shape == (3, 2)
    dicts = [{"a": torch.ones(2), "mask": torch.ones(2, dtype=torch.long), "b": torch.zeros(1),
              "labels": torch.ones(3)}]
    assert torch.equal(data_checks._inputs(dicts, None), torch.tensor([[1.0, 1.0, 0.0]]))
    assert data_checks._inputs([(torch.ones(2), 0), (torch.ones(3), 0)], None) is None
    assert data_checks._inputs([(torch.ones(2), 0), (torch.ones(2, dtype=torch.long), 0)],
                               None) is None
    assert data_checks._inputs([], None) is None
    assert data_checks._inputs(TensorData(torch.ones(3, 2, 2), torch.zeros(3)), None).shape == \
        (3, 4)
    assert data_checks._inputs(TensorData(torch.ones(3, 2, dtype=torch.long), torch.zeros(3)),
                               None) is None


def test_inputs_shared_by_train_and_val_or_test_are_an_error_with_the_pairs():
    x = torch.arange(12.0).reshape(6, 2)
    train = TensorData(torch.cat([x, x[:1]]), torch.zeros(7))  # train[6] repeats train[0]
    val = [(x[3], 1), (torch.tensor([99.0, 99.0]), 0), (x[0].clone(), 2), (x[0] + 50, 0)]
    s = make(train=train, val=val)
    s.test = TensorData(x[:0], torch.zeros(0))
    (f,) = data_checks.check_leakage(s)
    assert f.severity == "error"
    assert f.measured == ("2 of 4 val samples (50.0%) also appear in train, e.g. val[0]=train[3], "
                          "val[2]=train[0]")
    assert f.cause.startswith("duplicated samples across the split: val scores will be "
                              "optimistic")
    assert f.fix == "deduplicate before splitting, or drop these samples from val"
    s.val, s.test = None, TensorData(x[5:] + 100, torch.zeros(1))
    assert data_checks.check_leakage(s) == [
        info("leakage", "train/test: no duplicated inputs among 6 x 1 samples")]
    assert data_checks.check_leakage(s, cap=2) == [
        info("leakage", "train/test: no duplicated inputs among 6 x 1 samples")]
    s.train = None
    assert data_checks.check_leakage(s) == []


def test_leaked_pairs_beyond_five_are_counted_not_listed():
    x = torch.randn(7, 3)
    s = make(train=TensorData(x, torch.zeros(7)), val=TensorData(x.clone(), torch.zeros(7)))
    (f,) = data_checks.check_leakage(s)
    assert f.measured == ("7 of 7 val samples (100.0%) also appear in train, e.g. val[0]=train[0], "
                          "val[1]=train[1], val[2]=train[2], val[3]=train[3], val[4]=train[4]")


def test_sample_hashes_read_only_the_inputs_and_only_up_to_the_cap():
    rows = [{"x": torch.ones(2), "labels": torch.tensor(i)} for i in range(4)]
    hashes = data_checks._hashes(rows, 3)
    assert len(hashes) == 3 and len(set(hashes)) == 1 and len(hashes[0]) == 16
    assert data_checks._hashes(TensorData(torch.ones(2, 2), torch.zeros(2)), 1) == \
        data_checks._hashes([(torch.ones(2), 5)] * 2, None)


# -- data checks: input bound ---------------------------------------------------------------------

class Counted(torch.utils.data.Dataset):
    def __init__(self, n):
        self.data, self.reads = blobs(n), 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.reads += 1
        return self.data[i]


class Clock:
    """A perf_counter that moves one second per reading."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1
        return self.now


def test_the_loader_is_timed_on_at_most_max_batches_after_the_first(monkeypatch):
    monkeypatch.setattr(data_checks, "time", Clock())
    data = Counted(40)  # 10 batches of 4
    s = make(train=data)
    assert data_checks._loader_seconds_per_batch(s, 3, budget=100) == 1.0
    assert data.reads == 16  # the first batch and 3 timed
    data.reads = 0
    data_checks._loader_seconds_per_batch(s, 3, budget=2)
    assert data.reads == 8  # one timed batch: the budget is spent
    small = Counted(4)
    assert data_checks._loader_seconds_per_batch(make(train=small), 3, 100) == 0.0


def test_the_model_is_timed_for_steps_within_the_budget(monkeypatch):
    monkeypatch.setattr(data_checks, "time", Clock())
    step = Scripted(1.0)
    s = make(step=step)
    assert data_checks._model_seconds_per_step(s, batch_of(), 3, budget=100) == 1.0
    assert step.calls == 4  # a warm-up, then 3
    step.calls = 0
    data_checks._model_seconds_per_step(s, batch_of(), 3, budget=1)
    assert step.calls == 2  # the budget is checked before each timed step: <= 1 s


def input_bound(monkeypatch, load, step, **kw) -> Finding:
    monkeypatch.setattr(data_checks, "_loader_seconds_per_batch", lambda s, n, budget: load)
    monkeypatch.setattr(data_checks, "_model_seconds_per_step", lambda s, b, n, budget: step)
    monkeypatch.setattr(data_checks, "loader_fix", lambda s, load, step: f"fix {load} {step}")
    (f,) = data_checks.check_input_bound(make(**kw), batch_of())
    return f


def test_loading_in_the_main_process_is_reported_from_a_tenth_and_warned_from_a_quarter(
        monkeypatch):
    f = input_bound(monkeypatch, 0.1, 1.0)
    assert f == info("input_bound", "DataLoader 10 batches/s per process, model 1 steps/s on "
                                    "synthetic batches")
    f = input_bound(monkeypatch, 0.25, 1.0)
    assert f.severity == "info" and f.fix == "fix 0.25 1.0"
    assert f.measured == ("DataLoader 4 batches/s per process, model 1 steps/s on synthetic "
                          "batches: loading would take 20% of each step")
    assert "data.num_workers=0" in f.cause
    f = input_bound(monkeypatch, 0.5, 1.0)
    assert f.severity == "warning" and f.measured.endswith("loading would take 33% of each step")


def test_workers_slower_than_the_model_together_are_a_warning(monkeypatch):
    f = input_bound(monkeypatch, 2.0, 1.0, data__num_workers=2)
    assert f == info("input_bound", "DataLoader 0 batches/s per process (x2 workers), model 1 "
                                    "steps/s on synthetic batches")
    f = input_bound(monkeypatch, 2.5, 1.0, data__num_workers=2)
    assert f.severity == "warning" and f.measured == (
        "DataLoader 0 batches/s per process (x2 workers), model 1 steps/s on synthetic batches: "
        "the loader is slower")
    assert f.cause == "the model waits for data: the DataLoader cannot keep up"
    assert f.fix == "fix 2.5 1.0"


def test_the_loader_fix_asks_for_workers_in_proportion_within_the_cores(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)

    def fix(load, n=8, device="cpu", **keys):
        monkeypatch.setattr(data_checks, "cores", lambda: n)
        s = SimpleNamespace(cfg=config(**keys), device=torch.device(device))
        return data_checks.loader_fix(s, load, 1.0).split(", or")[0].split("; `")[0]

    assert fix(2.0) == "set data.num_workers=4"      # 2 x 1.5 + 1
    assert fix(0.0) == "set data.num_workers=2"      # at least 2
    assert fix(100.0) == "set data.num_workers=8"    # at most the cores
    assert fix(100.0, n=64) == "set data.num_workers=32"  # and at most 32
    assert fix(2.0, data__num_workers=4) == \
        "the 4 workers already have the 8 cores: make __getitem__ cheaper or move " \
        "decoding/augmentation off the critical path"
    assert fix(2.0, run__threads=5) == "set data.num_workers=4, run.threads=4 (now 5: torch's " \
                                       "threads take the cores the workers need)"
    assert fix(2.0, run__threads=4) == "set data.num_workers=4"
    assert fix(2.0, n=2, run__threads=2) == "set data.num_workers=2, run.threads=1 (now 2: " \
                                            "torch's threads take the cores the workers need)"
    assert fix(2.0, device="cuda", run__threads=5, data__pin_memory=False) == \
        "set data.num_workers=4, data.pin_memory=true"
    s = SimpleNamespace(cfg=config(), device=torch.device("cpu"))
    assert data_checks.loader_fix(s, 2.0, 1.0).endswith(
        f", or make __getitem__ cheaper; `{data_checks.tune_command()}` measures which is "
        f"fastest")


def test_a_leakage_share_found_among_capped_reads_names_what_it_read():
    # The preflight hashes the first `cap` samples of data not in memory: 1 of 4 test names
    # among the first 4 of 12 training ones is a lower bound, not the split's share (issue 59).
    names = [(torch.tensor([float(i)]), 0) for i in range(12)]
    s = make(train=list(names), val=None)
    s.test = [names[10], names[2], (torch.tensor([50.0]), 0), names[11], names[7]]
    (f,) = data_checks.check_leakage(s, cap=4)
    assert f.measured == ("1 of 4 of 5 test samples (25.0%) appear among the 4 of 12 train "
                          "samples read (a lower bound: `ironloop doctor CONFIG` reads every "
                          "sample), e.g. test[1]=train[2]")
    (f,) = data_checks.check_leakage(s)  # everything read: the split's own share
    assert f.measured == ("4 of 5 test samples (80.0%) also appear in train, e.g. "
                          "test[0]=train[10], test[1]=train[2], test[3]=train[11], "
                          "test[4]=train[7]")
    s.test = [(torch.tensor([50.0]), 0)] * 5
    assert data_checks.check_leakage(s, cap=4) == [
        info("leakage", "train/test: no duplicated inputs among 4 of 12 x 4 of 5 samples read")]
