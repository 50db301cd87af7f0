"""Built-in models and the module:factory hook, with clear errors."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from ironloop.errors import ConfigError
from ironloop.tools.models import build_model


@pytest.mark.parametrize("name, shape", [("mlp", (1, 8, 8)), ("small_cnn", (1, 8, 8)),
                                         ("small_cnn", (1, 28, 28)), ("cnn1d", (1, 40))])
def test_builtins_map_inputs_to_class_logits(name, shape):
    model = build_model(name, shape, 10, {})
    assert model(torch.zeros(3, *shape)).shape == (3, 10)
    assert not any(isinstance(m, (nn.Dropout, nn.BatchNorm1d, nn.BatchNorm2d))
                   for m in model.modules())


def test_cnn1d_defaults_unchanged_and_the_recipe_variant():
    old = build_model("cnn1d", (1, 40), 10, {})
    convs = [m for m in old.modules() if isinstance(m, nn.Conv1d)]
    assert [(c.kernel_size, c.stride) for c in convs] == [((3,), (2,))] * 3
    assert next(m for m in old.modules() if isinstance(m, nn.Linear)).in_features == 32 * 5
    deep = build_model("cnn1d", (1, 40), 10,
                       {"channels": 64, "strides": [1, 2, 2, 2], "kernel": 5, "hidden": 256})
    convs = [m for m in deep.modules() if isinstance(m, nn.Conv1d)]
    assert [c.stride for c in convs] == [(1,), (2,), (2,), (2,)] and convs[-1].out_channels == 64
    assert deep(torch.zeros(2, 1, 40)).shape == (2, 10)  # 40 -> 40 -> 20 -> 10 -> 5
    pooled = build_model("cnn1d", (1, 40), 10, {"channels": 64, "strides": [1, 1, 2, 2],
                                                "global_pool": True})
    x = torch.randn(2, 1, 40)
    assert pooled(x).shape == (2, 10)
    # a max over positions: the head sees 64 features, not 64 x 10
    assert next(m for m in pooled.modules() if isinstance(m, nn.Linear)).in_features == 64


@pytest.fixture
def user_module(monkeypatch):
    mod = types.ModuleType("my_models")
    mod.good = lambda input_shape, num_classes, width=4: nn.Sequential(
        nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))
    mod.boom = lambda **k: (_ for _ in ()).throw(RuntimeError("no GPU today"))
    mod.not_a_module = lambda **k: "a string"
    monkeypatch.setitem(sys.modules, "my_models", mod)
    return mod


def test_user_factory_gets_shape_classes_and_kwargs(user_module):
    model = build_model("my_models:good", (2, 3), 5, {"width": 8})
    assert model(torch.zeros(1, 2, 3)).shape == (1, 5)


@pytest.mark.parametrize("spec, message", [
    # the factory's own error, named with where it was raised (not "check model.kwargs")
    ("my_models:boom", "my_models:boom' raised RuntimeError at .*test_models.py:48: no GPU today"),
    ("my_models:not_a_module", "returned a str, not a torch.nn.Module"),
    ("my_models:missing", "has no callable 'missing'"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("resnet", "choose one of mlp, small_cnn, cnn1d"),
])
def test_factory_errors_name_the_factory(user_module, spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model(spec, (4,), 2, {})


def test_unknown_kwarg_is_a_config_error():
    with pytest.raises(ConfigError, match="check model.kwargs"):
        build_model("mlp", (4,), 2, {"widht": 3})
