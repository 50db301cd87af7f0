"""Fault knobs for the guard's tests and docs: ``fault.nan_at_step`` and ``fault.nan_sample``.

Both act where real faults come from, so the loop sees them as it would see the real thing:
a NaN loss that flows through backward, and a sample whose input is NaN every time it is read.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from ironloop.data.loader import TensorData
from ironloop.errors import ConfigError


class PoisonLoss:
    """Wraps a step function: the training loss of the FIRST attempt at each listed optimizer
    step is NaN (a transient fault). The guard skips that attempt; the retry of the same step
    number, on the next window, is clean. A rollback to before the step makes it a first
    attempt again, so it fires again. Set ``run`` once the Run exists."""

    def __init__(self, step_fn, steps: list[int]):
        self.step_fn, self.steps, self.run = step_fn, set(steps), None

    def __call__(self, model, batch):
        loss, *rest = self.step_fn(model, batch)  # (loss, metrics[, weight])
        run = self.run
        if model.training and run is not None and run.progress.step + 1 in self.steps and \
                (run.guard is None or run.guard.guard.consecutive == 0):
            loss = loss * float("nan")
        return (loss, *rest)


def poison_sample(dataset: Dataset, index: int) -> Dataset:
    """``dataset`` with sample ``index``'s input set to NaN (``index`` < 0: unchanged)."""
    if index < 0:
        return dataset
    if not hasattr(dataset, "__len__"):  # a stream (data/stream.py): no sample has an index
        raise ConfigError(f"fault.nan_sample={index} needs a map-style training split; this "
                          f"one is a stream: use fault.nan_at_step instead")
    if index >= len(dataset):
        raise ConfigError(f"fault.nan_sample={index}: the training split has {len(dataset)} "
                          f"samples; pick an index below that")
    if isinstance(dataset, TensorData):  # keep the one-slice batching of in-memory data
        if not dataset.x.is_floating_point():
            raise ConfigError(f"fault.nan_sample={index}: the inputs are {dataset.x.dtype}, "
                              f"which cannot hold a NaN; use fault.nan_at_step instead")
        x = dataset.x.clone()
        x[index] = float("nan")
        return TensorData(x, dataset.y)
    return _PoisonedSample(dataset, index)


class _PoisonedSample(Dataset):
    def __init__(self, dataset: Dataset, index: int):
        self.dataset, self.index = dataset, index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        sample = self.dataset[i]
        if i != self.index:
            return sample
        if isinstance(sample, (tuple, list)):
            return type(sample)([sample[0].float() * float("nan"), *sample[1:]])
        return sample.float() * float("nan")
