"""The built-in steps (``(inputs, targets)`` classification with Hugging Face-style outputs, and
next-token language modelling), what a step may return (``unpack``), and the host-side label
check that runs before a bad label can become a CUDA assert.

A step returns ``(loss, metrics)`` or ``(loss, metrics, weight)``: ``loss`` is a mean over the
batch's ``weight`` units (samples when it is left out; tokens for a language model, or the
valid tokens under ``ignore_index``). With a weight, accumulation windows, ranks and
evaluation average per unit: the mean over every token of the window, not a mean of means.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ironloop.config import Config
from ironloop.data.counting import declared_count
from ironloop.data.source import RunData
from ironloop.engine.optim import Loss
from ironloop.errors import DataError, UserError
from ironloop.specs import import_spec

#: (model, batch) -> (loss, metrics) or (loss, metrics, weight); see ``unpack``.
StepFn = Callable[[nn.Module, Any], Any]

#: ``train.step_fn`` names of the built-in steps (besides 'module:function').
BUILT_IN = ("lm",)
#: Targets equal to this are padding: no loss, no weight (torch's and Hugging Face's default).
IGNORE_INDEX = -100
#: The metrics-dict key of a ``(preds, target)`` pair for the whole-split metrics (metrics.py):
#: fed to them while evaluating, never logged.
METRIC_INPUTS = "metric_inputs"


def unpack(out, where: str = "step_fn") -> tuple[torch.Tensor, dict, Any]:
    """(loss, metrics, weight or None) from what a step returned."""
    if isinstance(out, (tuple, list)) and len(out) in (2, 3):
        loss, metrics, weight = (*out, None)[:3]
        if isinstance(loss, torch.Tensor) and isinstance(metrics, dict):
            return loss, metrics, weight
    raise UserError(f"{where} returned {describe(out)}; return (loss, {{name: scalar tensor}}) "
                    f"or (loss, {{...}}, weight), the loss a mean over the batch's weight "
                    f"(its samples, or its tokens)")


def is_lm(step_fn, spec: str) -> bool:
    """Whether the run trains with the built-in LM step: passed to fit(), or named by
    ``train.step_fn`` (``spec``) when none is passed."""
    return step_fn is lm_step or (step_fn is None and spec == "lm")


def named_step(spec: str) -> StepFn:
    """The step ``train.step_fn`` names: a built-in (``lm``) or the user's 'module:function'."""
    return lm_step if spec == "lm" else import_spec(spec, "train.step_fn")


def lm_step(model: nn.Module, batch) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """Next-token cross-entropy per token (``train.step_fn=lm``), weighted by the valid tokens.

    ``(inputs, targets)`` batches of token ids, targets already shifted, padding marked -100:
    the model returns logits ``(..., vocab)``, ``(logits, ...)`` or an object with ``.logits``.
    A model whose ``forward`` has a ``targets`` parameter (nanoGPT's ``forward(idx,
    targets=None)``, which returns only the last position's logits without targets) is called
    as ``model(inputs, targets=targets)`` and its own loss is used (``(logits, loss)``, or
    ``.loss``), weighted by the targets that count (``>= 0``: nanoGPT ignores -1, torch -100).
    A dict batch goes to a Hugging Face causal LM (``model(**batch)``, which shifts ``labels``
    itself); its ``.loss`` is weighted by the labels that count.
    """
    if isinstance(batch, dict):
        loss = output_loss(model(**batch))
        labels = batch.get("labels")
        if labels is None:
            return loss, {}, None
        return loss, {}, (labels[..., 1:] != IGNORE_INDEX).sum()  # HF shifts by one inside
    x, y = batch[0], batch[1]
    if takes_targets(model):
        return own_loss(model(x, targets=y)), {}, (y >= 0).sum()
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else \
        out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise UserError(f"train.step_fn=lm: the model returned {describe(out)}; it needs "
                        f"logits (a tensor, a tuple starting with one, or .logits)")
    valid = (y != IGNORE_INDEX).sum()
    # A sum over the valid tokens / their count: an all-padding batch gives 0, not NaN.
    total = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total / valid.clamp(min=1), {}, valid


