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


def _layers(model: nn.Module) -> list[str]:
    return [repr(m) for m in model]


def test_mlp_is_flatten_then_linear_relu_blocks_then_the_head():
    assert _layers(build_model("mlp", [1, 4, 4], 3, {"hidden": [5, 6]})) == [
        "Flatten(start_dim=1, end_dim=-1)",
        "Linear(in_features=16, out_features=5, bias=True)", "ReLU()",
        "Linear(in_features=5, out_features=6, bias=True)", "ReLU()",
        "Linear(in_features=6, out_features=3, bias=True)"]
    with_dropout = build_model("mlp", (4,), 2, {"hidden": [5], "dropout": 0.25})
    assert _layers(with_dropout)[2:4] == ["ReLU()", "Dropout(p=0.25, inplace=False)"]
    default = [m for m in build_model("mlp", (4,), 2, {}) if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in default] == [(4, 256), (256, 128), (128, 2)]


def test_small_cnn_is_two_conv_blocks_then_a_linear_head():
    assert _layers(build_model("small_cnn", (3, 8, 12), 5,
                               {"channels": [4, 6], "hidden": 10, "dropout": 0.5})) == [
        "Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))", "ReLU()",
        "MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)",
        "Conv2d(4, 6, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))", "ReLU()",
        "MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)",
        "Flatten(start_dim=1, end_dim=-1)",
        "Linear(in_features=36, out_features=10, bias=True)", "ReLU()",
        "Dropout(p=0.5, inplace=False)", "Linear(in_features=10, out_features=5, bias=True)"]
    default = build_model("small_cnn", (1, 8, 8), 2, {})
    assert [m.out_channels for m in default if isinstance(m, nn.Conv2d)] == [32, 64]
    assert [(m.in_features, m.out_features) for m in default if isinstance(m, nn.Linear)] == \
        [(64 * 2 * 2, 128), (128, 2)]


def test_cnn1d_pads_by_half_the_kernel_and_sizes_its_head_from_the_strides():
    model = build_model("cnn1d", (2, 40), 3, {"channels": 4, "strides": [3, 1], "kernel": 5,
                                              "hidden": 7})
    assert _layers(model) == [
        "Conv1d(2, 4, kernel_size=(5,), stride=(3,), padding=(2,))", "ReLU()",
        "Conv1d(4, 4, kernel_size=(5,), stride=(1,), padding=(2,))", "ReLU()",
        "Flatten(start_dim=1, end_dim=-1)",
        "Linear(in_features=56, out_features=7, bias=True)",  # 40 -> 14 -> 14, x 4 channels
        "ReLU()", "Linear(in_features=7, out_features=3, bias=True)"]
    assert model(torch.zeros(2, 2, 40)).shape == (2, 3)
    pooled = build_model("cnn1d", (1, 40), 3, {"channels": 4, "strides": [2], "kernel": 4,
                                               "global_pool": True})
    assert _layers(pooled) == [
        "Conv1d(1, 4, kernel_size=(4,), stride=(2,), padding=(2,))", "ReLU()",
        "AdaptiveMaxPool1d(output_size=1)", "Flatten(start_dim=1, end_dim=-1)",
        "Linear(in_features=4, out_features=3, bias=True)"]
    default = [m for m in build_model("cnn1d", (1, 40), 3, {}) if isinstance(m, nn.Linear)]
    assert [m.out_features for m in default] == [128, 3]


def test_a_factory_is_offered_what_the_data_knows_and_the_kwargs_win(monkeypatch):
    seen = []

    def factory(input_shape, num_classes=7, vocab_size=None, width=1):
        seen.append((input_shape, num_classes, vocab_size, width))
        return nn.Identity()

    mod = types.ModuleType("my_factories")
    mod.factory = factory
    monkeypatch.setitem(sys.modules, "my_factories", mod)
    build_model("my_factories:factory", [2, 3], 5, {}, {"vocab_size": 11, "seq_len": 4})
    build_model("my_factories:factory", (2,), None, {"width": 3, "vocab_size": 13},
                {"vocab_size": 11})
    build_model("my_factories:factory", (2,), None, {}, {"num_classes": None})
    build_model("my_factories:factory", (2,), None, {}, {"num_classes": 4})
    build_model("my_factories:factory", (2,), 6, {}, {"num_classes": 4})
    build_model("my_factories:factory", (2,), None, {})
    assert seen == [((2, 3), 5, 11, 1), ((2,), 7, 13, 3), ((2,), 7, None, 1),
                    ((2,), 4, None, 1), ((2,), 6, None, 1), ((2,), 7, None, 1)]


def test_unknown_and_wrong_factories_are_named_exactly(user_module):
    with pytest.raises(ConfigError) as e:
        build_model("resnet", (4,), 2, {})
    assert str(e.value) == ("model.name='resnet': unknown model; choose one of mlp, small_cnn, "
                            "cnn1d or give your own as 'module:factory'")
    with pytest.raises(ConfigError) as e:
        build_model("my_models:not_a_module", (4,), 2, {})
    assert str(e.value) == ("model factory 'my_models:not_a_module' returned a str, not a "
                            "torch.nn.Module; return the model instance")


def test_a_configs_model_is_built_on_its_data_seeded_with_run_seed(tmp_path):
    from ironloop.config import load_config
    from ironloop.tools.models import from_config, model_for

    def cfg(seed):
        return load_config(None, ["data.name=tests.resume_cases:clean_data", "model.name=mlp",
                                  "model.kwargs={hidden: [4]}", f"run.seed={seed}",
                                  f"run.dir={tmp_path}"])

    model, bundle = from_config(cfg(3))
    assert (bundle.input_shape, bundle.num_classes) == ((8,), 3)
    assert model(bundle.train[0][0][None]).shape == (1, 3)
    torch.manual_seed(99)
    again = model_for(cfg(3), bundle)
    other = model_for(cfg(4), bundle)
    first = next(model.parameters())
    assert torch.equal(first, next(again.parameters()))
    assert not torch.equal(first, next(other.parameters()))
    torch.manual_seed(3)
    assert torch.equal(first, next(build_model("mlp", (8,), 3, {"hidden": [4]}).parameters()))
