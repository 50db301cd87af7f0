"""ironloop: a production PyTorch training loop you can read in one sitting.

    import ironloop
    result = ironloop.fit(model, train_data, val_data, config={"train.epochs": 5})
"""

__version__ = "0.1.0"

from ironloop.config import Config, load_config  # noqa: E402
from ironloop.fit import FitResult, fit  # noqa: E402

__all__ = ["Config", "FitResult", "fit", "load_config", "__version__"]
