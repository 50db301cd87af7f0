"""Callbacks: one flat base class with no-op hooks, fired at named points of the loop.

Where each hook fires is listed beside the loop's order in ``engine/loop.py``'s docstring. Every
hook gets a view of the run (``ironloop.engine.run.RunView``: ``cfg``, ``model``, ``optimizer``,
``scheduler``, ``step``, ``epoch``, ``world``, ``device``, ``precision``, ``run_dir``,
``last_eval``, ``log_scalars`` and ``stop``) and the metrics just computed, as plain Python numbers:

- ``on_train_start``: ``{"step", "epoch"}`` (non-zero after a resume);
- ``on_step_end``: the ``metrics.jsonl`` row on logging steps, else ``{"step", "epoch"}`` (the
  loop reads device values only at log steps, so no host sync is added per step);
- ``on_eval_end``: ``{"step", "epoch", "val_loss", "val_acc", ...}``, the ``evals.jsonl`` row;
- ``on_epoch_end``: the ``epochs.jsonl`` row;
- ``on_checkpoint``: ``{"step", "epoch", "best"}`` after a checkpoint was written (rank 0);
- ``on_train_end``: ``{"step", "epoch", "best"}`` before the final results are written.

A hook may log its own values with ``run.log_scalars({"name": value})``: one
``scalars.jsonl`` line with the step and epoch (and TensorBoard scalars for the numbers).
``run.stop()`` ends the run after the current step (or epoch, from ``on_epoch_end``), as
``train.max_steps`` would; results.json then says ``"stopped_by_callback": true``.
``ironloop train`` builds the callbacks ``train.callbacks`` names (``from_specs``), after the
ones passed to fit().
A callback that defines ``state_dict`` and ``load_state_dict`` is saved in every checkpoint
(under ``"callbacks"``) and restored on resume. Its state must be tensors and plain
containers, as for everything in a checkpoint (``torch.load(weights_only=True)``).
Callbacks run on every rank; check ``run.world.is_main`` for work only one process should do.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch

from ironloop.errors import CheckpointError, ConfigError
from ironloop.specs import import_spec

HOOKS = ("on_train_start", "on_step_end", "on_eval_end", "on_epoch_end", "on_checkpoint",
         "on_train_end")


class Callback:
    """Subclass and override the hooks you need; the others do nothing."""

    def on_train_start(self, run, metrics: dict) -> None:
        """Before the first step; ``metrics``: ``{"step", "epoch"}`` (non-zero after a resume)."""

    def on_step_end(self, run, metrics: dict) -> None:
        """After every optimizer step; ``metrics``: the metrics.jsonl row on logging steps, else
        ``{"step", "epoch"}`` (no host sync is added per step)."""

    def on_eval_end(self, run, metrics: dict) -> None:
        """After every evaluation; ``metrics``: the evals.jsonl row (``val_loss``, ...)."""

    def on_epoch_end(self, run, metrics: dict) -> None:
        """At the end of every epoch; ``metrics``: the epochs.jsonl row."""

    def on_checkpoint(self, run, metrics: dict) -> None:
        """After a checkpoint was written (rank 0); ``metrics``: ``{"step", "epoch", "best"}``."""

    def on_train_end(self, run, metrics: dict) -> None:
        """After the last step, before the results are written; ``metrics``:
        ``{"step", "epoch", "best"}``."""


def fire(run, hook: str, metrics: dict[str, Any]) -> None:
    """Call ``hook`` on every callback of the run, in the order they were given."""
    for cb in run.hooks.callbacks:
        method = getattr(cb, hook, None)
        if method is not None:
            method(run.view, metrics)


def from_specs(specs: list) -> list:
    """The callbacks ``train.callbacks`` names: 'module:Class', or {spec: 'module:Class', and
    keyword arguments}, each built once."""
    built = []
    for spec in specs:
        spec = spec if isinstance(spec, dict) else {"spec": spec}
        kwargs = {k: v for k, v in spec.items() if k != "spec"}
        cls = import_spec(spec["spec"], "train.callbacks")
        try:
            built.append(cls(**kwargs))
        except TypeError as e:
            raise ConfigError(f"train.callbacks: {spec['spec']}({kwargs}) failed: {e}; check "
                              f"its arguments") from e
    return built


def _key(i: int, cb) -> str:
    return f"{i}:{type(cb).__name__}"


def callbacks_state(callbacks: list) -> dict:
    """The state of every stateful callback, keyed by position and class name. A state the
    checkpoint could not load back (``torch.load(weights_only=True)`` refuses a numpy scalar
    or any other object) is refused here, at the save, naming the callback and the value:
    otherwise every checkpoint is written and every one is later rejected as damaged."""
    states = {}
    for i, cb in enumerate(callbacks):
        if hasattr(cb, "state_dict"):
            states[_key(i, cb)] = state = cb.state_dict()
            bad = _unloadable(state, "")
            if bad is not None:
                where, value = bad
                kind = f"{type(value).__module__}.{type(value).__qualname__}"
                raise CheckpointError(
                    f"callback {_key(i, cb)}: its state_dict holds {_show(value)} ({kind}) at "
                    f"{where or 'its top'}, which a checkpoint cannot load back "
                    f"(weights_only); return plain Python values instead (float(x), int(x), "
                    f"x.tolist()) or tensors")
    return states


_PLAIN = (str, int, float, bool, bytes, type(None))


def _unloadable(value: Any, where: str) -> tuple[str, Any] | None:
    """(where, value) of the first part of a state that ``torch.load(weights_only=True)``
    would refuse; None when it loads. Tensors and plain values are never saved here: only an
    unusual leaf is tried on its own, so a large state costs one walk."""
    if type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            bad = _unloadable(key, f"{where}[{key!r}]") or \
                _unloadable(item, f"{where}[{key!r}]")
            if bad is not None:
                return bad
        return None
    if type(value) in (list, tuple):
        for n, item in enumerate(value):
            bad = _unloadable(item, f"{where}[{n}]")
            if bad is not None:
                return bad
        return None
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - pickle and torch raise many kinds for one cause
        return where, value
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_callbacks_state(callbacks: list, state: dict | None) -> None:
    """Give each stateful callback its saved state; a callback new since the checkpoint (no
    saved state) starts fresh."""
    state = state or {}
    for i, cb in enumerate(callbacks):
        saved = state.get(_key(i, cb))
        if saved is not None and hasattr(cb, "load_state_dict"):
            cb.load_state_dict(saved)