def takes_targets(model: nn.Module) -> bool:
    """Whether the user's module (under any DDP or compile wrapper) has ``forward(...,
    targets)``: it computes its own loss (nanoGPT)."""
    inner: Any = model
    while True:
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            inner = inner.module
        elif isinstance(getattr(inner, "_orig_mod", None), nn.Module):  # torch.compile's
            inner = inner._orig_mod
        else:
            return _forward_takes_targets(inner.__class__)


@functools.cache
def _forward_takes_targets(cls: Any) -> bool:  # once per class: not per step
    try:
        return "targets" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # a forward with no readable signature
        return False


def own_loss(out) -> torch.Tensor:
    """The loss a ``forward(idx, targets)`` model returned: ``(logits, loss)``, or ``.loss``."""
    if isinstance(out, (tuple, list)) and len(out) > 1 and isinstance(out[1], torch.Tensor) \
            and out[1].ndim == 0:
        return out[1]
    if isinstance(out, (tuple, list, torch.Tensor)):
        raise UserError(f"train.step_fn=lm: the model's forward takes targets, and returned "
                        f"{describe(out)} when given them; return (logits, loss) with the loss "
                        f"a scalar mean over the tokens, as nanoGPT does")
    return output_loss(out)


def classification_step(loss_fn, feed_metrics: bool = False) -> StepFn:
    """The default step for ``(inputs, targets)`` batches: loss, and accuracy when evaluating;
    ``feed_metrics``: also the model's outputs and the targets for ``eval.metrics``. A graph
    batch (PyTorch Geometric's, with ``num_graphs`` and ``y``) is ``model(batch)`` against
    ``batch.y``."""

    def step(model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(batch, dict):  # Hugging Face style: keyword inputs, the model's own loss
            return output_loss(keyword_call(model, batch)), {}
        if declared_count(batch) is not None and isinstance(getattr(batch, "y", None),
                                                            torch.Tensor):
            x, y = batch, batch.y  # a graph batch: the model reads its x, edge_index, batch
        else:
            _refuse_extra_items(batch)
            x, y = batch[0], batch[1]
        try:
            out = model(x)
        except RuntimeError as e:
            raise input_error(model, x, e) or e from None
        if not isinstance(out, torch.Tensor):
            return output_loss(out), {}
        try:
            loss = loss_fn(out, y)
        except (RuntimeError, ValueError, IndexError) as e:  # IndexError: a scalar output
            if not _is_shape_error(e):
                raise
            raise misfit(out, y, e) from None
        if isinstance(loss, torch.Tensor) and loss.ndim:  # shape only: no host-device sync
            raise UserError(f"loss_fn returned a Tensor{list(loss.shape)}, one loss per sample "
                            f"or element; it must return one number: reduce it (.mean(), or "
                            f"the loss's reduction='mean')")
        if model.training:
            return loss, {}
        metrics = {} if y.is_floating_point() or out.ndim != 2 else \
            {"acc": (out.argmax(-1) == y).float().mean()}
        if feed_metrics:
            metrics[METRIC_INPUTS] = (out, y)
        return loss, metrics

    step.samples_first = True  # type: ignore[attr-defined]  # reads batch[0] as the inputs
    return step


def _refuse_extra_items(batch) -> None:
    """A dataset returning (x, y, w): the default step reads (inputs, targets), and the rest
    (sample weights, ids) was ignored without a word. Refused rather than guessed at."""
    if isinstance(batch, (list, tuple)) and len(batch) > 2:
        raise DataError(f"a batch holds {len(batch)} items; the default step uses the first two "
                        f"as (inputs, targets) and would ignore the rest (sample weights?): "
                        f"pass a step_fn(model, batch) that uses them, or return (inputs, "
                        f"targets) from the dataset")


def _is_shape_error(e: Exception) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("size", "shape", "dimension", "expected input",
                                   "expected target", "type for target", "target tensor"))


