"""tools.doctor.model_checks one at a time, in process: the initial loss, the probabilities, the
overfit, the dead parameters and the memory check, at both sides of every threshold (a scripted
step puts a check exactly on its boundary)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ironloop.engine.step_fns import lm_step
from ironloop.tools.doctor import model_checks as mc
from ironloop.tools.doctor.findings import Finding, info
from ironloop.tools.doctor.subject import DoctorSubject
from tests.conftest import blobs, tiny_mlp
from tests.tools.doctor.helpers import Scripted, batch_of, make

# -- model checks: expected loss and floor --------------------------------------------------------

def test_the_expected_initial_loss_is_log_classes_log_two_or_log_vocab():
    log = math.log
    assert mc.expected_initial_loss(make(num_classes=5)) == (log(5), "log(5)")
    assert mc.expected_initial_loss(make(num_classes=5, loss__label_smoothing=0.1)) == (
        log(5), "log(5) (label smoothing 0.1 moves only the floor)")
    assert mc.expected_initial_loss(make(num_classes=5, loss__name="bce_logits")) == (
        log(2), "log(2) per output at zero logits")
    assert mc.expected_initial_loss(make(num_classes=5, loss__name="mse")) is None
    assert mc.expected_initial_loss(make(num_classes=None)) is None
    vocab = (log(7), "log(7), a uniform next token over the vocab")
    assert mc.expected_initial_loss(make(step=lm_step, user_step=True), 7) == vocab
    assert mc.expected_initial_loss(make(step=Scripted(1), user_step=True,
                                         eval__perplexity=True), 7) == vocab
    # the vocab needs a language model's step, the user's, and a width
    assert mc.expected_initial_loss(make(step=Scripted(1), user_step=True), 7)[0] == log(3)
    assert mc.expected_initial_loss(make(step=lm_step, user_step=False), 7)[0] == log(3)
    assert mc.expected_initial_loss(make(step=lm_step, user_step=True), None)[0] == log(3)
    assert mc.expected_initial_loss(make(step=lm_step, user_step=True), 0)[0] == log(3)


def test_the_loss_floor_is_the_entropy_of_the_smoothed_targets():
    for eps, c in ((0.1, 4), (0.3, 2)):
        q = torch.full((c,), eps / c, dtype=torch.float64)
        q[0] += 1 - eps
        # the lowest cross-entropy with label smoothing: logits = log(q)
        lowest = F.cross_entropy(q.log()[None], torch.tensor([0]), label_smoothing=eps)
        assert mc.loss_floor(make(num_classes=c, loss__label_smoothing=eps)) == \
            pytest.approx(float(lowest), rel=1e-12)
    assert mc.loss_floor(make(num_classes=4)) == 0.0
    assert mc.loss_floor(make(num_classes=1, loss__label_smoothing=0.1)) == 0.0
    assert mc.loss_floor(make(num_classes=None, loss__label_smoothing=0.1)) == 0.0
    assert mc.loss_floor(make(num_classes=4, loss__label_smoothing=0.1,
                              loss__name="bce_logits")) == 0.0


# -- model checks: initial loss -------------------------------------------------------------------

def initial(loss: float, **kw) -> Finding:
    (f,) = mc.check_initial_loss(make(step=Scripted(loss), num_classes=4, **kw), batch_of())
    return f


def test_the_initial_loss_warns_above_one_and_a_half_times_the_expected_plus_a_tenth():
    value = math.log(4)
    hi = 1.5 * value + 0.1
    f = initial(hi)
    assert f == info("initial_loss", f"initial loss {hi:.4f}, expected about {value:.4f} = "
                                     f"log(4)")
    f = initial(hi + 1e-9)
    assert f.severity == "warning" and "confidently wrong" in f.cause
    assert f.measured == f"initial loss {hi:.4f}, expected about 1.3863 = log(4)"
    assert f.fix == "normalise the inputs and initialise the last layer small (or zero)"


def test_the_initial_loss_warns_below_half_the_expected():
    value = math.log(4)
    assert initial(0.5 * value).severity == "info"
    f = initial(0.5 * value - 1e-9)
    assert f.severity == "warning" and "targets may leak into the inputs" in f.cause
    assert f.measured == "initial loss 0.6931, expected about 1.3863 = log(4)"
    assert "loss.name matches the task" in f.fix


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_initial_loss_is_an_error(bad):
    f = initial(bad)
    assert f.severity == "error" and f.measured == f"the loss at initialisation is {bad}"
    assert "NaN/inf" in f.cause and "division" in f.fix


def test_an_initial_loss_without_a_reference_value_is_reported_as_is():
    f = initial(0.5, loss__name="mse")
    assert f == info("initial_loss", "initial loss 0.5000 (no reference value for loss.name=mse; "
                                     "a language model's step gets log(vocab) with "
                                     "eval.perplexity=true)")


def test_a_language_model_s_vocab_is_the_width_of_the_layer_that_ran_last():
    # 8 -> 16 (Linear, ReLU) -> 6: the last leaf's width is the vocab, not the first's
    s = make(tiny_mlp(c=6), step=Scripted(math.log(6)), user_step=True, num_classes=None,
             eval__perplexity=True)
    (f,) = mc.check_initial_loss(s, batch_of())
    assert f == info("initial_loss", f"initial loss {math.log(6):.4f}, expected about "
                                     f"{math.log(6):.4f} = log(6), a uniform next token over "
                                     f"the vocab")


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 5, batch_first=True)

    def forward(self, x):
        return self.gru(x[:, None])[0][:, 0]


def test_a_last_layer_without_one_tensor_output_gives_no_vocab():
    s = make(TupleOut(), step=Scripted(0.9), user_step=True, num_classes=None,
             eval__perplexity=True)
    (f,) = mc.check_initial_loss(s, batch_of())
    assert "no reference value" in f.measured


def test_the_initial_loss_check_leaves_the_real_model_untouched():
    model = tiny_mlp()
    before = [p.clone() for p in model.parameters()]
    mc.check_initial_loss(make(model), batch_of())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any(m._forward_hooks for m in model.modules())


# -- model checks: probabilities ------------------------------------------------------------------

class Fixed(nn.Module):
    """A leaf model whose outputs are given rows, whatever its inputs."""

    def __init__(self, rows):
        super().__init__()
        self.rows = torch.tensor(rows, dtype=torch.float32)
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.rows[torch.arange(len(x)) % len(self.rows)] + self.w


def probabilities(model, **kw) -> list[Finding]:
    return mc.check_probabilities(make(model, **kw), batch_of())


def test_a_user_step_skips_the_probabilities_check_and_other_losses_have_none():
    (f,) = probabilities(tiny_mlp(), user_step=True)
    assert f.severity == "skipped" and "the run's step_fn" in f.measured
    assert f.cause == "" and f.fix == ""
    assert probabilities(nn.Sequential(tiny_mlp(), nn.Softmax(1)), loss__name="mse") == []


def test_a_final_log_softmax_is_redundant_for_cross_entropy_and_kl_div():
    for name in ("cross_entropy", "kl_div"):
        (f,) = probabilities(nn.Sequential(tiny_mlp(), nn.LogSoftmax(dim=1)), loss__name=name)
        assert f.severity == "warning"
        assert f.measured == "the model's final module '1' is nn.LogSoftmax (LogSoftmax(dim=1))"
        assert f.cause == (f"loss.name={name} applies log_softmax itself; LogSoftmax before it "
                           f"is redundant (harmless here, wrong with any other loss)")
        assert f.fix == "remove the final nn.LogSoftmax from the model"


def test_a_final_squasher_before_a_loss_that_expects_logits_is_an_error():
    (f,) = probabilities(nn.Sequential(tiny_mlp(), nn.LogSoftmax(dim=1)),
                         loss__name="bce_logits")
    assert f.severity == "error" and "applies the sigmoid itself" in f.cause
    (f,) = probabilities(nn.Sequential(tiny_mlp(), nn.Sigmoid()), loss__name="bce_logits")
    assert f.severity == "error" and "nn.Sigmoid" in f.measured
    assert f.cause.startswith("loss.name=bce_logits expects logits and applies the sigmoid "
                              "itself: on probabilities")
    (f,) = probabilities(nn.Sequential(tiny_mlp(), nn.Softmax(dim=1)), loss__name="kl_div")
    assert f.measured == "the model's final module '1' is nn.Softmax (Softmax(dim=1))"
    assert f.cause.startswith("loss.name=kl_div expects logits and applies log_softmax itself")
    assert f.fix == ("remove the final nn.Softmax and feed logits to the loss; apply nn.Softmax "
                     "only at inference")


def test_the_final_module_is_the_one_that_ran_last_named_by_its_path():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Softmax(dim=1)  # registered first, runs last
            self.net = tiny_mlp()

        def forward(self, x):
            return self.out(self.net(x))

    (f,) = probabilities(Wrapped())
    assert "final module 'out' is nn.Softmax" in f.measured
    assert mc._last_leaf(Fixed([[0.0, 1.0]]), torch.zeros(2, 8))[0] == "Fixed"


def test_outputs_that_are_rows_of_probabilities_are_an_error():
    (f,) = probabilities(Fixed([[0.0, 1.0], [0.25, 0.75]]))
    assert f.severity == "error"
    assert f.measured == ("the model's outputs are non-negative and each row sums to 1 (shape "
                          "(4, 2)): they are probabilities, not logits")
    assert f.cause == "a softmax inside forward(); loss.name=cross_entropy applies it again"
    assert probabilities(Fixed([[0.5, 0.5009]]))[0].severity == "error"  # within 1e-3


def test_outputs_that_are_not_probabilities_are_logits():
    for rows in ([[1.5, -0.5]], [[0.5, 0.502]], [[1.0]]):
        (f,) = probabilities(Fixed(rows))
        assert f == info("probabilities", "final module 'Fixed' (Fixed): logits, as "
                                          "loss.name=cross_entropy expects"), rows


def test_a_model_that_runs_no_module_has_only_outputs_to_judge():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(1, 1)
            self.w = nn.Parameter(torch.randn(8, 3))

        def forward(self, x):
            return x @ self.w

    (f,) = probabilities(Bare())
    assert f == info("probabilities", "outputs: logits, as loss.name=cross_entropy expects")


def test_the_probabilities_are_read_in_eval_mode():
    class SoftmaxAtInference(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            out = self.lin(x)
            return out if self.training else out.softmax(1)

    assert probabilities(SoftmaxAtInference())[0].severity == "error"


# -- model checks: overfit one batch --------------------------------------------------------------

def overfit(*losses, steps=5, batch=None, **kw) -> tuple[Finding, Scripted]:
    step = Scripted(*losses)
    (f,) = mc.check_overfit_batch(make(step=step, **kw), batch or batch_of(), steps)
    assert f.check == "overfit_batch"
    return f, step


def test_the_overfit_check_passes_when_the_loss_comes_ten_times_closer_to_its_floor():
    f, step = overfit(1.0, 0.5, 0.1, 0.05)
    assert f == info("overfit_batch", "loss on one batch of 4 fell 1.0000 -> 0.1000 in 2 steps: "
                                      "pass")
    assert step.calls == 3
    f, step = overfit(1.0, 0.5, 0.100001, 0.1)
    assert f.measured.endswith("fell 1.0000 -> 0.1000 in 3 steps: pass") and step.calls == 4


def test_an_overfit_that_falls_too_little_is_a_warning_with_the_numbers():
    f, step = overfit(1.0, 0.9, 0.8, 0.7, steps=3)
    assert step.calls == 3 and f.severity == "warning"
    assert f.measured == ("the loss on one batch of 4 fell only 1.0000 -> 0.8000 in 3 steps "
                          "(target: halfway to 0.000 in 3 steps, or 10x closer)")
    assert f.cause == ("the model cannot fit even one batch: the LR is too low, outputs and "
                       "labels do not match, or part of the network does not learn")
    assert f.fix.startswith("raise optim.lr")


def test_an_overfit_more_than_halfway_to_its_floor_after_all_its_steps_passes():
    # a model that learns, slower than 10x in the steps given (the mnist1d CNN at 1e-3)
    f, step = overfit(1.0, 0.7, 0.5, 0.4, steps=3)
    assert step.calls == 3 and f == info(
        "overfit_batch", "loss on one batch of 4 fell 1.0000 -> 0.5000 in 3 steps, more than "
                         "halfway to its floor 0.000: pass")
    f, _ = overfit(1.0, 0.7, 0.500001, steps=3)  # just short of halfway: still the warning
    assert f.severity == "warning"
    kw = {"num_classes": 4, "loss__label_smoothing": 0.1}
    floor = mc.loss_floor(make(**kw))
    f, _ = overfit(floor + 1, floor + 0.5, steps=2, **kw)  # halfway to the smoothed floor
    assert f.severity == "info" and f"floor {floor:.3f}: pass" in f.measured
    f, _ = overfit(floor + 1, floor + 0.51, steps=2, **kw)
    assert f.severity == "warning"


class _Blind(nn.Module):
    """Outputs that ignore the inputs: the most it can learn of a batch is its label counts."""

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.lin, self.bias = nn.Linear(width, classes), nn.Parameter(torch.zeros(classes))

    def forward(self, x):
        return self.bias.expand(len(x), -1) + 0 * self.lin(x.flatten(1))


def test_the_docs_mnist1d_recipe_passes_the_overfit_check_and_a_blind_model_on_it_does_not():
    """configs/mnist1d.yaml (the README's first command) warned: 2.30 -> 1.08 of a 0.50 floor
    in 30 steps, learning, only slower than 10x. A model blind to its inputs is still caught."""
    from ironloop.config import load_config
    from ironloop.data import build_data
    from ironloop.tools.doctor.run import OVERFIT_BATCH, subject
    from ironloop.tools.doctor.subject import head
    from ironloop.tools.models import model_for
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "mnist1d.yaml")
    data = build_data(cfg.data)
    s = subject(model_for(cfg, data), data.train, cfg=cfg, num_classes=data.num_classes)
    batch = head(s.batch(), OVERFIT_BATCH)
    (f,) = mc.check_overfit_batch(s, batch, cfg.doctor.overfit_steps)
    assert f.severity == "info" and f.measured.endswith(": pass"), f
    blind = subject(_Blind(batch[0][0].numel(), 10), data.train, cfg=cfg, num_classes=10)
    (f,) = mc.check_overfit_batch(blind, batch, cfg.doctor.overfit_steps)
    assert f.severity == "warning" and "fell only" in f.measured, f


def test_the_overfit_target_is_ten_times_closer_to_the_smoothed_floor():
    kw = {"num_classes": 4, "loss__label_smoothing": 0.1}
    floor = mc.loss_floor(make(**kw))
    f, _ = overfit(floor + 1, floor + 0.1 - 1e-6, **kw)
    assert f.severity == "info" and "in 1 steps: pass" in f.measured
    f, _ = overfit(floor + 1, floor + 0.1 + 1e-6, floor + 0.1 - 1e-6, **kw)
    assert f.severity == "info" and "in 2 steps: pass" in f.measured  # not 10x at step 1
    f, _ = overfit(floor + 1, floor + 0.9, steps=2, **kw)
    assert f.severity == "warning" and f"(target: halfway to {floor:.3f}" in f.measured


def test_an_overfit_loss_above_three_times_its_first_plus_one_diverged():
    f, _ = overfit(1.0, 4.0, steps=2)
    assert f.severity == "warning"
    f, step = overfit(1.0, 2.0, 4.000001, optim__lr=0.02)
    assert step.calls == 3 and f.severity == "error"
    assert f.measured == ("training on one batch of 4 diverged: loss 1.0000 -> 4 at step 3 "
                          "(optim.lr=0.02)")
    assert f.fix == "lower optim.lr (try 0.002) or run `ironloop doctor CONFIG --lr-find`"
    f, _ = overfit(1.0, math.nan)
    assert f.severity == "error" and "1.0000 -> nan at step 2" in f.measured


def test_the_overfit_check_trains_a_copy_with_the_run_s_clipping(monkeypatch):
    seen = []
    monkeypatch.setattr(mc, "clip_gradients", lambda params, max_norm, mode: seen.append(
        (len(list(params)), max_norm, mode)))
    model = tiny_mlp()
    before = [p.clone() for p in model.parameters()]
    s = make(model, clip__max_norm=0.5, clip__mode="value")
    x, y = blobs(16).x, blobs(16).y
    (f,) = mc.check_overfit_batch(s, (x, y), 3)
    assert seen == [(4, 0.5, "value")] * 3 and f.severity == "warning"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.undo()
    (f,) = mc.check_overfit_batch(make(tiny_mlp(), optim__lr=0.05), (x, y), 200)
    assert f.severity == "info" and "pass" in f.measured  # the copy does learn


# -- model checks: a language model's overfit -----------------------------------------------------

def tokens_batch(targets):
    y = torch.tensor(targets)
    return torch.zeros(len(y), 8), y


def test_token_targets_are_integer_targets_with_a_position_dimension():
    y = torch.zeros(2, 3, dtype=torch.long)
    assert mc.token_targets((torch.zeros(2), y)) is y
    assert mc.token_targets([torch.zeros(2), y]) is y
    assert mc.token_targets({"input_ids": y, "labels": y}) is y
    assert mc.token_targets({"input_ids": y}) is None
    assert mc.token_targets((y,)) is None
    assert mc.token_targets((torch.zeros(2), y[:, 0])) is None
    assert mc.token_targets((torch.zeros(2), y.float())) is None
    assert mc.token_targets((torch.zeros(2), [[1, 2]])) is None


def test_the_unigram_entropy_leaves_padding_out():
    assert mc.unigram_entropy(torch.tensor([[0, 0, 1, 1], [-100, -100, 1, 0]])) == \
        pytest.approx(math.log(2))
    assert mc.unigram_entropy(torch.tensor([[0, 1, 2, 3]])) == pytest.approx(math.log(4))
    assert mc.unigram_entropy(torch.tensor([[3, 3, 5, 5]])) == pytest.approx(math.log(2))


def test_a_language_model_passes_halfway_to_the_unigram_entropy():
    batch = tokens_batch([[0, 1], [1, 0]])  # entropy log 2
    floor = math.log(2)
    f, step = overfit(floor + 2, floor + 1.5, floor + 1 - 1e-6, batch=batch, steps=4)
    assert step.calls == 3 and f == info(
        "overfit_batch", f"loss on one batch of 2 sequences fell {floor + 2:.4f} -> "
                         f"{floor + 1 - 1e-6:.4f} in 2 steps (the batch's unigram entropy: "
                         f"0.693): pass")
    f, step = overfit(floor + 2, floor + 1.5, floor + 1 + 1e-6, batch=batch, steps=2)
    assert step.calls == 3 and f.severity == "warning"
    assert f.cause == ("the model cannot learn even the token frequencies of one batch: the LR "
                       "is too low, or part of the network does not learn")
    assert f.measured == (f"the loss on one batch of 2 sequences fell only {floor + 2:.4f} -> "
                          f"{floor + 1:.4f} in 2 steps (target: halfway to the batch's unigram "
                          f"entropy, 0.693)")
    f, _ = overfit(0.5, batch=batch)
    assert "in 0 steps" in f.measured and f.severity == "info"  # below the entropy at once


def test_a_language_model_that_diverges_is_an_error_at_its_step():
    batch = tokens_batch([[0, 1], [1, 0]])
    f, _ = overfit(1.0, 4.0, batch=batch, steps=1)
    assert f.severity == "warning"
    f, _ = overfit(1.0, 2.0, 4.5, batch=batch, optim__lr=0.3)
    assert f.severity == "error" and f.measured == (
        "training on one batch of 2 sequences diverged: loss 1.0000 -> 4.5 at step 2")
    assert f.fix == "lower optim.lr (try 0.03)"
    f, _ = overfit(math.inf, batch=batch)
    assert f.severity == "error" and "at step 0" in f.measured


def test_a_language_model_s_overfit_steps_and_clips_between_its_measurements(monkeypatch):
    seen = []
    monkeypatch.setattr(mc, "clip_gradients", lambda params, max_norm, mode: seen.append(
        (max_norm, mode)))
    f, step = overfit(3.0, batch=tokens_batch([[0, 1], [1, 0]]), steps=3, clip__max_norm=2.0)
    assert step.calls == 4 and seen == [(2.0, "norm")] * 3 and f.severity == "warning"


# -- model checks: dead parameters ----------------------------------------------------------------

def test_parameters_without_a_gradient_and_with_a_zero_one_are_named():
    class Dead(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(8, 3)
            self.unused = nn.Linear(8, 3)
            self.zeroed = nn.Linear(8, 3)
            self.frozen = nn.Linear(8, 3)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.used(x) + 0 * self.zeroed(x) + self.frozen(x)

    none, zero = mc.check_dead_parameters(make(Dead()), batch_of())
    assert none.severity == zero.severity == "warning"
    assert none.measured == "2 parameter(s) got no gradient: unused.weight, unused.bias"
    assert zero.measured == ("2 parameter(s) got an exactly zero gradient: zeroed.weight, "
                             "zeroed.bias")
    assert "not used in forward()" in none.cause and "dead ReLUs" in zero.cause
    (f,) = mc.check_dead_parameters(make(tiny_mlp()), batch_of())
    assert f == info("dead_parameters", "all 4 trainable parameters get a gradient")


def test_more_than_five_dead_names_end_with_how_many_more():
    assert mc._names(list("abcde")) == "a, b, c, d, e"
    assert mc._names(list("abcdefg")) == "a, b, c, d, e and 2 more"
    assert mc._names(list("abc"), k=2) == "a, b and 1 more"


def test_the_memory_check_is_for_cuda_only():
    assert mc.check_memory(make(), batch_of()) == []


class FakeCuda:
    """torch.cuda's memory counters for a GPU of ``total`` bytes (this suite runs on CPU)."""

    GiB = 2**30

    def __init__(self, monkeypatch, total, static, peak):
        self.calls: list[str] = []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "get_device_properties",
                            lambda d: SimpleNamespace(total_memory=total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda d: static)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda d: peak)
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(cuda, name, lambda *a, name=name: self.calls.append((name, *a)))


