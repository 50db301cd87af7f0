"""Optional dependencies, imported only when a feature needs them.

``pip install ironloop`` brings torch, numpy, pyyaml, tqdm and safetensors. The rest are extras:
``data`` (scikit-learn, mnist1d: the embedded datasets), ``plots`` (matplotlib: reports and the
lab), ``tensorboard``, ``wandb``, ``mlflow``, ``stream`` (torchdata: training on a stream),
``remote`` (fsspec, s3fs, gcsfs: checkpoint.remote); ``all`` has every one.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ironloop.errors import UserError


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise a UserError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # the package that failed to import: torch.utils.tensorboard's is tensorboard
        top = (e.name or module).split(".")[0]
        raise UserError(f"{what} needs the {top} package, which is not installed: "
                        f"pip install 'ironloop[{extra}]' (or 'ironloop[all]')") from e
