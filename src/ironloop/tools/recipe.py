"""The public ``ironloop.fit`` (the engine's fit, with the preflight doctor when asked), and
``ironloop train``'s path from a config alone: the built-in dataset and model, then ``fit``."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ironloop.config import Config
from ironloop.data.bundle import DataBundle
from ironloop.engine import fit as engine
from ironloop.engine.fit import FitResult
from ironloop.state import lock
from ironloop.state.prepare import check_run_dir
from ironloop.tools.doctor.run import preflight
from ironloop.tools.models import from_config


@functools.wraps(engine.fit)
def fit(model, train_data, val_data=None, config=None, **kwargs) -> FitResult:
    cfg = engine.as_config(config)
    if not cfg.doctor.preflight:  # null (fit()'s default) or false: straight to training
        return engine.fit(model, train_data, val_data, cfg, **kwargs)
    bundle = DataBundle(train=train_data, val=val_data, test=kwargs.get("test_data"),
                        input_shape=(), num_classes=kwargs.get("num_classes"))
    return _checked_fit(cfg, model, bundle, kwargs)


def _checked_fit(cfg: Config, model, bundle: DataBundle, kwargs: dict) -> FitResult:
    """The preflight, then fit(). run.dir's lock, and the checks that can refuse run.dir, come
    before the preflight writes doctor.json there: a refused run leaves run.dir as it was
    (fit() takes and checks again)."""
    resume = kwargs.get("resume", False)
    main = os.environ.get("RANK", "0") == "0"
    with lock.hold(Path(cfg.run.dir), main):
        if main:
            check_run_dir(Path(cfg.run.dir), resume, kwargs.get("overwrite", False))
        preflight(cfg, model, bundle, resume=resume, step_fn=kwargs.get("step_fn"),
                  loss_fn=kwargs.get("loss_fn"))  # the doctor's quick checks; strict stops
        return engine.fit(model, bundle.train, bundle.val, cfg, **kwargs)


def train_config(cfg: Config, resume: bool | str = False, overwrite: bool = False,
                 allow_config_change: bool = False) -> FitResult:
    """What ``ironloop train`` does: data.name + model.name from the config, then fit() with the
    preflight doctor (unless doctor.preflight=false)."""
    model, bundle = from_config(cfg)
    if cfg.doctor.preflight is None:
        cfg = cfg.with_overrides({"doctor.preflight": True})
    return _checked_fit(cfg, model, bundle, dict(
        test_data=bundle.test, num_classes=bundle.num_classes, resume=resume,
        overwrite=overwrite, allow_config_change=allow_config_change, from_config=True))
