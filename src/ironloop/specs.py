"""The user's own code named in a config: ``module:attr`` specs, and calling factories.

``model.name``, ``data.name``, ``loss.name`` and ``train.step_fn`` all take ``module:attr``.
The current directory is importable, as with ``python -m``, so a ``my_model.py`` beside the
config works without installing anything.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from ironloop.errors import ConfigError


def import_spec(spec: str, key: str) -> Any:
    """The callable ``attr`` of ``module`` for ``spec`` = 'module:attr'; ``key`` is the dotted
    config key named in errors."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={spec!r}: must be 'module:attr', e.g. my_pkg.models:build")
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: the console script does not add the CWD
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}={spec!r}: cannot import module {module_name!r} ({e}); "
                          f"make it importable (run from its directory, pip install -e . "
                          f"or PYTHONPATH)") from e
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r}: {module_name} has no callable {attr!r}")
    return obj


def accepted(factory, **optional: Any) -> dict[str, Any]:
    """The subset of ``optional`` keyword arguments that ``factory``'s signature accepts.

    ironloop offers a factory what it knows (input_shape, num_classes); a GPT factory that takes
    neither simply does not get them. A factory with ``**kwargs`` gets everything.
    """
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        return optional
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return optional
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in optional.items() if k in names}


def call_factory(factory, what: str, key: str, **kwargs: Any) -> Any:
    """``factory(**kwargs)``, its mistakes told apart: arguments its signature does not take are
    the config's ("check {key}"); anything raised inside it is the factory's own error, named
    with the line that raised it."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{what} rejected its arguments: {e}; check {key}") from None
    except ValueError:  # a builtin without a signature: let the call say
        pass
    try:
        return factory(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{what} raised {type(e).__name__}{where}: {first}; fix the "
                          f"factory") from e
