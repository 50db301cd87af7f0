"""Built-in models and the ``module:factory`` hook for the user's own.

Every factory is called as ``factory(input_shape=tuple, num_classes=int, **meta,
**model.kwargs)``, offered only the ones of input_shape, num_classes and the data factory's
metadata (``vocab_size``, ``seq_len``, ...) that its signature accepts; model.kwargs win.
None of the built-ins uses dropout or BatchNorm by default, so gradient accumulation is exactly
equivalent to a bigger batch.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ironloop.errors import ConfigError
from ironloop.specs import accepted, call_factory, import_spec


def mlp(input_shape, num_classes, hidden=(256, 128), dropout=0.0) -> nn.Module:
    """Flatten, then Linear-ReLU blocks, then a linear head."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def small_cnn(input_shape, num_classes, channels=(32, 64), hidden=128, dropout=0.0) -> nn.Module:
    """Two conv-ReLU-maxpool blocks, then a 128-unit linear head with C outputs."""
    c_in, h, w = input_shape
    c1, c2 = channels
    head: list[nn.Module] = [nn.Flatten(), nn.Linear(c2 * (h // 4) * (w // 4), hidden), nn.ReLU()]
    if dropout:
        head.append(nn.Dropout(dropout))
    return nn.Sequential(
        nn.Conv2d(c_in, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        *head, nn.Linear(hidden, num_classes))


def cnn1d(input_shape, num_classes, channels=32, hidden=128, strides=(2, 2, 2), kernel=3,
          global_pool=False) -> nn.Module:
    """1-D convolutions (one per entry of ``strides``, ``kernel`` wide, zero-padded by
    ``kernel // 2``, each followed by ReLU), then a head; sized for MNIST-1D (1 x 40).

    The head is an MLP on the flattened features (``hidden`` units), or with ``global_pool`` a
    max over positions and one linear layer: the class no longer depends on where in the signal
    a pattern sits, which is what MNIST-1D's random shifts call for. The defaults are three
    stride-2 convolutions of kernel 3 with the MLP head; configs/mnist1d.yaml uses four of
    width 64 with strides 1, 1, 2, 2 and the global max pool.
    """
    c_in, length = input_shape
    layers: list[nn.Module] = []
    for stride in strides:
        layers += [nn.Conv1d(c_in, channels, kernel, stride=stride, padding=kernel // 2),
                   nn.ReLU()]
        c_in = channels
        length = (length + 2 * (kernel // 2) - kernel) // stride + 1
    if global_pool:
        return nn.Sequential(*layers, nn.AdaptiveMaxPool1d(1), nn.Flatten(),
                             nn.Linear(channels, num_classes))
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * length, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


MODELS = {"mlp": mlp, "small_cnn": small_cnn, "cnn1d": cnn1d}


def from_config(cfg):
    """(model, data bundle) as ``ironloop train`` and ``ironloop doctor`` both build them:
    data.name first, then model.name with what the data told it."""
    from ironloop.data import build_data

    bundle = build_data(cfg.data)
    return model_for(cfg, bundle), bundle


def model_for(cfg, bundle) -> nn.Module:
    """model.name built on data already built, as ``ironloop train`` builds it: seeded with
    run.seed, offered the data's input_shape, num_classes and the data factory's metadata
    (``vocab_size``, ``block_size``, ...). Every tool that builds a config's model calls this,
    so none can build it differently from train (tune builds one per trial)."""
    from ironloop.state.rng import seed_everything

    seed_everything(cfg.run.seed)  # after the data: mnist1d's generator reseeds the globals
    return build_model(cfg.model.name, bundle.input_shape, bundle.num_classes, cfg.model.kwargs,
                       bundle.meta)


def build_model(name: str, input_shape: tuple, num_classes: int | None, kwargs: dict,
                meta: dict | None = None) -> nn.Module:
    """A built-in model by name, or the user's ``module:factory``; ``meta`` is what the data
    factory returned besides its splits."""
    if ":" in name:
        factory = import_spec(name, "model.name")
    elif name in MODELS:
        factory = MODELS[name]
    else:
        raise ConfigError(f"model.name={name!r}: unknown model; choose one of "
                          f"{', '.join(MODELS)} or give your own as 'module:factory'")
    known: dict[str, Any] = {"input_shape": tuple(input_shape)}
    if num_classes is not None:  # unknown: the factory's own default (or its error) stands
        known["num_classes"] = num_classes
    meta = {k: v for k, v in (meta or {}).items() if not (k == "num_classes" and v is None)}
    offered = accepted(factory, **{**meta, **known})
    model = call_factory(factory, f"model factory {name!r}", "model.kwargs",
                         **{**offered, **kwargs})
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {name!r} returned a {type(model).__name__}, "
                          f"not a torch.nn.Module; return the model instance")
    return model
