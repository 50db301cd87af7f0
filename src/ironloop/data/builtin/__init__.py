"""The built-in demo datasets (``data.name``: digits, MNIST-1D, Fashion-MNIST and the IDX files
it comes in), kept apart from the resumable-order core of ``data/``."""
