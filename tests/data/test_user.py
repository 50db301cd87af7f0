"""ironloop.data.user: a data factory named by data.name, what it is given and what it must
return."""

from __future__ import annotations

import pytest

from tests.data.helpers import Counting


# ------------------------------------------------------------------ user -------------------
def test_a_data_factorys_stream_offers_its_first_samples_shape(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data

    (tmp_path / "byo_units_stream.py").write_text(
        "from tests.data.helpers import Counting\n"
        "def data():\n"
        "    return Counting(), None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = user_data(DataConfig(name="byo_units_stream:data"))
    assert bundle.input_shape == (5,) and isinstance(bundle.train, Counting)


def test_a_data_factory_gets_torchruns_rank_and_world_size(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data

    (tmp_path / "byo_units_ranks.py").write_text(
        "import torch\n"
        "def data(rank, world_size):\n"
        "    n = 2 + rank + 10 * world_size\n"
        "    return (torch.zeros(4, n), torch.zeros(4)), None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert user_data(DataConfig(name="byo_units_ranks:data")).input_shape == (33,)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert user_data(DataConfig(name="byo_units_ranks:data")).input_shape == (12,)


def test_a_data_factorys_result_must_name_its_training_split_and_hold_samples(tmp_path,
                                                                               monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data
    from ironloop.errors import ConfigError, DataError

    (tmp_path / "byo_units_shapes.py").write_text(
        "import torch\n"
        "def no_train():\n"
        "    return {'val': None, 'vocab_size': 3}\n"
        "def one():\n"
        "    return [torch.zeros(1)]\n"
        "def number():\n"
        "    return 7\n"
        "def empty_pair():\n"
        "    return (torch.zeros(0, 2), torch.zeros(0)), None\n"
        "def meta():\n"
        "    return {'train': (torch.zeros(3, 2), torch.zeros(3)), 'num_classes': 4, 'k': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^data factory 'byo_units_shapes:no_train' returned "
                                          r"a dict without 'train'; return \{'train': \.\.\., "
                                          r"'val': \.\.\., 'vocab_size': \.\.\.\}$"):
        user_data(DataConfig(name="byo_units_shapes:no_train"))
    for name, kind in (("one", "list"), ("number", "int")):
        with pytest.raises(ConfigError, match=f"^data factory 'byo_units_shapes:{name}' "
                                              f"returned {kind}; return \\(train, val\\) or"):
            user_data(DataConfig(name=f"byo_units_shapes:{name}"))
    with pytest.raises(DataError, match=r"^data factory 'byo_units_shapes:empty_pair' returned "
                                        r"an empty training split \(inputs of length 0\);"):
        user_data(DataConfig(name="byo_units_shapes:empty_pair"))
    bundle = user_data(DataConfig(name="byo_units_shapes:meta"))
    assert (bundle.input_shape, bundle.num_classes) == ((2,), 4)
    assert bundle.meta == {"num_classes": 4, "k": 1} and bundle.val is None


def test_a_data_factory_that_cannot_be_imported_names_data_name():
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data
    from ironloop.errors import ConfigError

    with pytest.raises(ConfigError, match="^data.name='no_such_module_here:data': cannot import "
                                          "module 'no_such_module_here'"):
        user_data(DataConfig(name="no_such_module_here:data"))
