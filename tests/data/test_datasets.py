"""Built-in datasets: fixed splits, train-only normalisation, clear errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from ironloop.config import load_config
from ironloop.data import build_data
from ironloop.data.builtin.datasets import FASHION_MEAN, FASHION_STD, digits_arrays
from ironloop.data.builtin.idx import write_idx
from ironloop.errors import ConfigError, DataError


def data_cfg(*overrides):
    return load_config(None, list(overrides)).data


def test_digits_split_is_80_20_fixed_and_normalised_on_train_only():
    a, b = build_data(data_cfg()), build_data(data_cfg())
    assert len(a.train) == 1438 and len(a.val) == 359 and a.test is None
    assert torch.equal(a.val.x, b.val.x)  # the same split every time
    assert abs(float(a.train.x.mean())) < 1e-5 and abs(float(a.train.x.std()) - 1) < 1e-4
    assert abs(float(a.val.x.mean())) > 1e-5  # val was not standardised with its own stats
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10


def test_digits_are_sklearns_load_digits_exactly_without_importing_sklearn():
    from sklearn.datasets import load_digits

    images, labels = digits_arrays()
    d = load_digits()
    assert images.dtype == d.images.dtype and np.array_equal(images, d.images)
    assert np.array_equal(labels, d.target)
    # a fresh process that reads digits does not pay for importing scikit-learn (about 2 s)
    code = ("import sys; from ironloop.data.builtin.datasets import digits_arrays; "
            "digits_arrays(); print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_mnist1d_has_its_standard_4000_1000_split():
    b = build_data(data_cfg("data.name=mnist1d"))
    assert len(b.train) + len(b.val) == 4000 and len(b.test) == 1000
    assert b.input_shape == (1, 40) and b.num_classes == 10
    # float32 like the model's weights (mnist1d's arrays are float64), every split
    assert {b.train.x.dtype, b.val.x.dtype, b.test.x.dtype} == {torch.float32}


def test_synthetic_shape_and_classes():
    b = build_data(data_cfg("data.name=synthetic", "data.num_samples=100",
                            "data.input_shape=[3, 4]", "data.num_classes=5"))
    assert b.train.x.shape[1:] == (3, 4) and int(b.train.y.max()) < 5 and len(b.val) == 20


def test_fashion_mnist_from_idx_files_uses_the_published_stats(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    x_train = rng.integers(0, 256, (50, 28, 28), dtype=np.uint8)
    write_idx(raw / "train-images-idx3-ubyte.gz", x_train)
    write_idx(raw / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 50, dtype=np.uint8))
    write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28), dtype=np.uint8))
    write_idx(raw / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 20, dtype=np.uint8))
    b = build_data(data_cfg("data.name=fashion-mnist", f"data.root={tmp_path}"))
    assert len(b.train) == 40 and len(b.val) == 10 and len(b.test) == 20
    assert b.input_shape == (1, 28, 28)
    # train + val together are exactly the training images, scaled by the published stats
    expected = (torch.from_numpy(x_train.astype(np.float32)) / 255 - FASHION_MEAN) / FASHION_STD
    got = torch.cat([b.train.x, b.val.x]).flatten()
    torch.testing.assert_close(torch.sort(got)[0], torch.sort(expected.flatten())[0])


def test_a_one_sample_training_split_is_not_refused_as_empty():
    # (an empty one is refused: "the training split is empty"; the built-in loaders refuse
    # empty files before that, naming them)
    one = build_data(data_cfg("data.name=synthetic", "data.num_samples=1"))
    assert len(one.train) == 1


def test_missing_fashion_files_say_where_ironloop_looked(tmp_path):
    with pytest.raises(DataError, match="data.download"):
        build_data(data_cfg("data.name=fashion-mnist", f"data.root={tmp_path}"))


def test_unknown_dataset_lists_the_names():
    with pytest.raises(ConfigError, match="digits, mnist1d, fashion-mnist, synthetic"):
        build_data(data_cfg("data.name=cifar"))


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_a_builtin_dataset_with_an_empty_training_split_is_refused():
    from ironloop.config import DataConfig
    from ironloop.data.builtin.datasets import build_data
    from ironloop.errors import DataError

    config = DataConfig(name="synthetic", num_samples=1, val_fraction=0.6, input_shape=[2])
    with pytest.raises(DataError, match="^data.name='synthetic': the training split is empty$"):
        build_data(config)
    assert len(build_data(DataConfig(name="synthetic", num_samples=5, val_fraction=0.2,
                                     input_shape=[2])).train) == 4
