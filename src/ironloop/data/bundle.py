"""What a dataset factory hands the rest of ironloop: the splits, and what the model factory
needs to know about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataBundle:
    train: Any                    # a Dataset, a DataLoader, or an in-memory TensorData
    val: Any | None
    test: Any | None
    input_shape: tuple[int, ...]  # one sample's input shape, for the built-in models
    num_classes: int | None       # None: fit() infers it from the model's output
    meta: dict = field(default_factory=dict)  # what a data factory tells the model factory

    @property
    def first_val(self) -> Any | None:
        """The validation set, or the first of several ({name: set}): what the doctor checks."""
        return next(iter(self.val.values()), None) if isinstance(self.val, dict) else self.val
