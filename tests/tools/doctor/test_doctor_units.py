"""The doctor's checks one at a time, in process, on tiny models and data built here: each
finding's severity, numbers and message at both sides of every threshold. A scripted step (its
loss a given sequence of values) puts a check exactly on its boundary;
tests/tools/doctor/test_doctor.py runs the checks together on real models."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ironloop.config import Config
from ironloop.data.loader import TensorData
from ironloop.engine.step_fns import classification_step, lm_step
from ironloop.errors import UserError
from ironloop.tools.doctor import (
    data_checks,
    env_checks,
    logs,
    lr_find,
    model_checks as mc,
    run as drun,
)
from ironloop.tools.doctor.findings import Finding, info
from ironloop.tools.doctor.subject import DoctorSubject, head, labels_of, repeated
from tests.conftest import blobs, tiny_mlp


def config(**over) -> Config:
    base = {"train.batch_size": 4, "optim.lr": 1e-2, "run.dir": "unused", "run.device": "cpu",
            "data.shuffle": False}
    return Config().with_overrides({**base, **{k.replace("__", "."): v for k, v in over.items()}})


class Scripted:
    """A step whose loss is the next value of a script (the last one again past its end): a
    check's thresholds can be met exactly. It runs the model, so hooks see its outputs, and
    its loss reaches the parameters, so backward and the optimizer step run."""

    def __init__(self, *values: float):
        self.values, self.calls = list(values), 0

    def __call__(self, model, batch):
        v = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        out = model(batch[0])
        return out.float().sum() * 0 + torch.tensor(v, dtype=torch.float64), {}


def make(model=None, train=None, step=None, num_classes=3, user_step=False, val=None,
         **over) -> DoctorSubject:
    cfg = config(**over)
    return DoctorSubject(model=model if model is not None else tiny_mlp(),
                         cfg=cfg, train=train if train is not None else blobs(32),
                         val=val, num_classes=num_classes, device=torch.device("cpu"),
                         step_fn=step or classification_step(nn.CrossEntropyLoss()),
                         user_step=user_step)


def batch_of(n=4, d=8, c=3):
    data = blobs(n, d, c)
    return data.x, data.y


# -- findings -------------------------------------------------------------------------------------

def test_a_finding_renders_its_cause_and_fix_lines_only_when_it_has_them():
    f = Finding("probabilities", "error", "measured 1", "the cause", "the fix")
    assert f.render() == ("error: [probabilities] measured 1\n    cause: the cause\n"
                          "    fix:   the fix")
    assert Finding("x", "warning", "m", "", "f").render() == "warning: [x] m\n    fix:   f"
    assert Finding("x", "warning", "m", "c", "").render() == "warning: [x] m\n    cause: c"
    assert info("x", "m") == Finding("x", "info", "m", "", "")
    assert info("x", "m").render() == "info: [x] m"
    assert f.to_dict() == {"check": "probabilities", "severity": "error", "measured": "measured 1",
                           "cause": "the cause", "fix": "the fix"}


def test_a_finding_refuses_an_unknown_severity():
    for sev in ("error", "warning", "info", "skipped"):
        Finding("x", sev, "", "", "")
    with pytest.raises(ValueError, match="severity must be one of .*'fatal'"):
        Finding("x", "fatal", "", "", "")


# -- subject --------------------------------------------------------------------------------------

def test_the_subject_reads_the_run_s_first_batch_at_its_batch_size_or_the_one_asked():
    data = blobs(10)
    s = make(train=data)
    x, y = s.batch()
    assert torch.equal(x, data.x[:4]) and torch.equal(y, data.y[:4])  # data.shuffle=false
    assert len(s.batch(3)[0]) == 3
    shuffled = make(train=data, data__shuffle=True, run__seed=5)
    order = [i for b in shuffled.loader() for i in b[1].tolist()]
    xs = torch.cat([b[0] for b in shuffled.loader()])
    assert sorted(order) == sorted(data.y.tolist()) and not torch.equal(xs, data.x)
    assert torch.equal(xs, torch.cat([b[0] for b in shuffled.loader()]))  # the run's own order


def test_the_subject_s_copy_is_a_fresh_model_in_train_mode_with_the_configured_optimizer():
    model = tiny_mlp().eval()
    s = make(model, optim__lr=0.25)
    copy, opt = s.copy()
    assert copy is not model and copy.training and not model.training
    assert opt.param_groups[0]["lr"] == 0.25
    assert {id(p) for g in opt.param_groups for p in g["params"]} == \
        {id(p) for p in copy.parameters()}
    with torch.no_grad():
        next(copy.parameters()).add_(1)
    assert not torch.equal(next(copy.parameters()), next(model.parameters()))


def test_the_subject_s_loss_runs_the_step_with_a_fresh_state_when_the_step_takes_one():
    states = []

    def stateful(model, batch, state):
        states.append(state)
        return model(batch[0]).sum(), {"m": torch.tensor(1.0)}

    s = make(step=stateful)
    loss, metrics = s.loss(s.model, batch_of())
    s.loss(s.model, batch_of())
    assert loss.ndim == 0 and list(metrics) == ["m"]
    assert len(states) == 2 and states[0] is not states[1]
    plain = make(step=lambda model, batch: (torch.tensor(2.5), {}))
    assert float(plain.loss(plain.model, batch_of())[0]) == 2.5


def test_the_val_batch_is_none_without_validation_and_the_first_batch_with_it():
    from ironloop.data.source import eval_split

    assert make().val_batch() is None
    cfg = config()
    val, batching = eval_split(blobs(6, seed=1), "val_data", cfg, None, 1)
    s = make(val=val)
    assert s.val_batch() is None  # no batching: evaluation was not set up
    s.val_batching = batching
    x, y = s.val_batch()
    first = blobs(6, seed=1)
    assert torch.equal(y, first.y[:len(y)]) and torch.equal(x, first.x[:len(y)]) and len(y) > 0
    s.val = TensorData(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert s.val_batch() is None


def test_classification_needs_classes_and_a_classification_loss():
    assert make(num_classes=3).classification
    assert not make(num_classes=None).classification
    assert not make(num_classes=0).classification
    for name in ("bce_logits", "kl_div"):
        assert make(loss__name=name).classification
    assert not make(loss__name="mse").classification


def test_labels_of_reads_integer_labels_in_memory_or_sample_by_sample():
    y = torch.tensor([2, 0, 1, 1])
    assert labels_of(None) is None
    assert torch.equal(labels_of(TensorData(torch.zeros(4, 2), y)), y)
    as_ints = [(torch.zeros(2), int(v)) for v in y]
    assert torch.equal(labels_of(as_ints), y)
    assert torch.equal(labels_of(as_ints, cap=2), y[:2])
    assert torch.equal(labels_of(as_ints, cap=10), y)
    as_tensors = [(torch.zeros(2), v) for v in y]
    assert torch.equal(labels_of(as_tensors, cap=3), y[:3])
    empty = labels_of([])
    assert empty is not None and empty.dtype == torch.long and len(empty) == 0
    assert labels_of(TensorData(torch.zeros(2, 2), torch.tensor([0.5, 1.0]))) is None
    assert labels_of(TensorData(torch.zeros(2, 2), torch.zeros(2, 3, dtype=torch.long))) is None


def test_head_and_repeated_slice_and_grow_every_tensor_of_a_nested_batch():
    x = torch.arange(6).reshape(3, 2)
    batch = {"a": x, "b": (x[:, 0], [x[:, 1]]), "n": 7}
    h = head(batch, 2)
    assert torch.equal(h["a"], x[:2]) and torch.equal(h["b"][0], x[:2, 0])
    assert isinstance(h["b"], tuple) and isinstance(h["b"][1], list)
    assert torch.equal(h["b"][1][0], x[:2, 1]) and h["n"] == 7
    r = repeated(batch, 7)
    assert torch.equal(r["a"], x[[0, 1, 2, 0, 1, 2, 0]])
    assert torch.equal(r["b"][0], x[[0, 1, 2, 0, 1, 2, 0], 0]) and r["n"] == 7
    assert isinstance(r["b"], tuple) and isinstance(r["b"][1], list)
    assert torch.equal(repeated(torch.tensor([1, 2]), 3), torch.tensor([1, 2, 1]))
    assert torch.equal(repeated(torch.tensor([1, 2]), 2), torch.tensor([1, 2]))


# -- env: threads ---------------------------------------------------------------------------------

def test_cores_is_the_affinity_mask_else_the_cpu_count_else_one(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert env_checks.cores() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert env_checks.cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert env_checks.cores() == 1


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(env_checks, "cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")


def test_threads_equal_to_the_cores_pass_and_one_more_is_oversubscribed(four_cores):
    (f,) = env_checks.check_threads()
    assert f == info("threads", "4 torch thread(s) (torch's default) x 1 process(es) on 4 "
                                "core(s)")
    (f,) = env_checks.check_threads(config(run__threads=5))
    assert f.severity == "warning"
    assert f.measured == "5 torch thread(s) (run.threads) x 1 process(es) on 4 core(s): " \
                         "oversubscribed"
    assert f.fix == "set run.threads=4 (or OMP_NUM_THREADS=4) so that threads x processes " \
                    "<= cores"
    assert "preempt each other" in f.cause


def test_the_threads_fix_divides_the_cores_among_the_processes(four_cores, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert env_checks.check_threads(config(run__threads=2))[0].severity == "info"
    (f,) = env_checks.check_threads(config(run__threads=3))
    assert "x 2 process(es)" in f.measured and "run.threads=2 (or OMP_NUM_THREADS=2)" in f.fix
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    (f,) = env_checks.check_threads(config(run__threads=1))
    assert "run.threads=1 (or OMP_NUM_THREADS=1)" in f.fix  # never 0


def test_threads_that_leave_the_workers_no_cores_are_reported_on_cpu(four_cores):
    # 4 cores, 1 worker: 3 threads leave it its core, 4 do not
    assert env_checks.check_threads(config(run__threads=3, data__num_workers=1))[0] == \
        info("threads", "3 torch thread(s) (run.threads) x 1 process(es) on 4 core(s)")
    (f,) = env_checks.check_threads(config(run__threads=4, data__num_workers=1))
    assert f.severity == "info" and f.measured == (
        "4 torch thread(s) (run.threads) x 1 process(es) on 4 core(s) and 1 DataLoader "
        "worker(s) per process")
    assert f.cause == "torch's threads spin-wait between ops on the cores the workers need"
    assert f.fix == "if the loader is the bottleneck, set run.threads=3 (ironloop tune " \
                    "measures it)"
    (f,) = env_checks.check_threads(config(run__threads=2, data__num_workers=4))
    assert "set run.threads=1 " in f.fix  # no core left: still one thread
    assert env_checks.check_threads(config(run__threads=4, data__num_workers=0))[0].fix == ""


def test_the_workers_advice_is_for_cpu_runs_only(four_cores, monkeypatch):
    monkeypatch.setattr(env_checks, "resolve_device", lambda name: torch.device(name))
    cfg = config(run__threads=4, data__num_workers=1, run__device="cuda")
    assert env_checks.check_threads(cfg)[0].fix == ""
    assert env_checks._cpu(config()) and not env_checks._cpu(None)


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
                          "(target: 10x closer to 0.000)")
    assert f.cause == ("the model cannot fit even one batch: the LR is too low, outputs and "
                       "labels do not match, or part of the network does not learn")
    assert f.fix.startswith("raise optim.lr")


def test_the_overfit_target_is_ten_times_closer_to_the_smoothed_floor():
    kw = {"num_classes": 4, "loss__label_smoothing": 0.1}
    floor = mc.loss_floor(make(**kw))
    f, _ = overfit(floor + 1, floor + 0.1 - 1e-6, **kw)
    assert f.severity == "info" and "in 1 steps: pass" in f.measured
    f, _ = overfit(floor + 1, floor + 0.1 + 1e-6, steps=2, **kw)
    assert f.severity == "warning" and f"(target: 10x closer to {floor:.3f})" in f.measured


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


# -- data checks: labels --------------------------------------------------------------------------

def labelled(labels, val=None, c=3, **kw) -> DoctorSubject:
    y = torch.tensor(labels)
    v = None if val is None else TensorData(torch.zeros(len(val), 2), torch.tensor(val))
    return make(train=TensorData(torch.zeros(len(y), 8), y), val=v, num_classes=c, **kw)


def test_labels_outside_the_classes_are_an_error_named_by_sample():
    out, balance = data_checks.check_labels(labelled([0, 1, 2, 3, -1, 0, 1, 2]))
    assert out.severity == "error"
    assert out.measured == "train: 2 label(s) outside [0, 3) (range -1..3; e.g. samples [3, 4])"
    assert out.cause == ("the targets are not class indices 0..2: 1-based labels, or more "
                         "classes than the model's 3 outputs")
    assert out.fix == "map the labels to 0..2 or give the model as many outputs as there are " \
                      "classes"
    # the balance is of the labels in range
    assert balance == info("labels", "train class balance: 6 samples, smallest class 33.3%, "
                                     "largest 33.3%")
    (first,) = data_checks.check_labels(labelled(list(range(-6, 0))))
    assert first.measured.endswith("e.g. samples [0, 1, 2, 3, 4])")


def test_labels_all_outside_the_classes_are_the_error_not_a_crash_of_the_check():
    # labels 3 and 4 for a 2-output model: nothing left to count the balance of
    s = labelled([3, 4, 3], c=2)
    (f,) = data_checks.check_labels(s)
    assert f.severity == "error" and f.measured.startswith("train: 3 label(s) outside [0, 2)")
    found = drun.check(s)  # the error, not a skipped check; the model checks do not run
    assert [f.check for f in found] == ["labels", "threads"] and found[0].severity == "error"


def test_labels_are_checked_only_for_classification():
    assert data_checks.check_labels(labelled([5, 5], c=None)) == []
    assert data_checks.check_labels(labelled([5, 5], loss__name="mse")) == []


def test_classes_missing_from_train_are_listed():
    missing, balance = data_checks.check_labels(labelled([0, 0, 1, 1], c=4))
    assert missing.severity == "warning"
    assert missing.measured == "train: 2 of 4 classes never appear: [2, 3]"
    assert "wrong num_classes" in missing.cause and balance.severity == "info"
    assert missing.fix == "check the split and the number of classes"
    (ten, _) = data_checks.check_labels(labelled([0], c=11))
    assert ten.measured == f"train: 10 of 11 classes never appear: {list(range(1, 11))}"


def test_a_class_more_than_ten_times_as_common_as_another_is_a_warning():
    # shares 10/16, 1/16, 5/16: exactly 10x is fine, 11/16 against 1/16 is not
    (f,) = data_checks.check_labels(labelled([0] * 10 + [1] + [2] * 5))
    assert f == info("labels", "train class balance: 16 samples, smallest class 6.2%, "
                               "largest 62.5%")
    (f,) = data_checks.check_labels(labelled([0] * 11 + [1] + [2] * 4))
    assert f.severity == "warning" and f.measured == (
        "train class balance: 16 samples, smallest class 6.2%, largest 68.8%")
    assert f.fix == "set loss.class_weights, or resample the training set"


def test_validation_labels_are_checked_for_range_only_not_for_balance():
    findings = data_checks.check_labels(labelled([0, 1, 2], val=[0] * 11 + [1, 7]))
    assert [(f.severity, f.measured.split(":")[0]) for f in findings] == [
        ("info", "train class balance"), ("error", "val"), ("info", "val class balance")]
    assert findings[1].measured.startswith("val: 1 label(s) outside [0, 3)")
    assert data_checks.check_labels(labelled([0, 1, 2], val=[])) == \
        data_checks.check_labels(labelled([0, 1, 2]))


def test_the_labels_of_data_not_in_memory_are_read_up_to_the_cap():
    data = [(torch.zeros(2), v) for v in (0, 1, 2, 9)]
    s = make(train=data, num_classes=3)
    assert data_checks.check_labels(s, cap=3)[0].severity == "info"
    assert data_checks.check_labels(s)[0].severity == "error"


# -- data checks: inputs and leakage --------------------------------------------------------------

def test_samples_with_nan_or_inf_inputs_are_named_in_every_split():
    x = torch.zeros(8, 2)
    x[[1, 2, 3, 5, 6, 7], 0] = math.nan
    v = torch.zeros(3, 2)
    v[2, 1] = -math.inf
    s = make(train=TensorData(x, torch.zeros(8, dtype=torch.long)),
             val=TensorData(torch.zeros(2, 2), torch.zeros(2)))
    s.test = [(row, 0) for row in v]
    train, test = data_checks.check_finite_inputs(s)
    assert train.severity == "error" and train.measured == (
        "train: 6 sample(s) with NaN or inf inputs, e.g. samples [1, 2, 3, 5, 6]")
    assert test.measured == "test: 1 sample(s) with NaN or inf inputs, e.g. samples [2]"
    assert "guard would skip" in train.cause and train.fix.startswith("clean or drop")
    assert data_checks.check_finite_inputs(s, cap=2) == [train]  # the test sample is the 3rd


def test_the_inputs_of_samples_are_their_float_parts_of_one_shape():
    assert torch.equal(data_checks._inputs([(torch.ones(2, 2), 0), (torch.zeros(2, 2), 1)], None),
                       torch.tensor([[1.0] * 4, [0.0] * 4]))
    assert data_checks._inputs([(torch.ones(2), 0)] * 5, 3).shape == (3, 2)
    dicts = [{"a": torch.ones(2), "mask": torch.ones(2, dtype=torch.long), "b": torch.zeros(1),
              "labels": torch.ones(3)}]
    assert torch.equal(data_checks._inputs(dicts, None), torch.tensor([[1.0, 1.0, 0.0]]))
    assert data_checks._inputs([(torch.ones(2), 0), (torch.ones(3), 0)], None) is None
    assert data_checks._inputs([(torch.ones(2), 0), (torch.ones(2, dtype=torch.long), 0)],
                               None) is None
    assert data_checks._inputs([], None) is None
    assert data_checks._inputs(TensorData(torch.ones(3, 2, 2), torch.zeros(3)), None).shape == \
        (3, 4)
    assert data_checks._inputs(TensorData(torch.ones(3, 2, dtype=torch.long), torch.zeros(3)),
                               None) is None


def test_inputs_shared_by_train_and_val_or_test_are_an_error_with_the_pairs():
    x = torch.arange(12.0).reshape(6, 2)
    train = TensorData(torch.cat([x, x[:1]]), torch.zeros(7))  # train[6] repeats train[0]
    val = [(x[3], 1), (torch.tensor([99.0, 99.0]), 0), (x[0].clone(), 2), (x[0] + 50, 0)]
    s = make(train=train, val=val)
    s.test = TensorData(x[:0], torch.zeros(0))
    (f,) = data_checks.check_leakage(s)
    assert f.severity == "error"
    assert f.measured == ("2 of 4 val samples (50.0%) also appear in train, e.g. val[0]=train[3], "
                          "val[2]=train[0]")
    assert f.cause.startswith("duplicated samples across the split: val scores will be "
                              "optimistic")
    assert f.fix == "deduplicate before splitting, or drop these samples from val"
    s.val, s.test = None, TensorData(x[5:] + 100, torch.zeros(1))
    assert data_checks.check_leakage(s) == [
        info("leakage", "train/test: no duplicated inputs among 6 x 1 samples")]
    assert data_checks.check_leakage(s, cap=2) == [
        info("leakage", "train/test: no duplicated inputs among 6 x 1 samples")]
    s.train = None
    assert data_checks.check_leakage(s) == []


def test_leaked_pairs_beyond_five_are_counted_not_listed():
    x = torch.randn(7, 3)
    s = make(train=TensorData(x, torch.zeros(7)), val=TensorData(x.clone(), torch.zeros(7)))
    (f,) = data_checks.check_leakage(s)
    assert f.measured == ("7 of 7 val samples (100.0%) also appear in train, e.g. val[0]=train[0], "
                          "val[1]=train[1], val[2]=train[2], val[3]=train[3], val[4]=train[4]")


def test_sample_hashes_read_only_the_inputs_and_only_up_to_the_cap():
    rows = [{"x": torch.ones(2), "labels": torch.tensor(i)} for i in range(4)]
    hashes = data_checks._hashes(rows, 3)
    assert len(hashes) == 3 and len(set(hashes)) == 1 and len(hashes[0]) == 16
    assert data_checks._hashes(TensorData(torch.ones(2, 2), torch.zeros(2)), 1) == \
        data_checks._hashes([(torch.ones(2), 5)] * 2, None)


# -- data checks: input bound ---------------------------------------------------------------------

class Counted(torch.utils.data.Dataset):
    def __init__(self, n):
        self.data, self.reads = blobs(n), 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.reads += 1
        return self.data[i]


class Clock:
    """A perf_counter that moves one second per reading."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1
        return self.now


