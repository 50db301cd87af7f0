"""The built-in datasets, all in memory: digits, mnist1d, fashion-mnist and synthetic.

Each one returns a ``DataBundle``: train/val (an 80/20 split from a fixed generator, so every
run and every seed validates on the same samples), an optional test split, and the input shape
and class count the model factory needs. Normalisation statistics come from the training split
only, never from val or test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ironloop.data.bundle import DataBundle
from ironloop.data.loader import TensorData, derive_seed
from ironloop.data.user import user_data
from ironloop.errors import DataError

#: The split is fixed, independent of run.seed, so runs with different seeds are comparable.
SPLIT_SEED = 1234
#: Fashion-MNIST's published training-set statistics.
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530


def split(x: torch.Tensor, y: torch.Tensor, val_fraction: float):
    """A reproducible train/val split of (x, y) from a fixed generator."""
    n_val = round(len(x) * val_fraction)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return (x[train_idx], y[train_idx]), (x[val_idx], y[val_idx]) if n_val else None


def _standardise(train_x: torch.Tensor, *others, mean=None, std=None):
    """Scale every split by the training split's mean and std (or the given ones)."""
    mean = train_x.mean() if mean is None else torch.tensor(mean)
    std = train_x.std() if std is None else torch.tensor(std)
    return [None if t is None else (t - mean) / std for t in (train_x, *others)]


def _bundle(x, y, test, val_fraction, input_shape, num_classes, stats=(None, None)):
    (tx, ty), val = split(x, y, val_fraction)
    vx = val[0] if val else None
    sx = test[0] if test else None
    tx, vx, sx = _standardise(tx, vx, sx, mean=stats[0], std=stats[1])
    return DataBundle(
        train=TensorData(tx, ty),
        val=TensorData(vx, val[1]) if val else None,
        test=TensorData(sx, test[1]) if test else None,
        input_shape=input_shape, num_classes=num_classes)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (images (N, 8, 8), labels), read from the CSV file that
    ships inside the package: importing sklearn.datasets (scipy, pandas) costs about 2 s of CPU,
    more than torch itself, in every process that trains on digits. load_digits, which reads
    the same file, where a scikit-learn release keeps it elsewhere."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from ironloop.extras import require

    d = require("sklearn.datasets", "data", "data.name=digits").load_digits()
    return d.images, d.target


def digits(cfg) -> DataBundle:
    """scikit-learn's bundled 8x8 digits: 1797 images, 10 classes, no network needed."""
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8)
    y = torch.tensor(labels, dtype=torch.long)
    return _bundle(x, y, None, cfg.val_fraction, (1, 8, 8), 10)


def mnist1d(cfg) -> DataBundle:
    """MNIST-1D generated offline with its standard 4000/1000 train/test split."""
    from ironloop.extras import require

    m = require("mnist1d.data", "data", "data.name=mnist1d")
    # make_dataset reseeds python's and numpy's global RNGs; fit() seeds after building data.
    d = m.make_dataset(m.get_dataset_args())
    x = torch.tensor(d["x"], dtype=torch.float32).unsqueeze(1)  # (4000, 1, 40)
    y = torch.tensor(d["y"], dtype=torch.long)
    test = (torch.tensor(d["x_test"], dtype=torch.float32).unsqueeze(1),
            torch.tensor(d["y_test"], dtype=torch.long))
    return _bundle(x, y, test, cfg.val_fraction, (1, x.shape[-1]), 10)


def fashion_mnist(cfg) -> DataBundle:
    """Fashion-MNIST from the four IDX files in data.root (flat or torchvision's layout)."""
    from ironloop.data.builtin.idx import load_fashion_mnist

    arrays = load_fashion_mnist(Path(cfg.root), download=cfg.download)

    def images(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))

    x, y = images(arrays["x_train"]), labels(arrays["y_train"])
    test = (images(arrays["x_test"]), labels(arrays["y_test"]))
    return _bundle(x, y, test, cfg.val_fraction, tuple(x.shape[1:]), 10,
                   stats=(FASHION_MEAN, FASHION_STD))


def synthetic(cfg) -> DataBundle:
    """Gaussian blobs of a given shape and class count: learnable, instant, for benchmarks."""
    g = torch.Generator().manual_seed(derive_seed(SPLIT_SEED, "synthetic"))
    shape, c, n = tuple(cfg.input_shape), cfg.num_classes, cfg.num_samples
    centres = torch.randn((c, *shape), generator=g)
    y = torch.randint(0, c, (n,), generator=g)
    x = torch.randn((n, *shape), generator=g) + 0.5 * centres[y]
    return _bundle(x, y, None, cfg.val_fraction, shape, c)


DATASETS = {"digits": digits, "mnist1d": mnist1d, "fashion-mnist": fashion_mnist,
            "synthetic": synthetic}


def build_data(cfg) -> DataBundle:
    """The dataset named by ``data.name``; unknown names list the ones that exist."""
    if ":" in cfg.name:
        return user_data(cfg)
    if cfg.name not in DATASETS:
        from ironloop.errors import ConfigError

        raise ConfigError(f"data.name={cfg.name!r}: unknown dataset; "
                          f"choose one of {', '.join(DATASETS)}, or give your own as "
                          f"'module:factory'")
    bundle = DATASETS[cfg.name](cfg)
    if len(bundle.train) == 0:
        raise DataError(f"data.name={cfg.name!r}: the training split is empty")
    return bundle
