"""Whole-split metrics (``eval.metrics``, ``fit(..., metrics=...)``): F1, AUROC, precision,
recall, mAP and the like are not means of per-batch values, so they are computed by objects with
torchmetrics' protocol, ``update(preds, target)`` over every batch of a split, then
``compute()`` and ``reset()``. torchmetrics' own metrics sync their states over the ranks in
``compute()``; evaluation gives every sample to exactly one rank, so each is counted once.

What they are fed: the step's ``metric_inputs`` (``steps.METRIC_INPUTS``), a ``(preds,
target)`` pair in the metrics dict it returns while evaluating. The classification step returns
the model's outputs and the targets; a custom step adds the pair itself.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import torch

from ironloop.engine.step_fns import METRIC_INPUTS
from ironloop.errors import ConfigError, UserError
from ironloop.specs import import_spec

#: Names the evaluation already reports: a whole-split metric may not take them.
TAKEN = ("loss", "acc", "ppl")


class SplitMetrics:
    """The run's whole-split metrics by name, on the device."""

    def __init__(self, metrics: dict[str, Any], device: torch.device):
        for name, metric in metrics.items():
            if not all(callable(getattr(metric, m, None)) for m in ("update", "compute", "reset")):
                raise UserError(f"metrics[{name!r}]: {type(metric).__name__} has no update(preds, "
                                f"target) / compute() / reset(); pass a torchmetrics Metric")
            if name in TAKEN or not name.isidentifier():
                raise UserError(f"metrics: the name {name!r} cannot be used (loss, acc and ppl "
                                f"are taken; use letters, digits and _), e.g. 'f1'")
        self.metrics: dict[str, Any] = {
            n: m.to(device) if isinstance(m, torch.nn.Module) else m for n, m in metrics.items()}

    def check_classes(self, num_classes: int | None) -> None:
        """A metric built for another class count than the run's (torchmetrics' Multiclass*
        ``num_classes``) fails at the first evaluation, perhaps an epoch in: refused here."""
        for name, metric in self.metrics.items():
            theirs = getattr(metric, "num_classes", None)
            if num_classes and isinstance(theirs, int) and theirs != num_classes:
                raise ConfigError(f"eval.metrics.{name}: num_classes={theirs}, but the run has "
                                  f"{num_classes} classes (the data's, the model's outputs); "
                                  f"set eval.metrics.{name}.num_classes={num_classes} (or "
                                  f"build the metric passed to fit() with it)")

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def update(self, inputs) -> None:
        """Feed one batch's ``metric_inputs`` (from the step's metrics dict)."""
        if not isinstance(inputs, (tuple, list)) or len(inputs) != 2:
            raise UserError(f"eval.metrics ({', '.join(self.metrics)}) need the step's "
                            f"predictions: return {{'{METRIC_INPUTS}': (preds, target), ...}} in "
                            f"the step's metrics dict while evaluating (model.training is False)")
        preds, target = inputs
        for metric in self.metrics.values():
            metric.update(preds.detach(), target)

    def compute(self) -> dict[str, float]:
        """Each metric over the whole split (torchmetrics: over every rank), then reset."""
        out = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            out[name] = float(value)  # host read: once per metric per evaluation
            metric.reset()
        return out


def build_metrics(specs: dict[str, dict], given: dict[str, Any] | None,
                  device: torch.device) -> SplitMetrics | None:
    """``eval.metrics`` specs built, plus the metric objects passed to fit(); None for none."""
    metrics = {name: _from_spec(name, spec) for name, spec in specs.items()}
    for name in given or {}:
        if name in metrics:
            raise UserError(f"metrics: {name!r} is both in eval.metrics and passed to fit(); "
                            f"keep one")
    metrics.update(given or {})
    return SplitMetrics(metrics, device) if metrics else None


def _from_spec(name: str, spec: dict) -> Any:
    """``{spec: torchmetrics.classification.MulticlassF1Score, num_classes: 10, ...}``: the
    class named by ``spec`` ('module.Class' or 'module:Class'), called with the other keys."""
    key = f"eval.metrics.{name}"
    path = spec["spec"]
    if ":" not in path:
        module, _, attr = path.rpartition(".")
        path = f"{module}:{attr}"
    try:
        cls = import_spec(path, f"{key}.spec")
    except ConfigError as e:
        if path.startswith("torchmetrics") and find_spec("torchmetrics") is None:
            raise UserError(f"{key}.spec={spec['spec']!r} needs torchmetrics; pip install "
                            f"'ironloop[metrics]'") from e
        raise
    kwargs = {k: v for k, v in spec.items() if k != "spec"}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {spec['spec']}({kwargs}) failed: {e}; check its "
                          f"arguments".replace("\n", " ")) from e
