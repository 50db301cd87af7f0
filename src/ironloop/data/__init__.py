"""Datasets and the resumable batching that feeds the loop."""

from ironloop.data.builtin.datasets import DATASETS, build_data
from ironloop.data.bundle import DataBundle
from ironloop.data.loader import EpochSampler, TensorData, make_loader

__all__ = ["DATASETS", "DataBundle", "EpochSampler", "TensorData", "build_data", "make_loader"]