def _first_line(e: Exception, width: int = 160) -> str:
    return (str(e).strip().splitlines() or [""])[0][:width]


def input_error(model: nn.Module, x, e: RuntimeError) -> UserError | None:
    """The model's forward failed on the batch's inputs: integer inputs into a model that
    computes in floats (a Linear or Conv on token ids or raw uint8 pixels), floats of another
    dtype than the model's (float64 from numpy), or inputs of another shape than the first
    layer takes. One line naming the inputs and the fix; None for any other error (the model's
    own, with its traceback)."""
    if not isinstance(x, torch.Tensor):
        return None
    text = str(e)
    if not x.is_floating_point() and "type" in text:
        return DataError(f"the inputs are {describe(x)} but the model computes in floats "
                         f"({_first_line(e)}); convert them with .float() (scaled, e.g. / 255 "
                         f"for pixels), or start the model with an nn.Embedding for token ids")
    theirs = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if theirs is not None and x.dtype != theirs and "type" in text:
        mine, want = (str(t).removeprefix("torch.") for t in (x.dtype, theirs))
        return DataError(f"the inputs are {describe(x)} but the model's parameters are "
                         f"{want} ({_first_line(e)}); convert the data with .to(torch.{want}) "
                         f"(numpy arrays are float64: torch.from_numpy(a).float()), or the model "
                         f"with model.to(torch.{mine}) to train in {mine}")
    if _is_shape_error(e) or "cannot be multiplied" in text:
        first = f" (e.g. nn.Linear({x.shape[-1]}, ...))" if x.ndim == 2 else ""
        return UserError(f"the model's forward failed on inputs {describe(x)} "
                         f"({_first_line(e)}); make the model take samples of shape "
                         f"{list(x.shape[1:])}, the data's, in its first layer{first}, or "
                         f"reshape the data")
    return None


def keyword_call(model: nn.Module, batch: dict):
    """``model(**batch)``, Hugging Face style; a dict whose keys the forward does not take
    (a dataset returning {'x': ..., 'y': ...}) is one line naming the keys and the fix."""
    try:
        inspect.signature(model.forward).bind(**batch)
    except TypeError as e:
        raise UserError(f"the batches are dicts ({describe(batch)}), which the default step "
                        f"passes as model(**batch), and the model's forward does not take them "
                        f"({e}); return (inputs, targets) pairs from the dataset, or pass a "
                        f"step_fn(model, batch) that unpacks the dict") from None
    except ValueError:  # no signature to read (a C extension's forward): call it as it is
        pass
    return model(**batch)


def misfit(out: torch.Tensor, y: torch.Tensor, e: Exception) -> UserError:
    """The one-line error for a model output whose shape does not fit the loss."""
    if out.ndim == 0:
        fix = "the model returned one number for the whole batch (a .sum() or .mean() in its " \
              "forward?): return one row of scores per sample"
    elif isinstance(y, torch.Tensor) and y.ndim == 2 and y.shape[1] == 1 and \
            not y.is_floating_point():
        fix = "class indices go in a [batch] tensor, not [batch, 1]: flatten the targets " \
              "(y.view(-1), or y.squeeze(1) in the dataset)"
    else:
        fix = "make the model's last layer output what the loss takes (cross_entropy: " \
              "[batch, classes] scores for [batch] class indices)"
    return UserError(f"the model's output {describe(out)} does not fit the loss for targets "
                     f"{describe(y)} ({_first_line(e, 200)}); {fix}, or set loss.name / pass "
                     f"a loss_fn or step_fn")


