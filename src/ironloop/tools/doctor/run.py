"""Run the checks: ``check`` (any model and data), ``preflight`` (before ``ironloop train``) and
``doctor_config`` (``ironloop doctor``). Findings are printed and written to doctor.json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from ironloop.config import Config
from ironloop.engine.build import infer_num_classes
from ironloop.state.rng import preserved_rng
from ironloop.tools.doctor import data_checks as data
from ironloop.tools.doctor import model_checks as mc
from ironloop.tools.doctor.findings import Finding, info
from ironloop.tools.doctor.subject import Subject
from ironloop.errors import UserError
from ironloop.engine.optim import Loss
from ironloop.engine.precision import resolve_device

#: The overfit check trains on at most this many samples of the first batch.
OVERFIT_BATCH = 16


class DoctorError(UserError):
    """doctor.strict (--strict) and an error finding: stop before training."""


def subject(model: nn.Module, train, val=None, test=None, cfg: Config | None = None,
            num_classes: int | None = None, loss_fn=None, collate_fn=None) -> Subject:
    cfg = cfg or Config()
    device = resolve_device(cfg.run.device)
    if num_classes is None:
        num_classes = infer_num_classes(model, train, device)
    loss_fn = loss_fn or Loss(cfg.loss, num_classes)
    return Subject(model=model, cfg=cfg, train=train, val=val, test=test,
                   num_classes=num_classes, loss_fn=loss_fn, device=device,
                   collate_fn=collate_fn)


def check(s: Subject, quick: bool = True) -> list[Finding]:
    """Every check but the LR range test, on copies: the model, the data and the global RNG
    states are as they were afterwards. ``quick`` bounds the samples read from datasets that
    are not in memory."""
    with preserved_rng():
        return _check(s, quick)


def _check(s: Subject, quick: bool) -> list[Finding]:
    cfg = s.cfg.doctor
    # A dataset that is not in memory may decode on every read: the quick checks read at most
    # doctor.max_batches batches' worth of samples of it.
    cap = cfg.max_batches * s.cfg.train.batch_size if quick else None
    findings = [*_guard("labels", data.check_labels, s, cap),
                *_guard("leakage", data.check_leakage, s, cap)]
    if any(f.severity == "error" and f.check == "labels" for f in findings):
        return findings  # the model checks would only crash on these labels
    batch = s.batch()
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        return findings + [info("model", f"model checks skipped: they need (inputs, targets) "
                                f"batches, this data gives {type(batch).__name__}")]
    small = [t[:OVERFIT_BATCH] for t in batch[:2]]
    findings += _guard("initial_loss", mc.check_initial_loss, s, batch)
    findings += _guard("probabilities", mc.check_probabilities, s, batch)
    findings += _guard("overfit_batch", mc.check_overfit_batch, s, small, cfg.overfit_steps)
    findings += _guard("dead_parameters", mc.check_dead_parameters, s, batch)
    findings += _guard("input_bound", data.check_input_bound, s, batch, cfg.max_batches,
                       budget=0.05 if quick else 0.3)
    findings += _guard("memory", mc.check_memory, s, batch, search=cfg.memory_search)
    return findings


def _guard(name: str, fn, *args, **kwargs) -> list[Finding]:
    """A check that raises becomes a finding: the doctor never stops a run by crashing (the run
    itself then raises the real error where it happens)."""
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError as e:
        return [Finding(name, "error", f"out of device memory during the {name} check "
                        f"({str(e).splitlines()[0] if str(e) else 'OOM'})",
                        "one training step at this batch size does not fit",
                        "lower train.batch_size and raise train.accumulation_steps, or use "
                        "train.precision=bf16")]
    except Exception as e:  # noqa: BLE001 - reported, never raised
        return [info(name, f"check skipped: it raised {type(e).__name__}: {e}")]


def render(findings: list[Finding], verbose: bool) -> str:
    """Errors and warnings (and info lines when ``verbose``), then a one-line count."""
    shown = [f for f in findings if verbose or f.severity != "info"]
    counts = {sev: sum(f.severity == sev for f in findings) for sev in ("error", "warning")}
    checks = len({f.check for f in findings})
    summary = (f"doctor: {checks} checks, {counts['error']} error(s), "
               f"{counts['warning']} warning(s)") if any(counts.values()) else \
        f"doctor: {checks} checks passed"
    return "\n".join([f.render() for f in shown] + [summary])


def write_json(findings: list[Finding], path: Path, seconds: float) -> None:
    from ironloop.state.io import write_atomic
    from ironloop.state.rundir import unwritable

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"seconds": round(seconds, 3),
                                       "findings": [f.to_dict() for f in findings]},
                                      indent=2) + "\n")
    except OSError as e:
        raise unwritable(path.parent, e) from e


def stop_if_strict(findings: list[Finding], strict: bool) -> None:
    errors = [f for f in findings if f.severity == "error"]
    if strict and errors:
        raise DoctorError(f"doctor found {len(errors)} error(s) and --strict is set; first: "
                          f"[{errors[0].check}] {errors[0].measured}; fix: {errors[0].fix}")


def preflight(cfg: Config, model: nn.Module, bundle, resume=False,
              strict: bool | None = None) -> list[Finding]:
    """The quick checks before ``ironloop train``: printed, written to run.dir/doctor.json.

    Skipped when doctor.preflight is off, on ranks other than 0, and on a --resume whose run
    already ran it (doctor.json exists)."""
    out = Path(cfg.run.dir) / "doctor.json"
    if not cfg.doctor.preflight or os.environ.get("RANK", "0") != "0" or \
            (resume and out.exists()):
        return []
    print("preflight: the doctor's quick checks of model and data (doctor.preflight=false "
          "skips them)...", flush=True)
    started = time.perf_counter()
    s = subject(model, bundle.train, bundle.val, bundle.test, cfg, bundle.num_classes)
    findings = check(s, quick=True)
    seconds = time.perf_counter() - started
    write_json(findings, out, seconds)
    print(render(findings, verbose=False) + f" ({seconds:.2f} s; details in {out})",
          flush=True)
    stop_if_strict(findings, cfg.doctor.strict if strict is None else strict)
    return findings


def doctor_config(cfg: Config, lr_find: bool = False, strict: bool = False) -> list[Finding]:
    """``ironloop doctor CONFIG``: every check at full size (plus the LR range test), all
    findings printed, written to run.dir/doctor.json."""
    from ironloop.data import build_data
    from ironloop.engine.fit import seed_everything
    from ironloop.tools.models import build_model

    bundle = build_data(cfg.data)
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model.name, bundle.input_shape, bundle.num_classes, cfg.model.kwargs)
    started = time.perf_counter()
    s = subject(model, bundle.train, bundle.val, bundle.test, cfg, bundle.num_classes)
    findings = check(s, quick=False)
    run_dir = Path(cfg.run.dir)
    if lr_find:
        from ironloop.tools.doctor.lr_find import check_lr_find

        with preserved_rng():
            findings += check_lr_find(s, run_dir / "lr_find.png")
    seconds = time.perf_counter() - started
    write_json(findings, run_dir / "doctor.json", seconds)
    print(render(findings, verbose=True) + f" ({seconds:.2f} s; written to "
          f"{run_dir / 'doctor.json'})")
    stop_if_strict(findings, strict or cfg.doctor.strict)
    return findings
