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
from ironloop.data.inputs import map_style
from ironloop.data.source import eval_split
from ironloop.data.stream import is_stream
from ironloop.engine import several
from ironloop.engine.metrics import build_metrics
from ironloop.engine.optim import Loss
from ironloop.engine.precision import resolve_device
from ironloop.engine.step_fns import classification_step, infer_num_classes, named_step
from ironloop.engine.train_module import check_model
from ironloop.errors import UserError
from ironloop.specs import import_spec
from ironloop.state.rng import preserved_rng
from ironloop.tools.doctor import data_checks as data, env_checks, model_checks as mc
from ironloop.tools.doctor.findings import Finding
from ironloop.tools.doctor.subject import DoctorSubject, head

#: The overfit check trains on at most this many samples of the first batch.
OVERFIT_BATCH = 16


class DoctorError(UserError):
    """doctor.strict (--strict) and an error finding: stop before training."""


def subject(model: nn.Module, train, val=None, test=None, cfg: Config | None = None,
            num_classes: int | None = None, loss_fn=None, collate_fn=None,
            step_fn=None) -> DoctorSubject:
    """What the checks examine. They run the step the run will run: ``step_fn``, else
    ``train.step_fn``, else the default step with ``loss_fn`` (or ``loss.*``). The class count
    is inferred only for the default step, and a model it cannot be inferred from has none."""
    cfg = cfg or Config()
    check_model(model)  # meta device, nothing to train: the run's refusal, before any check
    if is_stream(train):
        raise UserError("the doctor reads samples by index, and the training data is a stream "
                        "(an IterableDataset); check a map-style sample of it instead")
    device = resolve_device(cfg.run.device)
    # What fit() would train on: a DataLoader (a CLI factory may return one) is taken apart.
    train, loader_collate = map_style(train, "train")[:2]
    collate_fn = collate_fn or loader_collate
    # Validation as evaluation batches it; stream-shaped data that cannot be is refused here.
    val, val_batching = eval_split(val, "val_data", cfg, collate_fn, 1)
    test = map_style(test, "test").dataset
    if step_fn is None and cfg.train.step_fn:
        step_fn = named_step(cfg.train.step_fn)
    user_step = step_fn is not None
    if not user_step and num_classes is None:
        num_classes = infer_num_classes(model, train, device)  # None when it cannot tell
    if loss_fn is None and ":" in cfg.loss.name:
        loss_fn = import_spec(cfg.loss.name, "loss.name")
    loss_fn = loss_fn or Loss(cfg.loss, num_classes)
    return DoctorSubject(model=model, cfg=cfg, train=train, val=val, test=test,
                   num_classes=num_classes, loss_fn=loss_fn, device=device,
                   collate_fn=collate_fn, step_fn=step_fn or classification_step(loss_fn),
                   user_step=user_step, val_batching=val_batching)


def check(s: DoctorSubject, quick: bool = True, raise_step: bool = False) -> list[Finding]:
    """Every check but the LR range test, on copies: the model, the data and the global RNG
    states are as they were afterwards. ``quick`` bounds the samples read from datasets that
    are not in memory. When the run's step itself raises (``probe_step``), the model checks
    are not run: with ``raise_step`` (the preflight) the error is raised, as the run would
    raise it; otherwise it is an error finding."""
    with preserved_rng(), s.borrowed():  # the checks train the model itself, put back after
        return _check(s, quick, raise_step)


