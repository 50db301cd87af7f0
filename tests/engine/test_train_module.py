"""engine/train_module.py's parts, in this process: which optimizers take a closure and what
they are refused with, the closure's later calls, and the schedule's hold past a finite end."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ironloop.config import ClipConfig
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.train_module import TrainModule, check_closure, takes_closure
from ironloop.errors import ConfigError
from ironloop.parallel.world import World


def module(opt_of=lambda p: torch.optim.SGD(p, lr=1.0), scheduler_of=None, total_steps=8,
           schedule_steps=0, max_norm=0.0, step_fn=None) -> TrainModule:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = opt_of(model.parameters())
    return TrainModule(model=model, raw_model=model, optimizer=opt,
                       scheduler=scheduler_of(opt) if scheduler_of else None, schedule_on="step",
                       scaler=None, step_fn=step_fn, carry=None, device=torch.device("cpu"),
                       precision="fp32", clip=ClipConfig(max_norm=max_norm),
                       total_steps=total_steps, schedule_steps=schedule_steps)


class _NoClosure(torch.optim.SGD):
    def step(self, closure=None):  # takes one, does not need one
        return super().step(closure)


def test_only_an_optimizer_whose_step_needs_a_closure_takes_one():
    params = [nn.Parameter(torch.zeros(1))]
    assert takes_closure(torch.optim.LBFGS(params)) is True
    assert takes_closure(torch.optim.SGD(params, lr=0.1)) is False
    assert takes_closure(_NoClosure(params, lr=0.1)) is False


@pytest.mark.parametrize("accumulation, precision, ranks, stateful, why", [
    (2, "fp32", 1, False, "train.accumulation_steps > 1: its closure recomputes one batch, not a "
                          "window; set train.accumulation_steps=1"),
    (1, "fp16", 1, False, "train.precision=fp16: GradScaler does not support closures; use bf16 "
                          "or fp32"),
    (1, "bf16", 2, False, "several processes: each rank's closure count follows its own loss, "
                          "and DDP would wait; train it in one process"),
    (1, "fp32", 1, True, "a stateful step: each closure call would move its state again; carry "
                         "the state in the model, or use another optimizer"),
])
def test_a_closure_optimizer_is_refused_what_it_cannot_honour_saying_why(
        accumulation, precision, ranks, stateful, why):
    lbfgs = torch.optim.LBFGS([nn.Parameter(torch.zeros(1))])
    with pytest.raises(ConfigError) as e:
        check_closure(lbfgs, accumulation, precision, World(size=ranks), stateful)
    assert str(e.value) == ("optimizer LBFGS takes a closure (step(closure)), which ironloop "
                            f"cannot run with {why}")


def test_a_closure_optimizer_in_one_plain_process_and_any_other_optimizer_pass():
    params = [nn.Parameter(torch.zeros(1))]
    check_closure(torch.optim.LBFGS(params), 1, "bf16", World(), False)
    check_closure(torch.optim.SGD(params, lr=0.1), 4, "fp16", World(size=2), True)


def test_the_closure_returns_the_loop_s_loss_first_then_recomputes_clipped_gradients():
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    def step(model, batch):
        return ((model(batch[0]) - batch[1]) ** 2).mean() * 100, {}

    m = module(lambda p: torch.optim.LBFGS(p), max_norm=0.5, step_fn=step)
    loss = step(m.model, (x, y))[0]
    closure = m.closure((x, y), loss)
    assert closure is not None
    first = closure()
    assert torch.equal(first, loss.detach()) and not first.requires_grad
    m.optimizer.zero_grad(set_to_none=True)
    again = closure()
    assert float(again) == pytest.approx(float(loss.detach()))  # the same batch, the same weights
    norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in m.params))
    assert norm == pytest.approx(0.5, rel=1e-4)  # clipped to clip.max_norm as the loop's first
    assert module().closure((x, y), loss) is None  # SGD: no closure


def test_a_finite_schedule_in_a_longer_run_holds_its_last_lr():
    cosine = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)  # noqa: E731
    extended = module(scheduler_of=cosine, total_steps=8, schedule_steps=4)
    extended.optimizer.step()  # (no gradients: no update) torch wants it before the schedule's
    for step in range(8):
        extended.step_schedule(step)
    # steps 0..3 use the schedule's 4 LRs; from step 3 on the LR holds
    assert extended.scheduler.last_epoch == 3
    assert extended.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 3 / 4)))
    whole = module(scheduler_of=cosine, total_steps=4, schedule_steps=4)
    whole.optimizer.step()
    for step in range(6):  # a run as long as its schedule steps it every time
        whole.step_schedule(step)
    assert whole.scheduler.last_epoch == 6


def test_the_optimizer_step_steps_the_schedule_at_the_run_s_step():
    cosine = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2)  # noqa: E731
    m = module(scheduler_of=cosine, total_steps=5, schedule_steps=2)
    p, meter = Progress(), Meter(torch.device("cpu"))
    lrs = []
    for _ in range(4):
        m.model(torch.ones(1, 3)).sum().backward()
        m.optimizer_step(p, meter, World())
        lrs.append(m.lr)
    assert p.step == 4 and meter.steps == 4
    assert lrs == [pytest.approx(1.0), pytest.approx(0.5), pytest.approx(0.5),
                   pytest.approx(0.5)]
    assert m.scheduler.last_epoch == 1


def test_a_finished_onecycle_gets_its_last_step_s_lr_back_when_the_run_is_extended():
    onecycle = lambda opt: torch.optim.lr_scheduler.OneCycleLR(  # noqa: E731
        opt, max_lr=1.0, total_steps=4)
    m = module(scheduler_of=onecycle, total_steps=6, schedule_steps=4)
    last = None
    for _ in range(4):
        last = m.optimizer.param_groups[0]["lr"]
        m.optimizer.step()
        m.scheduler.step()  # the 4th steps past the end, to an extrapolated LR
    assert m.optimizer.param_groups[0]["lr"] != pytest.approx(last)
    m.hold_onecycle()
    assert m.scheduler.last_epoch == 3
    assert m.optimizer.param_groups[0]["lr"] == pytest.approx(last)
    same = module(scheduler_of=onecycle, total_steps=4, schedule_steps=4)
    before = same.optimizer.param_groups[0]["lr"]
    same.hold_onecycle()  # not extended: nothing to hold
    assert same.optimizer.param_groups[0]["lr"] == before and same.scheduler.last_epoch == 0


def test_an_fp16_step_with_non_finite_gradients_is_skipped_and_counted():
    m = module()
    m.scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = m.model.weight.detach().clone()
    p, meter = Progress(), Meter(torch.device("cpu"))
    m.backward(m.model(torch.full((1, 3), float("inf"))).sum())
    m.optimizer_step(p, meter, World())
    assert torch.equal(m.model.weight.detach(), before)  # GradScaler skipped the update
    assert float(meter.skipped) == 1.0 and meter.flush_window()["skipped"] == 1
    assert m.scaler.get_scale() == 2.0  # and backed its scale off


def test_a_model_with_nothing_to_train_is_refused_saying_what_it_holds():
    from ironloop.engine.train_module import check_model
    from ironloop.errors import UserError

    fix = ("; unfreeze what should learn (p.requires_grad_(True)), or hold its weights in "
           "nn.Parameter (a buffer or a plain tensor attribute is not trained)")
    with pytest.raises(UserError) as empty:
        check_model(nn.Module())
    assert str(empty.value) == "the model has nothing to train: it has no parameters" + fix
    held = nn.Module()
    for name in ("a", "b", "c", "d"):
        held.register_buffer(name, torch.zeros(1))
    with pytest.raises(UserError) as buffers:
        check_model(held)
    assert str(buffers.value) == ("the model has nothing to train: it has no parameters, only "
                                  "buffers (a, b, c)" + fix)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(UserError) as frozen_error:
        check_model(frozen)
    assert str(frozen_error.value) == ("the model has nothing to train: all 2 of its parameter "
                                       "tensors are frozen (requires_grad=False)" + fix)
    check_model(nn.Linear(2, 2))  # something to train: no word


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
@pytest.mark.parametrize("fused", [False, True])
def test_a_guard_skipped_step_logs_its_pre_clip_grad_norm_with_clipping_on_or_off(max_norm,
                                                                                   fused):
    from ironloop.config import GuardConfig
    from ironloop.guard.verdict import device_verdicts

    m = module(lambda p: torch.optim.SGD(p, lr=1.0, fused=fused), max_norm=max_norm)
    m.verdicts = device_verdicts(GuardConfig(), torch.device("cpu"), torch.float32)
    m.verdicts.start(m.optimizer, False)
    assert m.verdicts.masks is fused  # fused: skipped in the kernel; else read on the host
    before = [p.detach().clone() for p in m.params]
    p, meter = Progress(), Meter(torch.device("cpu"))
    m.verdicts.rebase(meter, 0)
    m.model(torch.full((1, 3), float("inf"))).sum().backward()  # weight.grad inf, bias.grad 1
    m.optimizer_step(p, meter, World())
    assert all(torch.equal(a.detach(), b) for a, b in zip(m.params, before))  # not updated
    assert m.model.bias.grad.tolist() == [1.0, 1.0]  # the bad step was not clipped
    assert float(meter.grad_norm) == math.inf  # docs: metrics.jsonl's grad_norm is pre-clip
    assert float(m.verdicts.pending[0].norm) == math.inf  # and guard.jsonl's, the same
    assert meter.flush_window()["clipped"] == 0
    assert m.verdicts.known_bad is not fused  # fused: no host read of the verdict


def test_only_an_extended_run_s_finished_onecycle_gets_its_lr_held():
    def stepped(scheduler_of, total_steps):
        m = module(scheduler_of=scheduler_of, total_steps=total_steps, schedule_steps=4)
        for _ in range(4):
            m.optimizer.step()
            m.scheduler.step()  # to last_epoch 4: one past the schedule's end
        lr = m.optimizer.param_groups[0]["lr"]
        m.hold_onecycle()
        return m, lr

    onecycle = lambda opt: torch.optim.lr_scheduler.OneCycleLR(  # noqa: E731
        opt, max_lr=1.0, total_steps=4)
    whole, lr = stepped(onecycle, total_steps=4)  # the run is the schedule: nothing to hold
    assert whole.scheduler.last_epoch == 4 and whole.optimizer.param_groups[0]["lr"] == lr
    cosine = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)  # noqa: E731
    other, lr = stepped(cosine, total_steps=8)  # not a onecycle: step_schedule holds it instead
    assert other.scheduler.last_epoch == 4 and other.optimizer.param_groups[0]["lr"] == lr


def test_the_step_logs_the_pre_clip_norm_of_the_gradients_there_are_and_clips_them_to_max_norm():
    m = module(max_norm=0.5)
    m.model.weight.grad = torch.full((2, 3), 2.0)  # norm sqrt(24); the bias has no gradient
    p, meter = Progress(), Meter(torch.device("cpu"))
    m.optimizer_step(p, meter, World())
    assert float(meter.grad_norm) == pytest.approx(math.sqrt(24))
    assert float(m.model.weight.grad.norm()) == pytest.approx(0.5, rel=1e-5)
    assert m.model.bias.grad is None and meter.flush_window()["clipped"] == 1


@pytest.mark.parametrize("where, step", [("training", 4), ("evaluation", 3)])
def test_a_step_function_s_error_gains_a_note_naming_the_step_epoch_and_batch(where, step):
    def broken(model, batch):
        raise ValueError("bad batch")

    m = module(step_fn=broken)
    with pytest.raises(ValueError) as e:
        m.forward(m.model, (torch.zeros(2, 3),), where, Progress(epoch=1, step=3))
    assert str(e.value) == "bad batch"  # the user's error as it came, its traceback kept
    if hasattr(e.value, "add_note"):  # Python 3.11+
        assert e.value.__notes__ == [f"ironloop: raised in {where} at step {step}, epoch 2; "
                                     f"batch: a tuple (Tensor[2, 3] float32)"]


def test_a_meta_device_model_is_refused_before_anything_runs():
    from ironloop.engine.train_module import check_model
    from ironloop.errors import UserError

    with pytest.raises(UserError, match=r"^the model is on the meta device \(its tensors have "
                                        r"shapes, no values\); materialize it first"):
        check_model(nn.Linear(2, 2).to("meta"))


def test_a_frozen_run_steps_at_lr_0_and_leaves_the_schedule_s_lr_in_the_groups():
    m = module()
    m.frozen = True
    before = m.model.weight.detach().clone()
    m.model(torch.ones(1, 3)).sum().backward()
    m.optimizer_step(Progress(), Meter(torch.device("cpu")), World())
    assert torch.equal(m.model.weight.detach(), before) and m.lr == 0.0
    assert m.optimizer.param_groups[0]["lr"] == 1.0
    assert module().lr_factor == 1.0


def test_a_closure_optimizer_steps_with_its_closure():
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    def step(model, batch):
        return ((model(batch[0]) - batch[1]) ** 2).mean(), {}

    m = module(lambda p: torch.optim.LBFGS(p, max_iter=3), step_fn=step)
    loss = step(m.model, (x, y))[0]
    loss.backward()
    m.optimizer_step(Progress(), Meter(torch.device("cpu")), World(), m.closure((x, y), loss))
    assert step(m.model, (x, y))[0].item() < loss.item()  # LBFGS evaluated it and moved


def test_a_plateau_schedule_is_not_stepped_per_optimizer_step():
    plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # noqa: E731
    m = module(scheduler_of=plateau)
    m.schedule_on = "eval"
    epoch = m.scheduler.last_epoch
    m.step_schedule(0)  # step() without a metric would fail; not called at all
    assert m.scheduler.last_epoch == epoch


def test_an_fp16_step_the_guard_refuses_on_the_host_keeps_the_scale_and_the_next_step_runs():
    from ironloop.config import GuardConfig
    from ironloop.guard.verdict import device_verdicts

    m = module()  # SGD without fused: the verdict is read on the host
    m.scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    m.verdicts = device_verdicts(GuardConfig(), torch.device("cpu"), torch.float32)
    m.verdicts.start(m.optimizer, False)
    p, meter = Progress(), Meter(torch.device("cpu"))
    m.verdicts.rebase(meter, 0)
    m.backward(m.model(torch.ones(1, 3)).sum())
    meter.loss_sum = meter.loss_sum + math.nan  # the window's loss: non-finite, gradients not
    before = m.model.weight.detach().clone()
    m.optimizer_step(p, meter, World())
    assert m.verdicts.known_bad and torch.equal(m.model.weight.detach(), before)
    assert m.scaler.get_scale() == 4.0  # a NaN loss says nothing of fp16's range
    m.verdicts.rebase(meter, 0)  # settled
    m.optimizer.zero_grad()
    before = m.model.weight.detach().clone()
    m.backward(m.model(torch.ones(1, 3)).sum())
    m.optimizer_step(p, meter, World())  # unscale_ again: the refused step's was forgotten
    assert not torch.equal(m.model.weight.detach(), before)
