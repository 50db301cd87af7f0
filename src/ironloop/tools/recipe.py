"""The front door: ``ironloop.fit``, and ``ironloop train``'s path from a config alone (the
built-in dataset and model). Both go through ``run_fit``, the one place that holds run.dir, runs
the preflight doctor, sets run.threads and names collective timeouts around the engine's
``train_run``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from torch import nn

from ironloop.config import Config
from ironloop.data.bundle import DataBundle
from ironloop.engine import build, fit as engine
from ironloop.engine.fit import FitResult
from ironloop.engine.schedule_notes import ignored_settings
from ironloop.errors import speaking_python
from ironloop.parallel.world import name_timeouts
from ironloop.state import lock
from ironloop.state.prepare import check_run_dir, refuse_resume_args
from ironloop.tools.doctor.run import preflight
from ironloop.tools.models import from_config


def fit(model: nn.Module, train_data, val_data=None, config: Config | dict | None = None, *,
        loss_fn=None, step_fn=None, test_data=None, num_classes: int | None = None,
        optimizer=None, scheduler=None, callbacks=None, metrics: dict | None = None,
        resume: bool | str | None = False, overwrite: bool = False,
        allow_config_change: bool = False, from_config: bool = False) -> FitResult:
    """Train ``model`` on ``train_data`` and return the trained model and its results.

    Args:
        model: any ``nn.Module``; the default step calls ``model(inputs)`` on ``(inputs,
            targets)`` batches.
        train_data, val_data, test_data: a Dataset, a DataLoader (its sampler, collate_fn and
            batch size are kept), a Hugging Face ``datasets.Dataset``, or an (inputs, targets)
            pair; ``val_data`` also ``{name: one of those}`` (``val_<name>_<metric>``).
        config: a Config, a dict (nested sections or "dotted.keys"), or None for the defaults.
        loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the batch. Default: the
            ``loss.*`` config (``loss.name`` may be 'module:function').
        step_fn: ``step_fn(model, batch) -> (loss, {name: scalar tensor}[, weight])`` for
            anything that is not ``(inputs, targets)`` classification. Loss and metrics are
            means over the batch's weight (its samples, or the tokens a third value gives:
            see engine/tokens.py). A third parameter ``state`` makes it stateful (carry.py);
            one named ``optimizers`` makes it update several optimizers itself (several.py).
            Default: ``train.step_fn`` ('module:function' or 'lm'), else classification.
        num_classes: checks that labels lie in [0, C); inferred from the model when omitted.
        optimizer: a torch optimizer over the model's parameters, or ``factory(params)``
            returning one. Several (a GAN's): ``{name: optimizer or factory(params)}``, a
            factory getting the parameters of the submodule ``name``, with a
            ``step_fn(model, batch, optimizers)`` that calls ``optimizers.update(name,
            loss)`` for each (engine/several.py). Default: the ``optim.*`` config.
        scheduler: a torch LR scheduler, or ``factory(optimizer)`` returning one. It steps after
            every optimizer step; a ReduceLROnPlateau steps after every evaluation with the
            monitored metric. Default: the ``schedule.*`` config.
        callbacks: ``ironloop.callbacks.Callback`` objects; see that module for the hooks.
        metrics: ``{name: torchmetrics Metric}``, whole-split ``val_<name>`` (engine/metrics.py).
        resume: True = the newest valid checkpoint in run.dir (fresh start when none);
            a path = that checkpoint.
        overwrite: delete a previous run's outputs in run.dir before starting.
        allow_config_change: resume even when keys that change the training trajectory differ
            from the checkpoint's config (see ``ironloop.state.drift``).
        from_config: the model and data were built from model.name / data.name (what
            ``ironloop train`` does); otherwise config.yaml names the user's classes.
    """
    cfg = engine.as_config(config)  # parsed once: run_fit and the engine take this Config
    data = DataBundle(train=train_data, val=val_data, test=test_data, input_shape=(),
                      num_classes=num_classes)
    given = build.Given(loss_fn=loss_fn, step_fn=step_fn, num_classes=num_classes,
                        optimizer=optimizer, scheduler=scheduler, callbacks=callbacks,
                        metrics=metrics, resume=resume, overwrite=overwrite,
                        allow_config_change=allow_config_change, from_config=from_config)
    # doctor.preflight null is fit()'s default: no preflight (ironloop train's is to run it)
    with speaking_python():  # errors and notices name fit()'s arguments, not the CLI's flags
        return run_fit(cfg, model, data, given, doctor=cfg.doctor.preflight is True)


def run_fit(cfg: Config, model: nn.Module, data: DataBundle, given: build.Given, *,
            doctor: bool, run_dir_held: bool = False) -> FitResult:
    """What every fit does around the engine's ``train_run``, in order: refuse bad arguments,
    hold run.dir (rank 0), read the resume's checkpoint and resolve the config (once: nothing
    after this rewrites it), run the preflight doctor when ``doctor`` asks, set run.threads,
    name collective timeouts.
    ``run_dir_held``: the caller holds run.dir's lock already (``ironloop train`` takes it
    before torch's import, cli.py), so it is not taken again here."""
    engine.check_arguments(model, data.train)
    refuse_resume_args(given.resume, given.overwrite)
    main, run_dir = engine.is_rank0(), Path(cfg.run.dir)  # resolving never moves run.dir
    with contextlib.nullcontext() if run_dir_held else lock.hold(run_dir, main):
        # The resume's checkpoint, read once and under the lock: its config and world size
        # keep the global batch here, and the engine resumes from this read.
        peeked = engine.peek(cfg, given.resume)
        cfg = engine.resolved(cfg, data.train, given.step_fn, data.val,  # the one config
                              peeked)
        for warning in ignored_settings(cfg) if main and given.scheduler is None else ():
            print(warning)  # before anything runs: a key the schedule overrides changes nothing
        if doctor:
            # The checks that can refuse run.dir come before the preflight writes doctor.json
            # there: a refused run leaves run.dir as it was (the engine checks again).
            if main:
                check_run_dir(run_dir, given.resume, given.overwrite)
            preflight(cfg, model, data, resume=given.resume, step_fn=given.step_fn,
                      loss_fn=given.loss_fn)  # the doctor's quick checks; strict stops here
        with engine.cpu_threads(cfg.run.threads), name_timeouts():
            return engine.train_run(cfg, model, data, given, peeked)


