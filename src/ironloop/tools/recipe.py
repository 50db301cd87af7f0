"""From a config alone to a trained run: the built-in dataset and model, then ``fit``."""

from __future__ import annotations

import os
from pathlib import Path

from ironloop.config import Config
from ironloop.engine.fit import FitResult, fit
from ironloop.state import lock
from ironloop.state.rundir import check_run_dir
from ironloop.tools.doctor.run import preflight
from ironloop.tools.models import from_config


def train_config(cfg: Config, resume: bool | str = False, overwrite: bool = False,
                 allow_config_change: bool = False) -> FitResult:
    """What ``ironloop train`` does: data.name + model.name from the config, then fit()."""
    model, bundle = from_config(cfg)
    main = os.environ.get("RANK", "0") == "0"
    # run.dir's lock, and the checks that can refuse run.dir, before the preflight writes
    # doctor.json there: a refused run leaves run.dir as it was (fit() takes and checks again)
    with lock.hold(Path(cfg.run.dir), main):
        if main:
            check_run_dir(Path(cfg.run.dir), resume, overwrite)
        preflight(cfg, model, bundle, resume=resume)  # the doctor's quick checks; --strict stops
        return fit(model, bundle.train, bundle.val, cfg, test_data=bundle.test,
                   num_classes=bundle.num_classes, resume=resume, overwrite=overwrite,
                   allow_config_change=allow_config_change, from_config=True)