def _check(s: DoctorSubject, quick: bool, raise_step: bool = False) -> list[Finding]:
    cfg = s.cfg.doctor
    # A dataset that is not in memory may decode on every read: the quick checks read at most
    # doctor.max_batches batches' worth of samples of it.
    cap = cfg.max_batches * s.cfg.train.batch_size if quick else None
    findings = [*_guard("labels", data.check_labels, s, cap),
                *_guard("finite_inputs", data.check_finite_inputs, s, cap),
                *_guard("leakage", data.check_leakage, s, cap),
                *_guard("threads", env_checks.check_threads, s.cfg)]
    if any(f.severity == "error" and f.check == "labels" for f in findings):
        return findings  # the model checks would only crash on these labels
    if several.takes_optimizers(s.step_fn):
        return [*findings, Finding("model", "skipped", "the step updates several optimizers "
                                   "itself and these checks train with one; doctor "
                                   "--resume-check runs it", "", "")]
    try:
        batch = s.batch()
    except Exception as e:  # noqa: BLE001 - reported, never raised: the run says it properly
        return [*findings, Finding("model", "skipped", f"no training batch to check with: it "
                                   f"raised {type(e).__name__}: {e}", "", "")]
    try:
        probe_step(s, batch)  # what the run would raise at step 1 or at its first evaluation
    except Exception as e:
        if raise_step:
            raise
        return [*findings, Finding("step", "error", f"the run's step raised "
                                   f"{type(e).__name__}: {e}",
                                   "the run would stop with this error at its first step or "
                                   "its first evaluation", "fix the model's forward or pass "
                                   "the step it needs (train.step_fn)")]
    small = head(batch, OVERFIT_BATCH)
    findings += _guard("initial_loss", mc.check_initial_loss, s, batch)
    findings += _guard("probabilities", mc.check_probabilities, s, batch)
    findings += _guard("overfit_batch", mc.check_overfit_batch, s, small, cfg.overfit_steps)
    findings += _guard("dead_parameters", mc.check_dead_parameters, s, batch)
    findings += _guard("input_bound", data.check_input_bound, s, batch, cfg.max_batches,
                       budget=0.05 if quick else 0.3)
    findings += _guard("memory", mc.check_memory, s, batch, search=cfg.memory_search)
    return findings


def probe_step(s: DoctorSubject, batch) -> None:
    """The run's step once on the first training batch (train mode, with a backward) and once
    on the first validation batch as evaluation batches it (eval mode), on a copy. What raises
    here would stop the run at its first step or its first evaluation (after a whole epoch,
    perhaps), so it is raised now, in seconds, and never listed as a skipped check."""
    model, _ = s.copy()
    try:
        s.loss(model, batch)[0].backward()
    except torch.OutOfMemoryError:
        return  # the memory check reports it, with the fixes
    except Exception as e:  # noqa: BLE001 - re-raised, with where it happened
        raise _noted(e, "the first training batch") from None
    try:
        val = s.val_batch()
        if val is not None:
            model.eval()
            with torch.inference_mode():
                s.loss(model, val)
    except Exception as e:  # noqa: BLE001 - re-raised, with where it happened
        raise _noted(e, "the first validation batch") from None


def _noted(e: Exception, where: str) -> Exception:
    # A one-line error says it all; a traceback gains a line (Python 3.11+: add_note).
    if not isinstance(e, UserError) and hasattr(e, "add_note"):
        e.add_note(f"ironloop: raised in the preflight, running the run's step on {where}; "
                   f"the run itself would raise the same")
    return e


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
        return [Finding(name, "skipped", f"it raised {type(e).__name__}: {e}", "", "")]


#: A check's outcome is its worst finding, in this order; "passed" = only info findings.
OUTCOMES = ("error", "warning", "skipped", "passed")
#: The order the summary line counts them in.
SUMMARY = ("error", "warning", "passed", "skipped")


def outcomes(findings: list[Finding]) -> dict[str, str]:
    """{check: error | warning | skipped | passed}, in the order the checks ran."""
    worst: dict[str, str] = {}
    for f in findings:
        outcome = "passed" if f.severity == "info" else f.severity
        if f.check not in worst or OUTCOMES.index(outcome) < OUTCOMES.index(worst[f.check]):
            worst[f.check] = outcome
    return worst