def on_cuda(monkeypatch, step) -> DoctorSubject:
    s = make(step=step)
    s.device = torch.device("cuda")
    model, opt = make().copy()
    monkeypatch.setattr(s, "copy", lambda: (model, opt))
    return s


def test_the_memory_check_reports_the_peak_and_a_linear_estimate_of_the_largest_batch(
        monkeypatch):
    G = FakeCuda.GiB
    fake = FakeCuda(monkeypatch, total=10 * G, static=1 * G, peak=2 * G)
    step = Scripted(1.0)
    (f,) = mc.check_memory(on_cuda(monkeypatch, step), batch_of())
    # 1 GiB for 4 samples: (9 GiB - 1 GiB) / 0.25 GiB = 32
    assert f == info("memory", "one step at batch 4 peaks at 2.00 GiB of 10.0 GiB; largest batch "
                               "about 32 (linear estimate)")
    cuda = torch.device("cuda")
    assert step.calls == 1 and fake.calls == [("synchronize", cuda),
                                              ("reset_peak_memory_stats", cuda),
                                              ("synchronize", cuda)]
    monkeypatch.setattr(mc, "_search_batch", lambda s, model, opt, batch, total: total // G)
    (f,) = mc.check_memory(on_cuda(monkeypatch, Scripted(1.0)), batch_of(), search=True)
    assert f.measured.endswith("(linear estimate); search: batch 10 fits")


def test_a_step_over_ninety_percent_of_the_gpu_is_a_memory_warning(monkeypatch):
    G = FakeCuda.GiB
    FakeCuda(monkeypatch, total=10 * G, static=0, peak=9 * G)
    assert mc.check_memory(on_cuda(monkeypatch, Scripted(1.0)), batch_of())[0].severity == "info"
    FakeCuda(monkeypatch, total=10 * G, static=0, peak=9 * G + 1)
    (f,) = mc.check_memory(on_cuda(monkeypatch, Scripted(1.0)), batch_of())
    assert f.severity == "warning" and f.cause == "the step uses over 90% of the GPU"
    assert f.fix.startswith("lower train.batch_size and raise train.accumulation_steps")
    FakeCuda(monkeypatch, total=10 * G, static=G, peak=G)  # no growth: counted as 1 byte a step
    assert f"largest batch about {8 * G * 4} " in mc.check_memory(
        on_cuda(monkeypatch, Scripted(1.0)), batch_of())[0].measured


def test_the_batch_search_stops_at_a_million_samples(monkeypatch):
    fake = FakeCuda(monkeypatch, total=2**40, static=0, peak=1)
    sizes = []
    monkeypatch.setattr(mc, "_peak_of_step", lambda s, model, opt, big: sizes.append(len(big[0])))
    half = (torch.zeros(2**19, 1), torch.zeros(2**19, dtype=torch.long))
    s = make()
    model, opt = s.copy()
    assert mc._search_batch(s, model, opt, half, 2**40) == 2**20
    assert sizes == [2**20] and fake.calls == [("empty_cache",)]
