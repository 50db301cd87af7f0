"""The time split's data advice for in-memory tensors (issue 59, item 7): their batches are
index slices, so loader workers cannot speed them up and the advice does not send a user there."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ironloop.data.loader import TensorData, is_sliced
from ironloop.outputs.time_split import RunSettings, advice

SLOW_DATA = {"data": 4.0, "forward": 3.0, "backward": 3.0}


def test_sliced_data_gets_no_workers_advice_and_per_sample_data_still_does():
    (line,) = advice(SLOW_DATA, RunSettings(cores=4, sliced=True))
    assert line.startswith("data wait is 40% of step time: the batches are already slices")
    assert "num_workers" not in line and "train.batch_size" in line
    (line,) = advice(SLOW_DATA, RunSettings(cores=4))
    assert "raise data.num_workers (now 0; 4 cores)" in line


def test_in_memory_tensors_are_sliced_unless_a_collate_or_a_subclass_intervenes():
    x = torch.zeros(4, 2)
    assert is_sliced(TensorDataset(x)) and is_sliced(TensorDataset(x, x, x))
    assert is_sliced(TensorData(x, x))
    assert not is_sliced(TensorDataset(x), collate_fn=lambda b: b)
    assert not is_sliced(type("Augmented", (TensorDataset,), {})(x))
    assert not is_sliced([(x[0],)])
