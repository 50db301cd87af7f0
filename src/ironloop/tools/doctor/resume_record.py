"""The resume check's scratch run: one process of ``ironloop doctor --resume-check``.

``python -m ironloop.tools.doctor.resume_record SPEC.json`` builds the config's model and data
as ``ironloop train`` does and runs ``fit()`` with a recorder that writes, per optimizer step,
one JSON line to ``record-rank{R}.jsonl``: a hash of every micro-batch's tensors, every
micro-batch's loss, a hash of each module's training outputs and a hash of the weights after
the step. At the end of the run it adds what the checkpoint does not hold: the plain attributes
of the model's modules, of the training dataset and of each callback, and the plain globals of
the user's modules. The line of a step is flushed when the step ends, so a process killed by
``fault.crash_at_step`` leaves every step before the kill on disk.

The recorder reads device values every step (hashes, losses): that is what this process is for,
and it never changes what the run computes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ironloop.callbacks import Callback
from ironloop.engine.carry import takes_state
from ironloop.engine.several import takes_optimizers

#: Scalar types whose values are compared as they are.
PLAIN = (int, float, bool, str, type(None))
#: Module prefixes whose globals are the library's, not the user's.
LIBRARY = ("torch", "ironloop", "numpy", "builtins", "sklearn", "collections", "typing",
           "functools", "abc")


def digest(obj: Any) -> str:
    """A short hash of the tensors (dtype, shape, bytes) and plain values in ``obj``."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        # host read: the check hashes the values (a CPU copy of the tensor)
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in obj:
            h.update(f"K{k!r}".encode())
            _feed(h, obj[k])
    elif isinstance(obj, (tuple, list)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    elif hasattr(obj, "to_tuple"):  # a Hugging Face ModelOutput
        _feed(h, obj.to_tuple())
    else:
        h.update(repr(obj).encode() if isinstance(obj, PLAIN) else type(obj).__name__.encode())


def plain_attributes(obj: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The attributes of ``obj`` a checkpoint would not hold unless it asks for them: scalars,
    tuples of scalars, and tensors that are not parameters or buffers (hashed)."""
    out: dict[str, Any] = {}
    for name, value in sorted(getattr(obj, "__dict__", {}).items()):
        if name in skip or name.startswith("__"):
            continue
        if isinstance(value, PLAIN):
            out[name] = value
        elif isinstance(value, (tuple, list)) and len(value) <= 64 and \
                all(isinstance(v, PLAIN) for v in value):
            out[name] = list(value)
        elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and \
                value.numel() <= 1_000_000:
            out[name] = f"tensor {digest(value)}"
    return out


def module_attributes(model: nn.Module) -> dict[str, Any]:
    """{"module.attr": value} over every module, without parameters, buffers and ``training``
    (the run sets the mode)."""
    out = {}
    for name, module in model.named_modules():
        owned = set(module._parameters) | set(module._buffers) | {"training"}
        where = f" (module {name})" if name else ""
        for attr, value in plain_attributes(module, frozenset(owned)).items():
            out[f"{type(module).__name__}.{attr}{where}"] = value
    return out


def user_modules(*objects: Any) -> list[types.ModuleType]:
    """The Python modules the user's classes and functions come from (not the library's)."""
    found = {}
    for obj in objects:
        fn = getattr(obj, "__wrapped__", obj)
        name = getattr(fn, "__module__", None) or type(fn).__module__
        if name and name.split(".")[0] not in LIBRARY and name in sys.modules:
            found[name] = sys.modules[name]
    return list(found.values())


def module_globals(modules: list[types.ModuleType]) -> dict[str, Any]:
    """The plain module-level values (counters, flags) of the user's modules."""
    return {f"{m.__name__}.{k}": v for m in modules for k, v in sorted(vars(m).items())
            if isinstance(v, PLAIN) and not k.startswith("__")}


class Recorder(Callback):
    """The step wrapper and callback that write the scratch run's record."""

    def __init__(self, path: Path, model: nn.Module, dataset: Any, callbacks: list,
                 step_fn: Any):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - a line per step, to the end
        self.model, self.dataset, self.callbacks, self.step_fn = model, dataset, callbacks, step_fn
        self.batches: list[str] = []
        self.losses: list[float] = []
        self.outputs: list[list[str]] = []
        for name, module in model.named_modules():
            module.register_forward_hook(self._hook(f"{name or 'the model'} "
                                                    f"({type(module).__name__})"))

    def _hook(self, name: str):
        def hook(module, args, output):
            if module.training:
                self.outputs.append([name, digest(output)])
        return hook

    def wrap(self, step_fn):
        """``step_fn`` as the run calls it, recording each training micro-batch and loss."""

        def record(model, batch, loss) -> None:
            if model.training:  # evaluation calls the step too; it is not a training step
                self.batches.append(digest(batch))
                self.losses.append(float(loss.detach().float()))  # host read: the check's own

        if takes_state(step_fn):
            def stateful(model, batch, state):
                out = step_fn(model, batch, state)
                record(model, batch, out[0])
                return out
            return stateful
        if takes_optimizers(step_fn):  # several optimizers: it updates them itself
            def updating(model, batch, optimizers):
                out = step_fn(model, batch, optimizers)
                record(model, batch, out[0])
                return out
            return updating

        def plain(model, batch):
            out = step_fn(model, batch)
            record(model, batch, out[0])
            return out
        return plain

    def on_step_end(self, run, metrics: dict) -> None:
        line = {"step": metrics["step"], "batches": self.batches, "losses": self.losses,
                "modules": self.outputs, "weights": digest(list(self.model.parameters()))}
        self.file.write(json.dumps(line) + "\n")  # a whole line per write: a kill keeps it
        self.batches, self.losses, self.outputs = [], [], []

    def on_train_end(self, run, metrics: dict) -> None:
        callbacks = {f"{i}:{type(cb).__name__}": {"state_dict": hasattr(cb, "state_dict"),
                                                  "attributes": plain_attributes(cb)}
                     for i, cb in enumerate(self.callbacks)}
        state = {"model": module_attributes(self.model),
                 "data": {f"{type(self.dataset).__name__}.{k}": v
                          for k, v in plain_attributes(self.dataset).items()},
                 "callbacks": callbacks,
                 "globals": module_globals(user_modules(
                     self.step_fn, type(self.model), *(type(m) for m in self.model.modules()),
                     type(self.dataset), *(type(cb) for cb in self.callbacks)))}
        self.file.write(json.dumps({"end": metrics["step"], "state": state}, default=str) + "\n")
        self.file.close()


def run_step(cfg, model: nn.Module, bundle):
    """The step the run would run, resolved as ``fit()`` resolves it (engine/build.py)."""
    from ironloop.engine.optim import Loss
    from ironloop.engine.step_fns import classification_step, named_step
    from ironloop.specs import import_spec

    if cfg.train.step_fn:
        return named_step(cfg.train.step_fn)
    loss_fn = import_spec(cfg.loss.name, "loss.name") if ":" in cfg.loss.name else \
        Loss(cfg.loss, bundle.num_classes)
    return classification_step(loss_fn)


def record_run(spec: dict) -> None:
    """One scratch run as ``spec`` says: its config, record file, callbacks and resume flag."""
    from ironloop.config import Config
    from ironloop.specs import import_spec
    from ironloop.tools.models import from_config
    from ironloop.tools.recipe import fit_without_preflight as fit

    cfg = Config.from_dict(spec["config"])
    model, bundle = from_config(cfg)
    callbacks = [import_spec(s, "callbacks")() for s in spec.get("callbacks", [])]
    step_fn = run_step(cfg, model, bundle)
    path = Path(spec["record"].format(rank=os.environ.get("RANK", "0")))
    recorder = Recorder(path, model, bundle.train, callbacks, step_fn)
    fit(model, bundle.train, bundle.val, cfg, step_fn=recorder.wrap(step_fn),
        num_classes=bundle.num_classes, callbacks=[*callbacks, recorder],
        resume=spec["resume"], from_config=True)


def warm_imports(cfg) -> None:
    """Import, once in the doctor's process, what every scratch run imports before it builds
    anything (torch, the loop, the user's modules named in the config), so that the runs forked
    from it start in a fraction of a second. Importing runs no training code: each forked run
    begins as a fresh process would, with the modules as import left them."""
    import contextlib
    import importlib

    import ironloop.data
    import ironloop.engine.fit
    import ironloop.tools.models  # noqa: F401 - imported for the forked runs

    names = [spec.partition(":")[0] for spec in (cfg.data.name, cfg.model.name,
                                                 cfg.train.step_fn, cfg.loss.name)
             if ":" in spec]
    for name in names:
        # a module that fails to import: the scratch run reports it where it happens
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def forked(spec_path: str, log_path: str, threads: int) -> None:
    """A scratch run in a process forked from the doctor: its output to ``log_path``, then
    ``os._exit`` with the CLI's exit code (``fault.crash_at_step`` exits 1 on its own)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Python's own streams too: the doctor's may be something else than fds 1 and 2 (pytest's)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    torch.set_num_threads(threads)  # the same in every scratch run: the same math
    code = main([spec_path])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> int:
    from ironloop.errors import UserError

    try:
        record_run(json.loads(Path(argv[0]).read_text()))
    except UserError as e:
        print(f"ironloop: error: {e}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - the doctor shows the last line and keeps the log
        import traceback

        traceback.print_exc()
        return 70  # not 1, the kill's exit code: a crash of the user's code is told apart
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the CLI does (cli.entry): no interpreter teardown after a finished run