def output_loss(out) -> torch.Tensor:
    """The loss an HF-style output carries (``out.loss`` or ``out["loss"]``), or a one-line
    error saying what the model returned and what the default step needs instead."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise UserError(f"the model returned {describe(out)}; the default step needs a tensor of "
                    f"outputs, or an output carrying its loss (.loss or ['loss']). Pass a "
                    f"step_fn (train.step_fn=module:function) that computes the loss, or a "
                    f"loss_fn (loss.name=module:function) for the model's output")


def describe(obj, depth: int = 0) -> str:
    """Shapes and dtypes of a (nested) batch or output, for error messages."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if depth < 2 and isinstance(obj, dict):
        return "{" + ", ".join(f"{k}: {describe(v, depth + 1)}" for k, v in obj.items()) + "}"
    if depth < 2 and isinstance(obj, (list, tuple)):
        inner = ", ".join(describe(v, depth + 1) for v in obj)
        return f"a {type(obj).__name__} ({inner})"
    return "None" if obj is None else f"a {type(obj).__name__}"


def label_checker(num_classes: int) -> Callable[[Any], None]:
    """Reject class labels outside [0, C) on the host, with a message instead of a CUDA assert."""

    def check(batch) -> None:
        y = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.device.type != "cpu" \
                or not y.numel():  # an empty split has no label to check
            return
        lo, hi = int(y.min()), int(y.max())  # host tensors: no device sync
        if lo < 0 or hi >= num_classes:
            raise DataError(f"labels must be class indices in [0, {num_classes}), found a batch "
                            f"with labels in [{lo}, {hi}]; fix the targets or the number of "
                            f"classes (the model's output size)")

    return check


# ------------------------------------------------------------------ the classification step --
def classification(cfg: Config, model: nn.Module, device, loss_fn, num_classes,
                   data: RunData, feed_metrics: bool = False) -> tuple[Any, Any, int | None]:
    """The default (inputs, targets) step, the label check it needs (or None when every
    dataset is an in-memory tensor whose labels were checked here, once, in full), and the
    class count (given, inferred from the model, or None)."""
    if num_classes is None:
        num_classes = num_classes_of(model, data.first_sample, device)
    if loss_fn is None and ":" in cfg.loss.name:
        loss_fn = import_spec(cfg.loss.name, "loss.name")
    step_fn = classification_step(loss_fn or Loss(cfg.loss, num_classes), feed_metrics)
    if not num_classes:
        return step_fn, None, None
    check = label_checker(num_classes)
    if not data.in_memory():
        return step_fn, check, num_classes  # checked batch by batch, on the host
    for ds in (data.train, *data.val_sets.values(), data.test):
        if ds is not None:
            check((ds.x[:1], ds.y))
    return step_fn, None, num_classes


def infer_num_classes(model: nn.Module, dataset, device) -> int | None:
    """C from the first sample of a map-style dataset (see ``num_classes_of``)."""
    return num_classes_of(model, lambda: dataset[0], device)


def num_classes_of(model: nn.Module, sample: Callable[[], Any], device) -> int | None:
    """C from one forward of one sample in eval mode; None if the output is not (1, C), or if
    the forward fails: a model whose forward takes more than the inputs (an RNN's hidden
    state) is not a classifier to infer from, and the run reports its own errors later."""
    try:
        return _num_classes(model, sample(), device)
    except Exception:  # noqa: BLE001 - a guess that may fail; never the run's error
        return None


@torch.inference_mode()
def _num_classes(model: nn.Module, sample, device) -> int | None:
    if not isinstance(sample, (tuple, list)) or len(sample) < 2:
        return None
    x, y = sample[0], sample[1]
    if not isinstance(x, torch.Tensor) or (isinstance(y, torch.Tensor) and y.is_floating_point()):
        return None
    was_training = model.training
    model.eval()
    try:
        out = model(x.unsqueeze(0).to(device))
    finally:
        model.train(was_training)
    return out.shape[-1] if isinstance(out, torch.Tensor) and out.ndim == 2 else None


def step_kind(step_fn, configured: str) -> str:
    """'classification', 'lm' or 'user': which step computes the run's metrics (``step_fn``:
    fit()'s, ``configured``: train.step_fn)."""
    if is_lm(step_fn, configured):
        return "lm"
    return "classification" if step_fn is None and not configured else "user"