def test_the_loader_is_timed_on_at_most_max_batches_after_the_first(monkeypatch):
    monkeypatch.setattr(data_checks, "time", Clock())
    data = Counted(40)  # 10 batches of 4
    s = make(train=data)
    assert data_checks._loader_seconds_per_batch(s, 3, budget=100) == 1.0
    assert data.reads == 16  # the first batch and 3 timed
    data.reads = 0
    data_checks._loader_seconds_per_batch(s, 3, budget=2)
    assert data.reads == 8  # one timed batch: the budget is spent
    small = Counted(4)
    assert data_checks._loader_seconds_per_batch(make(train=small), 3, 100) == 0.0


def test_the_model_is_timed_for_steps_within_the_budget(monkeypatch):
    monkeypatch.setattr(data_checks, "time", Clock())
    step = Scripted(1.0)
    s = make(step=step)
    assert data_checks._model_seconds_per_step(s, batch_of(), 3, budget=100) == 1.0
    assert step.calls == 4  # a warm-up, then 3
    step.calls = 0
    data_checks._model_seconds_per_step(s, batch_of(), 3, budget=1)
    assert step.calls == 2  # the budget is checked before each timed step: <= 1 s


def input_bound(monkeypatch, load, step, **kw) -> Finding:
    monkeypatch.setattr(data_checks, "_loader_seconds_per_batch", lambda s, n, budget: load)
    monkeypatch.setattr(data_checks, "_model_seconds_per_step", lambda s, b, n, budget: step)
    monkeypatch.setattr(data_checks, "loader_fix", lambda s, load, step: f"fix {load} {step}")
    (f,) = data_checks.check_input_bound(make(**kw), batch_of())
    return f


