"""guard/faults.py, in process: the fault knobs act only at the steps they name, poison a step's
loss or its samples, and refuse what cannot be poisoned."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

F64 = torch.float64


# --- the fault knobs ------------------------------------------------------------------------

def test_the_fault_knobs_act_only_at_the_steps_they_name():
    from ironloop.config import FaultConfig
    from ironloop.guard.faults import Faults

    off = Faults(FaultConfig())
    assert off.steps == frozenset() and not off.poisons_steps
    step_fn = lambda model, batch: (torch.tensor(1.0), {})  # noqa: E731
    assert off.wrap_step(step_fn, SimpleNamespace(step=0), None) is step_fn
    for step in (1, 5):  # optimizer steps count from 1
        off.at_step(step)  # nothing happens
    on = Faults(FaultConfig(crash_at_step=7, oom_at_step=5, nan_at_step=[2, 3]))
    assert on.steps == frozenset({5, 7}) and on.poisons_steps
    on.at_step(4)
    with pytest.raises(torch.OutOfMemoryError, match=r"^injected by fault.oom_at_step=5$"):
        on.at_step(5)
    progress, streak = SimpleNamespace(step=0), SimpleNamespace(consecutive=0)
    wrapped = on.wrap_step(step_fn, progress, streak)
    assert (wrapped.step_fn, wrapped.steps) == (step_fn, {2, 3})
    assert wrapped.progress is progress and wrapped.streak is streak


def test_a_poisoned_step_is_nan_on_its_first_training_attempt_only_even_after_a_rollback():
    from ironloop.guard.faults import PoisonLoss

    model = torch.nn.Linear(1, 1)
    progress, streak = SimpleNamespace(step=0), SimpleNamespace(consecutive=0)
    poisoned = PoisonLoss(lambda m, b: (torch.tensor(2.0), {"acc": 1.0}, 4), {2, 4}, progress,
                          streak)

    def attempt() -> float:
        loss, metrics, weight = poisoned(model, None)
        assert (metrics, weight) == ({"acc": 1.0}, 4)  # the rest passes through
        return float(loss)

    assert attempt() == 2.0          # step 1
    progress.step = 1
    model.eval()
    assert attempt() == 2.0          # an evaluation forward is never poisoned
    model.train()
    assert attempt() != attempt()    # step 2: NaN, then the retry is clean
    assert poisoned.fired == {2}
    progress.step = 3
    streak.consecutive = 0
    assert attempt() != attempt()    # step 4
    assert poisoned.fired == {2, 4}
    progress.step = 1                # a rollback to step 1: its replay of 2 and 4 is clean
    assert attempt() == 2.0
    progress.step = 3
    assert attempt() == 2.0 and poisoned.fired == {2, 4}


def test_a_run_of_bad_attempts_stands_for_that_many_consecutive_steps():
    from ironloop.guard.faults import PoisonLoss

    model = torch.nn.Linear(1, 1)
    progress, streak = SimpleNamespace(step=4), SimpleNamespace(consecutive=0)
    poisoned = PoisonLoss(lambda m, b: (torch.tensor(1.0), {}), {5, 6, 7}, progress, streak)
    nan = []
    for _ in range(4):
        loss, _ = poisoned(model, None)
        bad = bool(torch.isnan(loss))
        nan.append(bad)
        streak.consecutive = streak.consecutive + 1 if bad else 0
    assert nan == [True, True, True, False] and poisoned.fired == {5, 6, 7}
    without = PoisonLoss(lambda m, b: (torch.tensor(1.0), {}), {5, 6}, SimpleNamespace(step=4),
                         None)  # no guard: no streak to read
    assert torch.isnan(without(model, None)[0]) and not torch.isnan(without(model, None)[0])


def test_fault_nan_sample_refusals_name_the_knob_and_the_way_out():
    from ironloop.data.loader import TensorData
    from ironloop.errors import ConfigError
    from ironloop.guard.faults import poison_sample

    data = TensorData(torch.ones(3, 2), torch.arange(3))
    assert poison_sample(data, -1) is data
    with pytest.raises(ConfigError, match=r"^fault.nan_sample=3: the training split has 3 "
                                          r"samples; pick an index below that$"):
        poison_sample(data, 3)
    with pytest.raises(ConfigError, match=r"^fault.nan_sample=1: the inputs are torch.int64, "
                                          r"which cannot hold a NaN; use fault.nan_at_step "
                                          r"instead$"):
        poison_sample(TensorData(torch.ones(3, 2, dtype=torch.int64), torch.arange(3)), 1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(ConfigError, match=r"^fault.nan_sample=0 needs a map-style training "
                                          r"split; this one is a stream: use "
                                          r"fault.nan_at_step instead$"):
        poison_sample(Stream(), 0)


def test_poisoning_in_memory_data_keeps_its_one_slice_batches_and_leaves_the_original_alone():
    from ironloop.data.loader import TensorData
    from ironloop.guard.faults import poison_sample

    data = TensorData(torch.ones(3, 2), torch.arange(3))
    poisoned = poison_sample(data, 2)
    assert type(poisoned) is TensorData and poisoned.y is data.y
    assert torch.isnan(poisoned.x[2]).all() and torch.equal(poisoned.x[:2], torch.ones(2, 2))
    assert torch.equal(data.x, torch.ones(3, 2))


def test_a_poisoned_sample_keeps_its_container_type_and_float_inputs():
    from ironloop.guard.faults import poison_sample

    class Samples(torch.utils.data.Dataset):
        def __init__(self, make):
            self.make = make

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return self.make(i)

    as_list = poison_sample(Samples(lambda i: [torch.tensor([i, i]), i]), 1)
    sample = as_list[1]
    assert type(sample) is list and torch.isnan(sample[0]).all() and sample[1] == 1
    assert as_list[0][0].tolist() == [0, 0]
    bare = poison_sample(Samples(lambda i: torch.tensor([i, 2])), 0)[0]  # int64 in
    assert bare.dtype == torch.float32 and torch.isnan(bare).all()