def render(findings: list[Finding], verbose: bool) -> str:
    """Errors, warnings and skipped checks (and info lines when ``verbose``), then one line
    that counts the checks by outcome: "doctor: 4 passed, 2 skipped: memory (why), ..."."""
    shown = [f for f in findings if verbose or f.severity in ("error", "warning")]
    worst = outcomes(findings)
    counts = {o: sum(v == o for v in worst.values()) for o in SUMMARY}
    if counts["passed"] == len(worst):
        summary = f"doctor: {len(worst)} checks passed"
    else:
        summary = "doctor: " + ", ".join(f"{n} {o if o in ('passed', 'skipped') else o + '(s)'}"
                                         for o, n in counts.items() if n)
        skipped = [f for f in findings if f.severity == "skipped"]
        if skipped:
            summary += ": " + "; ".join(f"{f.check} ({f.measured})" for f in skipped)
    return "\n".join([f.render() for f in shown] + [summary])


def write_json(findings: list[Finding], path: Path, seconds: float) -> None:
    from ironloop.state.io import write_atomic
    from ironloop.state.prepare import unwritable

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
              strict: bool | None = None, step_fn=None, loss_fn=None) -> list[Finding]:
    """The quick checks before training (``ironloop train``, or ``fit()`` with
    doctor.preflight=true): printed, written to run.dir/doctor.json.

    Skipped when doctor.preflight is false, on ranks other than 0, and on a --resume whose run
    already ran it (doctor.json exists)."""
    out = Path(cfg.run.dir) / "doctor.json"
    if cfg.doctor.preflight is False or os.environ.get("RANK", "0") != "0" or \
            (resume and out.exists()):
        return []
    if is_stream(bundle.train):
        print("notice: the preflight doctor reads samples by index; skipped for a stream "
              "(an IterableDataset)")
        return []
    print("preflight: the doctor's quick checks of model and data (doctor.preflight=false "
          "skips them)...", flush=True)
    started = time.perf_counter()
    s = subject(model, bundle.train, bundle.first_val, bundle.test, cfg, bundle.num_classes,
                loss_fn=loss_fn, step_fn=step_fn)
    metrics = build_metrics(cfg.eval.metrics, None, s.device)
    if metrics is not None:  # what fit() refuses too: before the checks take their seconds
        metrics.check_classes(s.num_classes)
    # A check that fails is reported skipped; the run's own step raising stops the run here.
    findings = check(s, quick=True, raise_step=True)
    seconds = time.perf_counter() - started
    write_json(findings, out, seconds)
    print(render(findings, verbose=False) + f" ({seconds:.2f} s; details in {out})"
          f"{resume_hint(cfg, len(bundle.train))}", flush=True)
    stop_if_strict(findings, cfg.doctor.strict if strict is None else strict)
    return findings


#: Optimizer steps from which the preflight points to the resume check: a run long enough to
#: be preempted or to crash, and to cost real time if its resume drifts.
LONG_RUN_STEPS = 5000


def resume_hint(cfg: Config, n_train: int) -> str:
    """For a long run, the closing line's pointer to ``ironloop doctor --resume-check``."""
    t = cfg.train
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun, rank 0 runs the preflight
    per_epoch = -(-n_train // (t.batch_size * t.accumulation_steps * ranks))
    steps = per_epoch * t.epochs
    if t.max_steps:
        steps = min(steps, t.max_steps)
    if steps < LONG_RUN_STEPS:
        return ""
    return (f"; a long run ({steps} steps): `ironloop doctor` with these arguments and "
            f"--resume-check proves in seconds that a crash will cost nothing")


def doctor_config(cfg: Config, lr_find: bool = False, strict: bool = False) -> list[Finding]:
    """``ironloop doctor CONFIG``: every check at full size (plus the LR range test), all
    findings printed, written to run.dir/doctor.json."""
    from ironloop.tools.models import from_config

    model, bundle = from_config(cfg)  # the model and data `ironloop train` would build
    started = time.perf_counter()
    s = subject(model, bundle.train, bundle.first_val, bundle.test, cfg, bundle.num_classes)
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