def test_loading_in_the_main_process_is_reported_from_a_tenth_and_warned_from_a_quarter(
        monkeypatch):
    f = input_bound(monkeypatch, 0.1, 1.0)
    assert f == info("input_bound", "DataLoader 10 batches/s per process, model 1 steps/s on "
                                    "synthetic batches")
    f = input_bound(monkeypatch, 0.25, 1.0)
    assert f.severity == "info" and f.fix == "fix 0.25 1.0"
    assert f.measured == ("DataLoader 4 batches/s per process, model 1 steps/s on synthetic "
                          "batches: loading would take 20% of each step")
    assert "data.num_workers=0" in f.cause
    f = input_bound(monkeypatch, 0.5, 1.0)
    assert f.severity == "warning" and f.measured.endswith("loading would take 33% of each step")


def test_workers_slower_than_the_model_together_are_a_warning(monkeypatch):
    f = input_bound(monkeypatch, 2.0, 1.0, data__num_workers=2)
    assert f == info("input_bound", "DataLoader 0 batches/s per process (x2 workers), model 1 "
                                    "steps/s on synthetic batches")
    f = input_bound(monkeypatch, 2.5, 1.0, data__num_workers=2)
    assert f.severity == "warning" and f.measured == (
        "DataLoader 0 batches/s per process (x2 workers), model 1 steps/s on synthetic batches: "
        "the loader is slower")
    assert f.cause == "the model waits for data: the DataLoader cannot keep up"
    assert f.fix == "fix 2.5 1.0"