def fit_without_preflight(model: nn.Module, train_data, val_data=None,
                          config: Config | dict | None = None, *, test_data=None,
                          **given: Any) -> FitResult:
    """``fit`` without its preflight doctor, whatever doctor.preflight says: for the tools that
    train through the front door (tune's trials, the resume check's scratch runs, the lab's
    accumulation check). ``given``: ``fit``'s other keyword arguments."""
    data = DataBundle(train=train_data, val=val_data, test=test_data, input_shape=(),
                      num_classes=given.get("num_classes"))
    return run_fit(engine.as_config(config), model, data, build.Given(**given), doctor=False)


def train_config(cfg: Config, resume: bool | str = False, overwrite: bool = False,
                 allow_config_change: bool = False, run_dir_held: bool = False) -> FitResult:
    """What ``ironloop train`` does: data.name + model.name from the config, then ``run_fit``
    with the preflight doctor (doctor.preflight null or true; false: the doctor skips its
    checks). ``run_dir_held``: the CLI holds run.dir's lock already."""
    model, bundle = from_config(cfg)
    given = build.Given(num_classes=bundle.num_classes, resume=resume, overwrite=overwrite,
                        allow_config_change=allow_config_change, from_config=True)
    return run_fit(cfg, model, bundle, given, doctor=True, run_dir_held=run_dir_held)
