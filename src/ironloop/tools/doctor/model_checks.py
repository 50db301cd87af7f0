"""Checks on the model and its loss, each on one real batch and a copy of the model."""

from __future__ import annotations

import math

import torch
from torch import nn

from ironloop.data.loader import batch_size_of
from ironloop.engine.gradients import clip_gradients
from ironloop.engine.step_fns import lm_step
from ironloop.tools.doctor.findings import Finding, info
from ironloop.tools.doctor.subject import DoctorSubject, repeated

#: Final modules that turn logits into probabilities (or log-probabilities).
SQUASHERS = (nn.Softmax, nn.LogSoftmax, nn.Sigmoid, nn.Softmax2d)


def expected_initial_loss(s: DoctorSubject, outputs: int | None = None
                          ) -> tuple[float, str] | None:
    """(value, how) a model with near-uniform outputs should start at, or None if unknown.
    ``outputs``: the width of the model's last layer, read on the batch; for a language model
    (the LM step, or a step whose loss is a per-token NLL: eval.perplexity) it is the vocab."""
    c, name = s.num_classes, s.cfg.loss.name
    if s.user_step and outputs and (s.step_fn is lm_step or s.cfg.eval.perplexity):
        return math.log(outputs), f"log({outputs}), a uniform next token over the vocab"
    if not c:
        return None
    if name == "cross_entropy":
        # A uniform prediction costs log(C) against any target distribution, label smoothing
        # included: -sum_i q_i log(1/C) = log(C) for every q that sums to 1.
        eps = s.cfg.loss.label_smoothing
        how = f"log({c})" + (f" (label smoothing {eps} moves only the floor)" if eps else "")
        return math.log(c), how
    if name == "bce_logits":
        return math.log(2), "log(2) per output at zero logits"
    return None


def loss_floor(s: DoctorSubject) -> float:
    """The lowest loss reachable on a batch: the entropy of the smoothed targets."""
    eps, c = s.cfg.loss.label_smoothing, s.num_classes or 0
    if s.cfg.loss.name != "cross_entropy" or not eps or c < 2:
        return 0.0
    hi, lo = 1 - eps + eps / c, eps / c
    return -(hi * math.log(hi) + (c - 1) * lo * math.log(lo))