def test_the_loader_fix_asks_for_workers_in_proportion_within_the_cores(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)

    def fix(load, n=8, device="cpu", **keys):
        monkeypatch.setattr(data_checks, "cores", lambda: n)
        s = SimpleNamespace(cfg=config(**keys), device=torch.device(device))
        return data_checks.loader_fix(s, load, 1.0).split(", or")[0].split("; `")[0]

    assert fix(2.0) == "set data.num_workers=4"      # 2 x 1.5 + 1
    assert fix(0.0) == "set data.num_workers=2"      # at least 2
    assert fix(100.0) == "set data.num_workers=8"    # at most the cores
    assert fix(100.0, n=64) == "set data.num_workers=32"  # and at most 32
    assert fix(2.0, data__num_workers=4) == \
        "the 4 workers already have the 8 cores: make __getitem__ cheaper or move " \
        "decoding/augmentation off the critical path"
    assert fix(2.0, run__threads=5) == "set data.num_workers=4, run.threads=4 (now 5: torch's " \
                                       "threads take the cores the workers need)"
    assert fix(2.0, run__threads=4) == "set data.num_workers=4"
    assert fix(2.0, n=2, run__threads=2) == "set data.num_workers=2, run.threads=1 (now 2: " \
                                            "torch's threads take the cores the workers need)"
    assert fix(2.0, device="cuda", run__threads=5, data__pin_memory=False) == \
        "set data.num_workers=4, data.pin_memory=true"
    s = SimpleNamespace(cfg=config(), device=torch.device("cpu"))
    assert data_checks.loader_fix(s, 2.0, 1.0).endswith(
        f", or make __getitem__ cheaper; `{data_checks.tune_command()}` measures which is "
        f"fastest")


# -- the LR range test ----------------------------------------------------------------------------

def test_the_sweep_grows_the_lr_geometrically_and_stops_when_the_loss_diverges():
    step = Scripted(1.0, 2.0, 4.0, 4.0, 4.0, 4.0)
    lrs, losses = lr_find.sweep(make(step=step), start=1.0, end=16.0, steps=5, beta=0.0)
    assert lrs == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0]) and losses == [1, 2, 4, 4, 4]
    step = Scripted(1.0, 2.0, 4.000001, 1.0)
    lrs, losses = lr_find.sweep(make(step=step), start=1.0, end=16.0, steps=5, beta=0.0)
    assert lrs == [1.0, 2.0] and step.calls == 3
    step = Scripted(1.0, math.nan, 1.0)
    assert lr_find.sweep(make(step=step), 1.0, 16.0, 5, 0.0) == ([1.0], [1.0])


def test_the_sweep_smooths_the_loss_with_a_bias_corrected_average():
    lrs, losses = lr_find.sweep(make(step=Scripted(2.0, 2.0, 5.0)), 1e-3, 1e-1, 3, beta=0.5)
    # avg: 1, 1.5, 3.25; corrected by 1 - 0.5^(i+1): 2, 2, 3.714...
    assert losses == pytest.approx([2.0, 2.0, 3.25 / 0.875])
    assert lrs == pytest.approx([1e-3, 1e-2, 1e-1])
    assert lr_find.sweep(make(step=Scripted(1.0)), 0.5, 10.0, 1)[0] == [0.5]


def test_the_sweep_sets_each_lr_cycles_the_loader_and_trains_with_clipping(monkeypatch):
    seen_lr, clipped = [], []
    real_copy = DoctorSubject.copy

    def copy(self):
        model, opt = real_copy(self)
        step = opt.step

        def recorded(*a, **k):
            seen_lr.append(opt.param_groups[0]["lr"])
            return step(*a, **k)
        opt.step = recorded
        return model, opt

    monkeypatch.setattr(DoctorSubject, "copy", copy)
    monkeypatch.setattr(lr_find, "clip_gradients", lambda params, max_norm, mode: clipped.append(
        (max_norm, mode)))
    s = make(train=blobs(8), clip__max_norm=3.0)  # two batches of 4
    lrs, _ = lr_find.sweep(s, start=1e-4, end=1e-1, steps=4, beta=0.0)
    assert lrs == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1]) and seen_lr == pytest.approx(lrs)
    assert clipped == [(3.0, "norm")] * 4


def test_the_suggestion_needs_five_points_and_falls_back_to_the_first_lr():
    assert lr_find.suggest([1, 2, 4, 8], [4, 3, 2, 1]) is None
    assert lr_find.suggest([1, 2, 4, 8, 16], [1, 2, 3, 4, 5]) == 1
    assert lr_find.suggest([1, 2, 4, 8, 16, 32], [5, 4, 2, 1.5, 1, 3]) == 2
    assert lr_find.suggest([1, 2, 4, 8, 16, 32], [5, 4, 3, 1.5, 1, 3]) == 4


def lr_findings(monkeypatch, tmp_path, lrs, losses, lr, steps=100) -> tuple[Finding, list]:
    calls = []
    monkeypatch.setattr(lr_find, "sweep", lambda s, steps: calls.append(steps) or (lrs, losses))
    monkeypatch.setattr(lr_find, "plot", lambda *a: calls.append(a))
    (f,) = lr_find.check_lr_find(make(optim__lr=lr), tmp_path / "lr.png", steps=steps)
    return f, calls


