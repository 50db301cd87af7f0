"""A pipeline whose resume drifts, for ``ironloop doctor --resume-check`` (README, "Resuming
after a crash"): the digits, with noise that ramps up with a count of reads kept in the dataset
(a "curriculum" clock that hand-written pipelines often keep). A crash restarts the count at 0,
so the resumed run sees other inputs than the uninterrupted one would have:

    ironloop doctor configs/digits.yaml data.name=examples.resume_drift:data --resume-check

The fix is a clock the checkpoint holds: the step (a callback with state_dict that sets the
dataset's strength), or nothing at all that changes in __getitem__.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Curriculum(Dataset):
    """The training split, with Gaussian noise whose scale grows with every read."""

    def __init__(self, base):
        self.base = base
        self.reads = 0  # the curriculum's clock: it lives in this process only

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        self.reads += 1
        # torch's global RNG: ironloop seeds it from (seed, epoch, index) before each sample
        return x + 0.05 * (self.reads / len(self)) * torch.randn_like(x), y


def data(val_fraction: float = 0.2) -> dict:
    """The digits (scikit-learn's, as ``data.name=digits``), the training split noised."""
    from ironloop.config import DataConfig
    from ironloop.data.builtin.datasets import digits

    bundle = digits(DataConfig(name="digits", val_fraction=val_fraction))
    return {"train": Curriculum(bundle.train), "val": bundle.val,
            "num_classes": bundle.num_classes}
