"""ironloop: a production PyTorch training loop you can read in one sitting.

    import ironloop
    result = ironloop.fit(model, train_data, val_data, config={"train.epochs": 5})
"""

from ironloop.config import Config, load_config
from ironloop.engine.fit import FitResult, fit
from ironloop.tools.tune import TuneResult, tune
from ironloop.version import __version__

__all__ = ["Config", "FitResult", "TuneResult", "fit", "load_config", "tune", "__version__"]