def test_the_lr_finding_compares_optim_lr_with_the_suggestion_and_the_minimum(
        monkeypatch, tmp_path):
    lrs, losses = [0.1, 1.0, 3.0, 10.0, 30.0, 100.0], [5, 4, 1, 0.5, 0.4, 9]  # best 1, min 30
    out = tmp_path / "lr.png"
    f, calls = lr_findings(monkeypatch, tmp_path, lrs, losses, 30.0, steps=7)
    assert calls == [7, (lrs, losses, 1.0, 30.0, out)]
    assert f == Finding("lr_find", "info", f"suggested LR 1.00e+00 ({lr_find.METHOD}); lowest "
                                           f"loss at 3.00e+01; optim.lr=30; plot in {out}", "", "")
    f, _ = lr_findings(monkeypatch, tmp_path, lrs, losses, 30.5)
    assert f.severity == "warning" and "past the loss minimum" in f.cause
    assert f.fix == "lower optim.lr to about 1.0e+00"
    assert lr_findings(monkeypatch, tmp_path, lrs, losses, 1 / 30)[0].severity == "info"
    f, _ = lr_findings(monkeypatch, tmp_path, lrs, losses, 0.033)
    assert f.severity == "warning" and "far below" in f.cause
    assert f.fix == "raise optim.lr to about 1.0e+00"


def test_a_sweep_too_short_to_suggest_an_lr_is_a_warning(monkeypatch, tmp_path):
    f, calls = lr_findings(monkeypatch, tmp_path, [1e-7, 1e-6], [1.0, 9.0], 0.1)
    assert f == Finding("lr_find", "warning", "the loss diverged within 2 steps of the sweep "
                                              "(from 1e-7)", "the model is unstable at any LR",
                        "check the initial_loss and probabilities findings first")
    assert calls[1][2] is None


def test_the_lr_plot_shows_the_curve_the_suggestion_and_the_configured_lr(monkeypatch, tmp_path):
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, out: figures.append((self, out)))
    out = tmp_path / "sub" / "lr.png"
    assert lr_find.plot([1e-3, 1e-2], [2.0, 1.0], 5e-3, 1e-2, out) == out
    ((fig, saved),) = figures
    assert saved == out and out.parent.is_dir()
    (ax,) = fig.axes
    assert tuple(fig.get_size_inches()) == (7.0, 4.0) and fig.dpi == 120
    assert ax.get_xscale() == "log" and ax.get_title() == "LR range test"
    assert ax.get_xlabel() == "learning rate" and ax.get_ylabel() == "loss (smoothed)"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["smoothed loss", f"suggested 5.00e-03 ({lr_find.METHOD})",
                      "optim.lr = 1.00e-02"]
    curve, best, configured = ax.get_lines()
    assert list(curve.get_xdata()) == [1e-3, 1e-2] and list(curve.get_ydata()) == [2.0, 1.0]
    assert list(best.get_xdata()) == [5e-3, 5e-3] and list(configured.get_xdata()) == [1e-2] * 2
    lr_find.plot([1e-3, 1e-2], [2.0, 1.0], None, 1e-2, out)
    assert [t.get_text() for t in figures[1][0].axes[0].get_legend().get_texts()] == [
        "smoothed loss", "optim.lr = 1.00e-02"]


# -- after the run: the logs -----------------------------------------------------------------------

def epochs(*rows, key="train_loss"):
    return [{"epoch": i + 1, key: v} for i, v in enumerate(rows)]


def test_a_training_loss_less_than_five_percent_lower_after_epoch_one_is_flat():
    from ironloop.outputs.numbers import number

    (f,) = logs.flat_loss(epochs(1.0, 0.96, 0.95), [])
    assert f.severity == "warning" and f.measured == (
        f"the training loss is flat: {number(1.0)} in the first epoch, at best {number(0.95)} "
        f"over the next 2 (less than 5% lower)")
    assert logs.flat_loss(epochs(1.0, 0.9499), []) == []
    assert logs.flat_loss(epochs(0.0, 0.0), []) == []
    assert logs.flat_loss(epochs(-1.0, -1.0), []) == []


def test_within_one_epoch_the_flat_loss_reads_five_or_more_log_windows():
    windows = [{"step": i, "loss": 1.0} for i in range(1, 6)]
    (f,) = logs.flat_loss(epochs(1.0), windows)
    assert "in the first log window" in f.measured and "over the next 4" in f.measured
    assert logs.flat_loss(epochs(1.0), windows[:4]) == []
    assert logs.flat_loss([], [*windows[:4], {"step": 5, "loss": None}]) == []


def test_validation_loss_five_percent_above_its_minimum_two_epochs_on_is_overfitting():
    from ironloop.outputs.numbers import number

    rows = [{"epoch": 1, "train_loss": 1.0, "val_loss": 1.0},
            {"epoch": 2, "train_loss": 0.8, "val_loss": 0.5},
            {"epoch": 3, "train_loss": 0.6, "val_loss": 0.51},
            {"epoch": 4, "train_loss": 0.4, "val_loss": 0.525}]
    (f,) = logs.overfitting(rows)
    assert f.measured == (f"validation loss rises from epoch 3 ({number(0.5)} at epoch 2 -> "
                          f"{number(0.525)} at epoch 4) while the training loss falls "
                          f"({number(0.8)} -> {number(0.4)})")
    assert f.cause == "the model memorises the training set from epoch 3 on"
    assert f.fix.endswith("or train.epochs=2")
    assert logs.overfitting([*rows[:3], {**rows[3], "val_loss": 0.5249}]) == []
    assert logs.overfitting([*rows[:3], {**rows[3], "train_loss": 0.8}]) == []
    assert logs.overfitting(rows[:3]) == []  # one epoch after the minimum
    assert logs.overfitting([rows[1], rows[3]]) == []
    assert logs.overfitting([*rows, {"epoch": 5, "train_loss": 0.3}]) == [f]


def test_a_first_validation_accuracy_of_95_percent_is_suspicious():
    (f,) = logs.high_first_val_acc([{"val_acc": 0.95}, {"val_acc": 0.1}])
    assert f.measured == "validation accuracy is 95.0% after one epoch"
    assert f.cause == ("validation samples that also appear in training (leakage), labels that "
                       "leak into the inputs, or a task easier than expected")
    assert f.fix == "run `ironloop doctor CONFIG` (the leakage and initial_loss checks)"
    assert logs.high_first_val_acc([{"val_acc": 0.9499}]) == []
    assert logs.high_first_val_acc([{"val_acc": 0.1}, {"val_acc": 0.99}]) == []
    assert logs.high_first_val_acc([{}]) == [] and logs.high_first_val_acc([]) == []


def clip_rows(clipped_late):
    return [{"step": 10, "clipped": 10, "steps": 10, "grad_norm": 100.0},  # warm-up: left out
            {"step": 50, "clipped": 5, "steps": 10, "grad_norm": 2.0},
            {"step": 100, "clipped": clipped_late, "steps": 10, "grad_norm": 3.0}]


def test_clipping_on_more_than_half_the_steady_steps_is_a_hidden_lr_cut():
    assert logs.clipping(clip_rows(5), 1.0) == []  # 10 of 20: half
    (f,) = logs.clipping(clip_rows(6), 1.0, "SGD")
    assert f.severity == "warning"
    assert f.measured == ("55% of steady-state steps were clipped at clip.max_norm=1.0; median "
                          "pre-clip norm 2.5")
    assert f.fix == ("raise clip.max_norm (about 3.8) so it only catches spikes, or lower "
                     "optim.lr")
    assert "hidden LR cut" in f.cause
    bare = [{k: v for k, v in r.items() if k != "grad_norm"} for r in clip_rows(6)]
    (f,) = logs.clipping(bare, 0.5)
    assert f.measured == "55% of steady-state steps were clipped at clip.max_norm=0.5"
    assert f.fix == "raise clip.max_norm so it only catches spikes, or lower optim.lr"


