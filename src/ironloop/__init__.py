"""ironloop: a production PyTorch training loop you can read in one sitting.

    import ironloop
    result = ironloop.fit(model, train_data, val_data, config={"train.epochs": 5})

The names below are imported on first use (PEP 562), so ``import ironloop`` and ``ironloop
--version`` do not pay for importing torch.
"""

import importlib

from ironloop.version import __version__

_LAZY = {"Config": "ironloop.config", "load_config": "ironloop.config",
         "fit": "ironloop.tools.recipe", "FitResult": "ironloop.engine.fit",
         "tune": "ironloop.tools.tune", "TuneResult": "ironloop.tools.tune"}

__all__ = ["Config", "FitResult", "TuneResult", "__version__", "fit", "load_config", "tune"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later reads are plain attribute reads
        return value
    try:  # a subpackage (ironloop.engine, ...) used as an attribute before it was imported
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'ironloop' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
