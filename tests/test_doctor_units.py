"""The doctor's checks one at a time, in process, on tiny models and data built here: each
finding's severity, numbers and message at both sides of every threshold. A scripted step (its
loss a given sequence of values) puts a check exactly on its boundary; tests/test_doctor.py
runs the checks together on real models."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ironloop.config import Config
from ironloop.data.loader import TensorData
from ironloop.engine.step_fns import classification_step, lm_step
from ironloop.errors import UserError
from ironloop.tools.doctor import data_checks, env_checks, logs, lr_find
from ironloop.tools.doctor import model_checks as mc
from ironloop.tools.doctor import run as drun
from ironloop.tools.doctor.findings import Finding, info
from ironloop.tools.doctor.subject import DoctorSubject, head, labels_of, repeated

from .conftest import blobs, tiny_mlp


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


# -- findings ------------------------------------------------------------------------------------

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


# -- subject -------------------------------------------------------------------------------------

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
    assert torch.equal(y, blobs(6, seed=1).y[:len(y)]) and len(y) > 0
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


# -- env: threads ----------------------------------------------------------------------------------

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


# -- model checks: expected loss and floor ---------------------------------------------------------

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


# -- model checks: initial loss --------------------------------------------------------------------

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


# -- model checks: probabilities -----------------------------------------------------------------

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


# -- model checks: overfit one batch ---------------------------------------------------------------

def overfit(*losses, steps=5, batch=None, **kw) -> tuple[Finding, Scripted]:
    step = Scripted(*losses)
    (f,) = mc.check_overfit_batch(make(step=step, **kw), batch or batch_of(), steps)
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
    assert "cannot fit even one batch" in f.cause and f.fix.startswith("raise optim.lr")


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


# -- model checks: a language model's overfit ------------------------------------------------------

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


# -- model checks: dead parameters -----------------------------------------------------------------

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