def test_clipping_needs_ten_steady_steps_and_is_only_reported_for_adaptive_optimizers():
    assert logs.clipping([{"step": 1, "clipped": 9, "steps": 9}], 1.0) == []
    assert logs.clipping([{"step": 1, "clipped": 10, "steps": 10}], 1.0)[0].severity == "warning"
    (f,) = logs.clipping(clip_rows(6), 1.0, "AdamW")
    assert f.severity == "info" and f.measured.startswith(
        "55% of steady-state steps were clipped at clip.max_norm=1.0; median pre-clip norm 2.5. "
        "With AdamW, which divides each step")
    assert logs.clipping([], 1.0) == []


def speeds(*values):
    return [{"step": 0, "samples_per_s": 1.0}] + [
        {"step": i + 1, "samples_per_s": v} for i, v in enumerate(values)]


def test_throughput_below_seventy_percent_of_the_first_quarter_is_a_drop():
    from ironloop.outputs.numbers import number

    assert logs.throughput_drop(speeds(100, 100, 90, 90, 80, 80, 70, 70), []) == []
    (f,) = logs.throughput_drop(speeds(100, 100, 90, 90, 80, 80, 69, 69), [])
    assert f.measured == (f"throughput fell from {number(100.0)} to {number(69.0)} samples/s "
                          f"(31% lower) between the first and the last quarter of the run")
    assert f.fix == ("see from which step samples_per_s falls in metrics.jsonl, and keep only "
                     ".item() values of what you store")
    assert logs.throughput_drop(speeds(100, 100, 90, 90, 80, 69, 69), []) == []  # 7 windows
    (f,) = logs.throughput_drop(speeds(100, 100, 90, 90, 80, 80, 75, 60), [])  # quarters of 2
    assert f.measured.startswith(f"throughput fell from {number(100.0)} to {number(67.5)} "
                                 f"samples/s (32% lower)")


def test_the_throughput_finding_points_to_the_time_split_that_shows_the_growth():
    slow = speeds(100, 100, 90, 90, 80, 80, 50, 50)
    split = [{"epoch": 1, "time_split": {"data": 1.0, "compute": 2.0}},
             {"epoch": 2, "time_split": {"data": 3.0, "compute": 2.5}}]
    (f,) = logs.throughput_drop(slow, split)
    assert f.measured.endswith("; the time split says data grew most (1.00 s in the first "
                               "epoch, 3.00 s in the last)")
    assert f.fix.startswith("compare the time split per epoch in epochs.jsonl")
    (f,) = logs.throughput_drop(slow, split[:1], {"time_split": {"data": 1.0}})
    assert f.fix.startswith("see which part takes the time in results.json's time_split")
    assert f.measured.endswith("quarter of the run")
    shrank = [split[1], {"epoch": 2, "time_split": {"data": 3.0, "compute": 2.5}}]
    assert logs._part_that_grew(shrank) == ""


def test_a_nan_training_loss_is_named_at_its_step():
    (f,) = logs.non_finite_loss([{"step": 1, "loss": 1.0}, {"step": 2, "loss": "x"},
                                 {"step": 3, "loss": math.inf}, {"step": 4, "loss": math.nan}])
    assert f.severity == "error" and f.measured == "the training loss is inf at step 3"
    assert logs.non_finite_loss([{"step": 1, "loss": 1.0}]) == []


def test_the_optimizer_is_the_class_the_run_used_else_optim_name():
    assert logs.optimizer_name({"used": {"optimizer": "Lion"}, "optim": {"name": "sgd"}}) == "Lion"
    assert logs.optimizer_name({"used": {}, "optim": {"name": "sgd"}}) == "sgd"
    assert logs.optimizer_name({"used": "Lion", "optim": {"name": "sgd"}}) == "sgd"


def averaged(avg_loss, raw_loss=1.0, **acc):
    return [{"step": 5, "val_loss": raw_loss, "val_avg_loss": avg_loss, **acc}]


def test_averaged_weights_more_than_five_percent_worse_are_a_warning():
    assert logs.average_worse(averaged(1.05), {}) == []
    (f,) = logs.average_worse(averaged(1.06), {"average": {"decay": 0.999}})
    assert f.severity == "warning" and f.measured.endswith("at the last evaluation (step 5)")
    assert f.cause == ("the average still holds early weights: average.decay=0.999 keeps "
                       "decay^t of the weights from t updates back")
    assert f.fix.startswith("average.warmup=true (the default)")
    assert f.fix.endswith("; final.safetensors holds the raw weights")
    (f,) = logs.average_worse(averaged(1.06), {"average": {"decay": 0.9, "warmup": False}})
    assert f.cause.endswith(", and average.warmup=false gives the first weights that share too")
    (f,) = logs.average_worse(averaged(1.06), {"average": {"kind": "swa"}})
    assert "SWA's equal average" in f.cause and f.fix.startswith("start it later")
    assert logs.average_worse(averaged(1.06, val_acc=0.5, val_avg_acc=0.6), {}) == []
    assert logs.average_worse([{"step": 5, "val_loss": 1.0}], {}) == []


def test_the_diagnosis_section_lists_every_finding_or_says_nothing_calls_for_attention():
    assert logs.markdown([]) == "## Diagnosis\n\nNothing in the logs calls for attention.\n"
    assert logs.markdown([Finding("x", "warning", "m", "c", "f"), info("y", "n")]) == (
        "## Diagnosis\n\n- **warning** (x): m. *Likely cause:* c. *Fix:* f.\n"
        "- **info** (y): n. *Likely cause:* . *Fix:* .\n")


def test_diagnose_logs_reads_every_log_of_a_run(tmp_path):
    import yaml

    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("metrics.jsonl", [{"step": 1, "loss": 1.0, "clipped": 10, "steps": 10}])
    jsonl("epochs.jsonl", [{"epoch": 1, "train_loss": 1.0, "val_acc": 0.99},
                           {"epoch": 2, "train_loss": 1.0}])
    jsonl("evals.jsonl", averaged(2.0))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"clip": {"max_norm": 0.25},
                                                         "optim": {"name": "sgd"}}))
    (tmp_path / "results.json").write_text("{}")
    found = logs.diagnose_logs(str(tmp_path))
    assert [f.check for f in found] == ["flat_loss", "val_acc_epoch1", "clipping", "average"]
    assert "clip.max_norm=0.25" in found[2].measured and found[2].severity == "warning"


# -- running the checks ---------------------------------------------------------------------------

def test_a_check_s_outcome_is_its_worst_finding():
    def f(check, severity):
        return Finding(check, severity, "", "", "")

    found = [info("a", ""), f("a", "warning"), f("b", "skipped"), info("b", ""), f("c", "error"),
             f("c", "warning"), info("d", "")]
    assert drun.outcomes(found) == {"a": "warning", "b": "skipped", "c": "error", "d": "passed"}
    assert list(drun.outcomes(found)) == ["a", "b", "c", "d"]