def check_initial_loss(s: DoctorSubject, batch) -> list[Finding]:
    """1. The loss at initialisation against the value a near-uniform model gives."""
    model, _ = s.copy()
    widths: list[int] = []  # the last leaf's output width: a language model's vocab
    hooks = [m.register_forward_hook(lambda mod, i, o: widths.append(
        o.shape[-1] if isinstance(o, torch.Tensor) and o.ndim else 0))
        for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            loss = float(s.loss(model, batch)[0])  # host sync: the doctor, not the hot path
    finally:
        for h in hooks:
            h.remove()
    if not math.isfinite(loss):
        return [Finding("initial_loss", "error", f"the loss at initialisation is {loss}",
                        "log(0) or a division by zero in the loss or the model, or NaN/inf "
                        "in the inputs", "check the inputs for NaN/inf and the model's forward "
                        "for log/sqrt/division of values that can be 0")]
    expected = expected_initial_loss(s, widths[-1] if widths else None)
    if expected is None:
        return [info("initial_loss", f"initial loss {loss:.4f} (no reference value for "
                     f"loss.name={s.cfg.loss.name}; a language model's step gets log(vocab) "
                     f"with eval.perplexity=true)")]
    value, how = expected
    measured = f"initial loss {loss:.4f}, expected about {value:.4f} = {how}"
    if loss > 1.5 * value + 0.1:
        return [Finding("initial_loss", "warning", measured,
                        "the model is confidently wrong at initialisation: the last layer's "
                        "weights are too large, or the inputs are not normalised",
                        "normalise the inputs and initialise the last layer small (or zero)")]
    if loss < 0.5 * value:
        return [Finding("initial_loss", "warning", measured,
                        "the untrained model already predicts well: the targets may leak into "
                        "the inputs, or the loss is not the one you think",
                        "check that the inputs do not contain the label and that loss.name "
                        "matches the task")]
    return [info("initial_loss", measured)]


def _last_leaf(model: nn.Module, inputs) -> tuple[str, nn.Module] | None:
    """The leaf module that ran last in a forward pass: the model's real output layer."""
    names = {m: n for n, m in model.named_modules()}
    order: list[nn.Module] = []
    hooks = [m.register_forward_hook(lambda mod, i, o: order.append(mod))
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return (names[order[-1]] or type(order[-1]).__name__, order[-1]) if order else None


def check_probabilities(s: DoctorSubject, batch) -> list[Finding]:
    """2. Probabilities fed to a loss that expects logits: a final Softmax/LogSoftmax/Sigmoid
    module, or outputs that are non-negative and sum to 1."""
    name = s.cfg.loss.name
    if s.user_step:
        return [Finding("probabilities", "skipped", "the run's step_fn turns the model's outputs "
                        "into the loss; this check reads the outputs the default step feeds to "
                        "loss.name", "", "")]
    if name not in ("cross_entropy", "bce_logits", "kl_div"):
        return []
    model, _ = s.copy()
    model.eval()
    last = _last_leaf(model, batch[0])
    if last is not None and isinstance(last[1], SQUASHERS):
        path, mod = last
        kind = f"nn.{type(mod).__name__}"
        measured = f"the model's final module '{path}' is {kind} ({mod})"
        if isinstance(mod, nn.LogSoftmax) and name in ("cross_entropy", "kl_div"):
            return [Finding("probabilities", "warning", measured,
                            f"loss.name={name} applies log_softmax itself; LogSoftmax before "
                            f"it is redundant (harmless here, wrong with any other loss)",
                            f"remove the final {kind} from the model")]
        applies = "log_softmax" if name != "bce_logits" else "the sigmoid"
        return [Finding("probabilities", "error", measured,
                        f"loss.name={name} expects logits and applies {applies} itself: on "
                        f"probabilities the loss stays near its starting value and the "
                        f"gradients vanish",
                        f"remove the final {kind} and feed logits to the loss; apply {kind} "
                        f"only at inference")]
    with torch.no_grad():
        out = model(batch[0]).float()
    if out.ndim == 2 and out.shape[1] > 1 and bool((out >= 0).all()) and \
            bool(torch.allclose(out.sum(1), torch.ones(len(out)), atol=1e-3)):  # host syncs
        return [Finding("probabilities", "error",
                        f"the model's outputs are non-negative and each row sums to 1 "
                        f"(shape {tuple(out.shape)}): they are probabilities, not logits",
                        f"a softmax inside forward(); loss.name={name} applies it again",
                        "return the logits from forward() (drop the softmax); apply it only "
                        "at inference")]
    final = f"final module '{last[0]}' ({type(last[1]).__name__})" if last else "outputs"
    return [info("probabilities", f"{final}: logits, as loss.name={name} expects")]


def check_overfit_batch(s: DoctorSubject, batch, steps: int) -> list[Finding]:
    """3. Overfit one batch: on a copy of the model and optimizer (the real run is untouched),
    the loss on one fixed batch passes once it comes 10x closer to its floor, or once it is
    more than halfway there after ``steps`` optimizer steps. A model that learns at
    ``optim.lr`` gets halfway even where 10x needs more steps (the mnist1d CNN at AdamW's
    1e-3: 2.30 -> 1.08 of a 0.50 floor in 30 steps; 10x closer took 39); a model that cannot
    fit one batch (outputs blind to the inputs, a frozen network, labels it cannot reach)
    stays near its first loss."""
    tokens = token_targets(batch)
    if tokens is not None:
        return _overfit_tokens(s, batch, steps, tokens)
    model, opt = s.copy()
    floor = loss_floor(s)
    first = last = None
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = s.loss(model, batch)[0]
        value = float(loss.detach())  # host sync: the doctor, not the hot path
        first = value if first is None else first
        last = value
        if not math.isfinite(value) or value > 3 * first + 1:
            return [Finding("overfit_batch", "error",
                            f"training on one batch of {batch_size_of(batch)} diverged: loss "
                            f"{first:.4f} -> {value:.4g} at step {step} (optim.lr="
                            f"{s.cfg.optim.lr:g})",
                            "the learning rate is too high for this model (wide layers need "
                            "smaller LRs), or the loss is numerically unstable",
                            f"lower optim.lr (try {s.cfg.optim.lr / 10:g}) or run "
                            f"`ironloop doctor CONFIG --lr-find`")]
        if value - floor <= 0.1 * (first - floor):
            return [info("overfit_batch", f"loss on one batch of {batch_size_of(batch)} fell "
                         f"{first:.4f} -> {value:.4f} in {step - 1} steps: pass")]
        loss.backward()
        clip_gradients(model.parameters(), s.cfg.clip.max_norm, s.cfg.clip.mode)
        opt.step()
    assert first is not None and last is not None  # steps >= 1 (doctor.overfit_steps)
    if last - floor <= 0.5 * (first - floor):
        return [info("overfit_batch", f"loss on one batch of {batch_size_of(batch)} fell "
                     f"{first:.4f} -> {last:.4f} in {steps} steps, more than halfway to its "
                     f"floor {floor:.3f}: pass")]
    return [Finding("overfit_batch", "warning",
                    f"the loss on one batch of {batch_size_of(batch)} fell only {first:.4f} -> "
                    f"{last:.4f} in {steps} steps (target: halfway to {floor:.3f} in "
                    f"{steps} steps, or 10x closer)",
                    "the model cannot fit even one batch: the LR is too low, outputs and "
                    "labels do not match, or part of the network does not learn",
                    "raise optim.lr, check the output layer against the labels, and look at "
                    "the dead_parameters and probabilities findings")]


def token_targets(batch) -> torch.Tensor | None:
    """A language model's batch: its target token ids (a target per position, so 2-D or
    more), from (inputs, targets) or a dict's ``labels``; None for any other batch."""
    y = batch.get("labels") if isinstance(batch, dict) else \
        batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.ndim < 2:
        return None
    return y


def unigram_entropy(tokens: torch.Tensor) -> float:
    """The entropy (nats) of the tokens' frequencies, padding (< 0) left out: the loss of a
    model that learnt only which tokens are common in this batch."""
    t = tokens[tokens >= 0].flatten().cpu()  # host copy: the doctor, not the hot path
    p = torch.bincount(t).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def _overfit_tokens(s: DoctorSubject, batch, steps: int, tokens: torch.Tensor) -> list[Finding]:
    """The overfit check for a language model: a real LM does not come 10x closer to 0 in a
    few dozen steps, but one that learns at all gets at least halfway from its first loss
    down to the batch's unigram entropy (what predicting common tokens alone is worth)."""
    model, opt = s.copy()
    floor = unigram_entropy(tokens)
    first = last = float("nan")
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = s.loss(model, batch)[0]
        last = float(loss.detach())  # host sync: the doctor, not the hot path
        first = last if step == 0 else first
        if not math.isfinite(last) or last > 3 * first + 1:
            return [Finding("overfit_batch", "error",
                            f"training on one batch of {batch_size_of(batch)} sequences "
                            f"diverged: loss {first:.4f} -> {last:.4g} at step {step}",
                            "the learning rate is too high for this model",
                            f"lower optim.lr (try {s.cfg.optim.lr / 10:g})")]
        if last <= floor or last - floor <= 0.5 * (first - floor):
            return [info("overfit_batch", f"loss on one batch of {batch_size_of(batch)} "
                         f"sequences fell {first:.4f} -> {last:.4f} in {step} steps (the "
                         f"batch's unigram entropy: {floor:.3f}): pass")]
        if step < steps:
            loss.backward()
            clip_gradients(model.parameters(), s.cfg.clip.max_norm, s.cfg.clip.mode)
            opt.step()
    return [Finding("overfit_batch", "warning",
                    f"the loss on one batch of {batch_size_of(batch)} sequences fell only "
                    f"{first:.4f} -> {last:.4f} in {steps} steps (target: halfway to the "
                    f"batch's unigram entropy, {floor:.3f})",
                    "the model cannot learn even the token frequencies of one batch: the LR "
                    "is too low, or part of the network does not learn",
                    "raise optim.lr, and look at the dead_parameters finding")]


def check_dead_parameters(s: DoctorSubject, batch) -> list[Finding]:
    """4. Parameters that get no gradient, or an exactly zero one, from a backward pass."""
    model, _ = s.copy()
    s.loss(model, batch)[0].backward()
    none, zero = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            none.append(name)
        elif not bool(p.grad.any()):  # host sync: the doctor, not the hot path
            zero.append(name)
    out = []
    if none:
        out.append(Finding("dead_parameters", "warning",
                           f"{len(none)} parameter(s) got no gradient: {_names(none)}",
                           "they are not used in forward() (a layer built but never called), "
                           "or the graph is cut by .detach()/.item()/no_grad",
                           "call the layer in forward() or delete it; frozen weights should "
                           "set requires_grad=False"))
    if zero:
        out.append(Finding("dead_parameters", "warning",
                           f"{len(zero)} parameter(s) got an exactly zero gradient: "
                           f"{_names(zero)}",
                           "dead ReLUs (all pre-activations negative), an output multiplied "
                           "by 0, or a layer whose output does not reach the loss",
                           "check the initialisation and the forward() path of these layers"))
    if not out:
        n = sum(1 for p in model.parameters() if p.requires_grad)
        out.append(info("dead_parameters", f"all {n} trainable parameters get a gradient"))
    return out


def _names(names: list[str], k: int = 5) -> str:
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def check_memory(s: DoctorSubject, batch, search: bool = False) -> list[Finding]:
    """8. CUDA: peak memory of one training step at the configured batch, and the largest batch
    that fits (a linear estimate, or a doubling search with ``search``)."""
    if s.device.type != "cuda":
        return []
    total = torch.cuda.get_device_properties(s.device).total_memory
    model, opt = s.copy()
    torch.cuda.synchronize(s.device)
    static = torch.cuda.memory_allocated(s.device)
    peak = _peak_of_step(s, model, opt, batch)
    bs = batch_size_of(batch)
    per_sample = max(peak - static, 1) / bs
    estimate = int((0.9 * total - static) / per_sample)
    measured = (f"one step at batch {bs} peaks at {peak / 2**30:.2f} GiB of "
                f"{total / 2**30:.1f} GiB; largest batch about {estimate} (linear estimate)")
    if search:
        fits = _search_batch(s, model, opt, batch, total)
        measured += f"; search: batch {fits} fits"
    if peak > 0.9 * total:
        return [Finding("memory", "warning", measured, "the step uses over 90% of the GPU",
                        "lower train.batch_size and raise train.accumulation_steps, or use "
                        "train.precision=bf16")]
    return [info("memory", measured)]


def _peak_of_step(s: DoctorSubject, model, opt, batch) -> int:
    torch.cuda.reset_peak_memory_stats(s.device)
    opt.zero_grad(set_to_none=True)
    s.loss(model, batch)[0].backward()
    opt.step()
    torch.cuda.synchronize(s.device)
    return torch.cuda.max_memory_allocated(s.device)


def _search_batch(s: DoctorSubject, model, opt, batch, total: int) -> int:
    """Double the batch (by repeating samples) until a step runs out of memory."""
    fits = batch_size_of(batch)
    size = fits * 2
    while size <= 2**20:
        big = repeated(batch, size)
        try:
            _peak_of_step(s, model, opt, big)
        except torch.OutOfMemoryError:
            break
        finally:
            del big
            torch.cuda.empty_cache()
        fits, size = size, size * 2
    return fits