def test_the_summary_counts_the_checks_by_outcome_and_says_why_some_were_skipped():
    found = [info("a", "fine"), Finding("b", "warning", "w", "c", "f"),
             Finding("c", "skipped", "no cuda", "", ""), Finding("d", "error", "e", "", ""),
             Finding("e", "error", "e2", "", "")]
    assert drun.render(found, verbose=False) == "\n".join([
        "warning: [b] w\n    cause: c\n    fix:   f", "error: [d] e", "error: [e] e2",
        "doctor: 2 error(s), 1 warning(s), 1 passed, 1 skipped: c (no cuda)"])
    assert drun.render(found, verbose=True).startswith("info: [a] fine\nwarning: [b] w")
    assert drun.render([info("a", "x"), info("b", "y")], verbose=False) == \
        "doctor: 2 checks passed"
    assert drun.render([info("a", "x"), Finding("b", "skipped", "why", "", "")], False) == \
        "doctor: 1 passed, 1 skipped: b (why)"


def test_doctor_json_holds_the_seconds_and_every_finding(tmp_path):
    out = tmp_path / "new" / "doctor.json"
    drun.write_json([info("a", "x")], out, 1.23456)
    assert json.loads(out.read_text()) == {"seconds": 1.235, "findings": [
        {"check": "a", "severity": "info", "measured": "x", "cause": "", "fix": ""}]}
    assert out.read_text().endswith("}\n") and '\n  "seconds"' in out.read_text()
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot be created or written"):
        drun.write_json([], tmp_path / "file" / "doctor.json", 0.0)


def test_strict_stops_on_the_first_error_with_its_fix():
    found = [Finding("a", "warning", "w", "", ""), Finding("b", "error", "m1", "", "f1"),
             Finding("c", "error", "m2", "", "f2")]
    with pytest.raises(drun.DoctorError) as e:
        drun.stop_if_strict(found, True)
    assert str(e.value) == "doctor found 2 error(s) and --strict is set; first: [b] m1; fix: f1"
    drun.stop_if_strict(found, False)
    drun.stop_if_strict(found[:1], True)


def test_the_resume_hint_is_for_runs_of_five_thousand_steps_or_more(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config(train__batch_size=10, train__epochs=1)
    assert drun.resume_hint(cfg, 49990) == ""
    assert drun.resume_hint(cfg, 49991) == (
        "; a long run (5000 steps): `ironloop doctor` with these arguments and --resume-check "
        "proves in seconds that a crash will cost nothing")
    assert "(10000 steps)" in drun.resume_hint(config(train__batch_size=10, train__epochs=2),
                                                50000)
    assert drun.resume_hint(config(train__batch_size=10, train__epochs=1,
                                   train__accumulation_steps=2), 50000) \
        == ""
    assert drun.resume_hint(config(train__batch_size=10, train__epochs=2,
                                   train__max_steps=4999), 50000) == ""
    assert "(5000 steps)" in drun.resume_hint(config(train__batch_size=10, train__epochs=2,
                                                     train__max_steps=5000), 50000)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert drun.resume_hint(cfg, 50000) == ""


def test_a_check_that_raises_is_skipped_with_the_error_or_an_oom_error():
    def raises(e):
        def fn(*a, **k):
            assert a == (1, 2) and k == {"x": 3}
            raise e
        return fn

    assert drun._guard("c", raises(ValueError("boom")), 1, 2, x=3) == [
        Finding("c", "skipped", "it raised ValueError: boom", "", "")]
    (f,) = drun._guard("c", raises(torch.OutOfMemoryError("CUDA out of memory.\nmore")), 1, 2,
                       x=3)
    assert f == Finding("c", "error", "out of device memory during the c check (CUDA out of "
                                      "memory.)", "one training step at this batch size does "
                                      "not fit", "lower train.batch_size and raise "
                        "train.accumulation_steps, or use train.precision=bf16")
    (f,) = drun._guard("c", raises(torch.OutOfMemoryError()), 1, 2, x=3)
    assert f.measured == "out of device memory during the c check (OOM)"
    assert drun._guard("c", lambda *a, **k: [a, k], 1, x=2) == [(1,), {"x": 2}]


def test_the_probe_says_which_batch_raised_and_lets_an_oom_through():
    calls = []

    def step(model, batch):
        calls.append((model.training, torch.is_inference_mode_enabled()))
        if batch[0].shape[0] == 3:
            raise RuntimeError("val broke")
        return model(batch[0]).sum(), {}

    from ironloop.data.source import eval_split

    val, batching = eval_split(blobs(3, seed=1), "val_data", config(), None, 1)
    s = make(step=step, val=val)
    s.val_batching = batching
    with pytest.raises(RuntimeError) as e:
        drun.probe_step(s, batch_of())
    assert calls == [(True, False), (False, True)]
    assert e.value.__notes__ == ["ironloop: raised in the preflight, running the run's step on "
                                 "the first validation batch; the run itself would raise the "
                                 "same"]
    s.step_fn = lambda m, b: (_ for _ in ()).throw(UserError("bad"))
    with pytest.raises(UserError) as e:
        drun.probe_step(s, batch_of())
    assert not hasattr(e.value, "__notes__")
    s.step_fn = lambda m, b: (_ for _ in ()).throw(KeyError("k"))
    with pytest.raises(KeyError) as e:
        drun.probe_step(s, batch_of())
    assert "the first training batch" in e.value.__notes__[0]
    s.step_fn = lambda m, b: (_ for _ in ()).throw(torch.OutOfMemoryError("oom"))
    assert drun.probe_step(s, batch_of()) is None


def test_the_checks_get_the_cap_the_small_batch_the_steps_and_the_budget(monkeypatch):
    seen = {}

    def record(name):
        def fn(*a, **k):
            seen[name] = (a[1:], k)
            return [info(name, "")]
        return fn

    for name in ("check_labels", "check_finite_inputs", "check_leakage", "check_input_bound"):
        monkeypatch.setattr(data_checks, name, record(name))
    for name in ("check_initial_loss", "check_probabilities", "check_overfit_batch",
                 "check_dead_parameters", "check_memory"):
        monkeypatch.setattr(mc, name, record(name))
    s = make(train=blobs(40), train__batch_size=20, doctor__max_batches=3,
             doctor__overfit_steps=7, doctor__memory_search=True)
    found = drun.check(s, quick=True)
    assert [f.check for f in found] == [
        "check_labels", "check_finite_inputs", "check_leakage", "threads", "check_initial_loss",
        "check_probabilities", "check_overfit_batch", "check_dead_parameters",
        "check_input_bound", "check_memory"]
    assert seen["check_labels"] == ((60,), {}) and seen["check_leakage"] == ((60,), {})
    small, steps = seen["check_overfit_batch"][0]
    assert len(small[0]) == 16 and steps == 7 and len(seen["check_initial_loss"][0][0][0]) == 20
    assert seen["check_input_bound"][0][1] == 3 and seen["check_input_bound"][1] == {
        "budget": 0.05}
    assert seen["check_memory"][1] == {"search": True}
    drun.check(s, quick=False)
    assert seen["check_labels"] == ((None,), {}) and seen["check_input_bound"][1] == {
        "budget": 0.3}


def test_label_errors_stop_the_checks_before_the_model_checks():
    s = labelled([0, 5, 1, 2])
    found = drun.check(s)
    assert [f.check for f in found if f.check not in ("finite_inputs",)] == [
        "labels", "labels", "threads"]
    s = labelled([0, 0, 1, 1], c=4)  # a warning only: the model checks run
    assert "initial_loss" in {f.check for f in drun.check(s)}


def test_no_batch_or_a_step_that_raises_ends_the_checks_with_a_finding():
    s = make(train=[])
    found = drun.check(s)
    assert found[-1].check == "model" and found[-1].severity == "skipped"
    assert found[-1].measured.startswith("no training batch to check with: it raised ")

    def broken(model, batch):
        raise ValueError("no forward")

    s = make(step=broken)
    last = drun.check(s)[-1]
    assert last == Finding("step", "error", "the run's step raised ValueError: no forward",
                           "the run would stop with this error at its first step or its first "
                           "evaluation", "fix the model's forward or pass the step it needs "
                           "(train.step_fn)")
    with pytest.raises(ValueError, match="no forward"):
        drun.check(s, raise_step=True)


def test_the_subject_runs_the_named_step_or_the_default_one_with_the_inferred_classes():
    s = drun.subject(tiny_mlp(c=5), blobs(16), cfg=config(train__step_fn="lm"))
    assert s.step_fn is lm_step and s.user_step and s.num_classes is None
    s = drun.subject(tiny_mlp(c=5), blobs(16), cfg=config())
    assert not s.user_step and s.num_classes == 5 and s.device == torch.device("cpu")
    assert s.cfg.train.batch_size == 4 and s.val is None and s.test is None
    assert drun.subject(tiny_mlp(c=5), blobs(16), num_classes=3).num_classes == 3
    mine = Scripted(1.0)
    s = drun.subject(tiny_mlp(), blobs(16), step_fn=mine)
    assert s.step_fn is mine and s.user_step and s.num_classes is None
    s = drun.subject(tiny_mlp(), blobs(16), loss_fn=F.mse_loss)
    assert s.loss_fn is F.mse_loss
    s = drun.subject(tiny_mlp(), blobs(16), cfg=config(loss__name="torch.nn.functional:l1_loss"))
    assert s.loss_fn is F.l1_loss
    assert drun.subject(tiny_mlp(), blobs(16), val=blobs(4)).val_batching is not None


def test_the_subject_refuses_a_stream():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(UserError, match=r"^the doctor reads samples by index, and the training "
                                        r"data is a stream \(an IterableDataset\); check a "
                                        r"map-style sample of it instead$"):
        drun.subject(tiny_mlp(), Stream())


def test_the_preflight_is_skipped_when_off_on_other_ranks_and_on_a_resume_that_ran_it(
        tmp_path, monkeypatch, capsys):
    bundle = SimpleNamespace(train=blobs(16), first_val=None, test=None, num_classes=3)
    cfg = config(run__dir=str(tmp_path), doctor__preflight=True)
    monkeypatch.setenv("RANK", "0")
    assert drun.preflight(config(run__dir=str(tmp_path), doctor__preflight=False),
                          tiny_mlp(), bundle) == []
    monkeypatch.setenv("RANK", "1")
    assert drun.preflight(cfg, tiny_mlp(), bundle) == []
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "doctor.json").write_text("{}")
    assert drun.preflight(cfg, tiny_mlp(), bundle, resume=True) == []
    assert capsys.readouterr().out == ""
    found = drun.preflight(cfg, tiny_mlp(), bundle, resume=False)
    out = capsys.readouterr().out
    assert found and out.startswith("preflight: the doctor's quick checks")
    assert f"details in {tmp_path / 'doctor.json'})" in out
    assert len(json.loads((tmp_path / "doctor.json").read_text())["findings"]) == len(found)


def synthetic_config(tmp_path, **over) -> Config:
    return config(run__dir=str(tmp_path / "run"), data__name="synthetic", data__num_samples=40,
                  data__input_shape=[8], data__num_classes=3, model__name="mlp", **over)


def test_ironloop_doctor_runs_every_check_at_full_size_and_writes_doctor_json(
        tmp_path, monkeypatch, capsys):
    seen = []
    found = [info("a", "fine"), Finding("b", "error", "bad", "", "the fix")]
    monkeypatch.setattr(drun, "check", lambda s, quick: seen.append((s, quick)) or list(found))
    monkeypatch.setattr(lr_find, "check_lr_find", lambda s, out: seen.append(out) or [
        info("lr_find", "swept")])
    cfg = synthetic_config(tmp_path)
    out = drun.doctor_config(cfg, lr_find=True)
    (s, quick), plot = seen
    assert quick is False and s.cfg is cfg and s.num_classes == 3 and len(s.train) == 32
    assert len(s.val) == 8 and plot == tmp_path / "run" / "lr_find.png"
    assert out == [*found, info("lr_find", "swept")]
    doctor_json = tmp_path / "run" / "doctor.json"
    assert [f["check"] for f in json.loads(doctor_json.read_text())["findings"]] == [
        "a", "b", "lr_find"]
    printed = capsys.readouterr().out
    assert printed.startswith("info: [a] fine\nerror: [b] bad\n    fix:   the fix\n"
                              "info: [lr_find] swept\ndoctor: 1 error(s), 2 passed (")
    assert printed.endswith(f" s; written to {doctor_json})\n")
    seen.clear()
    drun.doctor_config(cfg)
    assert len(seen) == 1  # no LR range test unless asked
    with pytest.raises(drun.DoctorError):
        drun.doctor_config(cfg, strict=True)
    with pytest.raises(drun.DoctorError):
        drun.doctor_config(synthetic_config(tmp_path, doctor__strict=True))


def test_the_preflight_prints_its_summary_and_stops_on_an_error_only_when_strict(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    seen = []
    found = [Finding("b", "error", "bad", "", "the fix")]
    monkeypatch.setattr(drun, "check", lambda s, quick, raise_step: seen.append(
        (s, quick, raise_step)) or list(found))
    bundle = SimpleNamespace(train=blobs(16), first_val=blobs(4, seed=1), test=blobs(2, seed=2),
                             num_classes=4)  # the data's class count, not the model's 3
    cfg = synthetic_config(tmp_path)
    step = Scripted(1.0)
    assert drun.preflight(cfg, tiny_mlp(), bundle, step_fn=step, loss_fn=F.mse_loss) == found
    ((s, quick, raise_step),) = seen
    assert quick is True and raise_step is True and s.step_fn is step and s.loss_fn is F.mse_loss
    assert s.num_classes == 4
    assert len(s.val) == 4 and len(s.test) == 2
    out = capsys.readouterr().out
    assert "error: [b] bad" in out and "doctor: 1 error(s) (" in out
    with pytest.raises(drun.DoctorError):
        drun.preflight(cfg, tiny_mlp(), bundle, strict=True)
    with pytest.raises(drun.DoctorError):
        drun.preflight(synthetic_config(tmp_path, doctor__strict=True), tiny_mlp(), bundle)
    drun.preflight(synthetic_config(tmp_path, doctor__strict=True), tiny_mlp(), bundle,
                   strict=False)


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


def test_a_check_that_raises_is_listed_under_its_own_name(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom")

    for name in ("check_labels", "check_finite_inputs", "check_leakage", "check_input_bound"):
        monkeypatch.setattr(data_checks, name, boom)
    for name in ("check_initial_loss", "check_probabilities", "check_overfit_batch",
                 "check_dead_parameters", "check_memory"):
        monkeypatch.setattr(mc, name, boom)
    monkeypatch.setattr(env_checks, "check_threads", boom)
    assert drun.outcomes(drun.check(make())) == {name: "skipped" for name in (
        "labels", "finite_inputs", "leakage", "threads", "initial_loss", "probabilities",
        "overfit_batch", "dead_parameters", "input_bound", "memory")}
