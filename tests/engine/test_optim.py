"""Param groups, schedulers and losses built from the config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ironloop.config import load_config
from ironloop.engine.optim import Loss, build_optimizer, build_scheduler, param_groups
from ironloop.errors import ConfigError


def test_biases_and_norm_weights_get_no_decay():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    groups = param_groups(model, 0.1, decay_all=False)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.shape for p in decay["params"]} == {torch.Size([8, 4]), torch.Size([2, 8])}
    assert len(no_decay["params"]) == 4  # two biases, the norm's weight and bias
    assert len(param_groups(model, 0.1, decay_all=True)) == 1


@pytest.mark.parametrize("decay_all, groups", [("false", [0.1, 0.0]), ("true", [0.1])])
def test_optim_decay_bias_and_norm_reaches_the_optimizers_groups(decay_all, groups):
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    optim = load_config(None, ["optim.weight_decay=0.1",
                               f"optim.decay_bias_and_norm={decay_all}"]).optim
    assert [g["weight_decay"] for g in build_optimizer(model, optim).param_groups] == groups


def test_optimizer_choice_and_lr():
    model = nn.Linear(2, 2)
    for name, cls in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                      ("sgd", torch.optim.SGD)):
        opt = build_optimizer(model, load_config(None, [f"optim.name={name}",
                                                        "optim.lr=0.5"]).optim)
        assert isinstance(opt, cls) and opt.param_groups[0]["lr"] == 0.5


def test_any_torch_optim_class_by_name_takes_lr_weight_decay_and_args():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    rms = build_optimizer(model, load_config(None, ["optim.name=RMSprop", "optim.lr=0.5",
                                                    "optim.args={alpha: 0.9}"]).optim)
    assert isinstance(rms, torch.optim.RMSprop) and rms.defaults["alpha"] == 0.9
    assert [g["weight_decay"] for g in rms.param_groups] == [0.01, 0.0]  # decay groups kept
    lbfgs = build_optimizer(model, load_config(None, ["optim.name=LBFGS",
                                                      "optim.args={history_size: 3}"]).optim)
    assert isinstance(lbfgs, torch.optim.LBFGS) and lbfgs.defaults["history_size"] == 3


def test_an_unknown_optimizer_name_or_argument_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError, match=r"optim.name='lbfgs': .*torch.optim class \(LBFGS: "):
        load_config(None, ["optim.name=lbfgs"])
    with pytest.raises(ConfigError, match=r"optim.name='Optimizer': must be one of adamw"):
        load_config(None, ["optim.name=Optimizer"])
    cfg = load_config(None, ["optim.name=LBFGS", "optim.args={bogus: 1}"]).optim
    with pytest.raises(ConfigError, match="unexpected keyword argument 'bogus'; see help"):
        build_optimizer(nn.Linear(2, 2), cfg)


@pytest.mark.parametrize("name", ["constant", "warmup_cosine", "onecycle", "cosine",
                                  "cosine_restarts", "plateau"])
def test_every_schedule_builds_with_its_cadence(name):
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cfg = load_config(None, [f"schedule.name={name}", "schedule.warmup_steps=3"]).schedule
    sched, cadence = build_scheduler(opt, cfg, steps_per_epoch=10, total_steps=50)
    assert cadence == ("eval" if name == "plateau" else "step")
    assert (sched is None) == (name == "constant")


def test_cosine_starts_at_full_lr_and_ignores_warmup_steps():
    # warmup_steps is warmup_cosine's: plain cosine decays from the configured LR at step 0.
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cfg = load_config(None, ["schedule.name=cosine", "schedule.warmup_steps=3",
                             "schedule.eta_min=0.01"]).schedule
    sched, _ = build_scheduler(opt, cfg, steps_per_epoch=10, total_steps=10)
    assert isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_cosine_restarts_returns_to_full_lr_every_epoch_by_default():
    # schedule.T_0 unset: one cosine cycle per epoch (steps_per_epoch), then a warm restart
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cfg = load_config(None, ["schedule.name=cosine_restarts", "schedule.warmup_steps=3"]).schedule
    sched, _ = build_scheduler(opt, cfg, steps_per_epoch=4, total_steps=12)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == lrs[4] == pytest.approx(0.1) and lrs[3] < lrs[2] < lrs[1] < 0.1


def per_sample_mean_is_additive(loss: Loss, out: torch.Tensor, y: torch.Tensor) -> None:
    whole = loss(out, y)
    parts = loss(out[:3], y[:3]) * 3 / 7 + loss(out[3:], y[3:]) * 4 / 7
    torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("name", ["cross_entropy", "bce_logits", "mse", "huber", "kl_div"])
def test_losses_are_per_sample_means_so_accumulation_is_exact(name):
    torch.manual_seed(0)
    cfg = load_config(None, [f"loss.name={name}", "loss.class_weights=[1.0, 2.0, 0.5]"]).loss
    out, y = torch.randn(7, 3), torch.randint(0, 3, (7,))
    per_sample_mean_is_additive(Loss(cfg, 3), out, y)


def test_class_weights_scale_the_last_dim_of_a_sequence_output():
    # An (N, T, C) output: the weights are per class, the last dim, whatever T is.
    cfg = load_config(None, ["loss.name=mse", "loss.class_weights=[2.0, 0.0, 1.0]"]).loss
    out, y = torch.zeros(2, 5, 3), torch.ones(2, 5, 3)
    y[..., 0] = 2.0  # squared errors (4, 1, 1) per step, weighted (8, 0, 1): mean 3 (unweighted 2)
    torch.testing.assert_close(Loss(cfg, 3)(out, y), torch.tensor(3.0))


def test_cross_entropy_label_smoothing_and_weight_count_check():
    cfg = load_config(None, ["loss.label_smoothing=0.1"]).loss
    out, y = torch.randn(5, 4), torch.randint(0, 4, (5,))
    expected = nn.functional.cross_entropy(out, y, label_smoothing=0.1)
    torch.testing.assert_close(Loss(cfg)(out, y), expected)
    with pytest.raises(ConfigError, match="one weight per class"):
        Loss(load_config(None, ["loss.class_weights=[1, 2]"]).loss, num_classes=3)


@pytest.mark.parametrize("name", ["cross_entropy", "mse"])
def test_class_weights_follow_the_output_to_its_device(name):
    """The weights live on the host; an output on another device (a GPU; here torch's shape-only
    "meta" device) gets them on its own device."""
    cfg = load_config(None, [f"loss.name={name}", "loss.class_weights=[2.0, 0.0, 1.0]"]).loss
    out = torch.empty(4, 3, device="meta")
    y = torch.zeros(4, dtype=torch.long, device="meta")
    assert Loss(cfg, 3)(out, y).device.type == "meta"


def test_cross_entropy_class_weights_scale_each_samples_loss_by_its_class_weight():
    cfg = load_config(None, ["loss.class_weights=[2.0, 0.0, 1.0]"]).loss
    out, y = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), \
        torch.tensor([0, 1, 2, 0, 1, 2])
    per = nn.functional.cross_entropy(out, y, reduction="none")
    # a per-sample mean of the weighted losses, not torch's weight-normalised mean
    weighted = per * torch.tensor([2.0, 0.0, 1.0])[y]
    torch.testing.assert_close(Loss(cfg, 3)(out, y), weighted.mean())


@pytest.mark.parametrize("name", ["bce_logits", "mse", "huber", "kl_div"])
def test_integer_targets_are_one_hot_over_the_outputs_classes_even_when_a_batch_lacks_the_last(
        name):
    cfg = load_config(None, [f"loss.name={name}"]).loss
    out, y = torch.zeros(4, 3), torch.tensor([0, 1, 1, 0])  # class 2 not in this batch
    torch.testing.assert_close(Loss(cfg, 3)(out, y),
                               Loss(cfg, 3)(out, nn.functional.one_hot(y, 3).float()))


def test_a_given_scheduler_is_used_as_it_is_and_a_factory_is_called_with_the_optimizer():
    from ironloop.engine.optim import resolve_scheduler
    from ironloop.errors import UserError

    cfg = load_config(None, []).schedule
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    given = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    assert resolve_scheduler(given, opt, cfg, 4, 8) == (given, "step")
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert resolve_scheduler(plateau, opt, cfg, 4, 8) == (plateau, "eval")
    made = []

    def factory(o):
        made.append(torch.optim.lr_scheduler.StepLR(o, step_size=2))
        return made[-1]

    assert resolve_scheduler(factory, opt, cfg, 4, 8) == (made[0], "step")
    assert made[0].optimizer is opt
    other = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(UserError) as e:
        resolve_scheduler(torch.optim.lr_scheduler.StepLR(other, 3), opt, cfg, 4, 8)
    assert str(e.value) == ("scheduler= is bound to another optimizer than the one fit() uses; "
                            "pass optimizer= too, or pass the scheduler as a factory "
                            "factory(optimizer)")


def test_a_given_optimizer_must_be_one_and_hold_the_model_s_parameters():
    from ironloop.engine.optim import resolve_optimizer
    from ironloop.errors import UserError

    model, cfg = nn.Linear(2, 1), load_config(None, []).optim
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    assert resolve_optimizer(mine, model, cfg) is mine
    made = resolve_optimizer(lambda p: torch.optim.Adam(p, lr=0.1), model, cfg)
    assert isinstance(made, torch.optim.Adam)
    with pytest.raises(UserError, match=r"^optimizer= must be a torch.optim.Optimizer or a "
                                        r"factory factory\(params\) returning one; its factory "
                                        r"returned list$"):
        resolve_optimizer(lambda p: list(p), model, cfg)
    other = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(UserError, match=r"^optimizer= holds none of the model's parameters; "
                                        r"build it from model.parameters\(\) \(of the model "
                                        r"passed to fit\) or pass a factory$"):
        resolve_optimizer(other, model, cfg)


@pytest.mark.parametrize("name", ["bce_logits", "mse", "huber", "kl_div"])
def test_kl_sums_over_the_distribution_and_the_others_average_over_the_outputs(name):
    """No class weights: each loss is torch's own, KL's reduction the batchmean its docs ask
    for (a sum over each distribution), the others' the mean over every element."""
    g = torch.Generator().manual_seed(0)
    out, target = torch.randn(5, 4, generator=g), torch.rand(5, 4, generator=g)
    target = target / target.sum(-1, keepdim=True)  # a distribution per sample
    F = nn.functional
    want = {"bce_logits": lambda: F.binary_cross_entropy_with_logits(out, target),
            "mse": lambda: F.mse_loss(out, target),
            "huber": lambda: F.huber_loss(out, target, delta=1.0),
            "kl_div": lambda: F.kl_div(out.log_softmax(-1), target, reduction="batchmean")}
    cfg = load_config(None, [f"loss.name={name}"]).loss
    torch.testing.assert_close(Loss(cfg, 4)(out, target), want[name]())


def test_the_kernel_is_what_the_optimizer_was_built_with_or_torch_s_default_for_its_device():
    from ironloop.engine.optim import kernel

    params = list(nn.Linear(2, 2).parameters())
    assert kernel(torch.optim.AdamW(params, fused=True)) == "fused"
    assert kernel(torch.optim.AdamW(params, foreach=True)) == "foreach"  # asked for, on a CPU
    assert kernel(torch.optim.AdamW(params, foreach=False)) == "loop"
    assert kernel(torch.optim.AdamW(params)) == "loop"  # neither: foreach only on CUDA


def test_onecycle_peaks_at_10x_the_lr_unless_given_at_pct_start_of_the_run():
    def lrs(*overrides):
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        cfg = load_config(None, ["schedule.name=onecycle", *overrides]).schedule
        sched, _ = build_scheduler(opt, cfg, steps_per_epoch=10, total_steps=20)
        assert sched.total_steps == 20
        seen = []
        for _ in range(20):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen

    default = lrs("schedule.pct_start=0.25")
    assert max(default) == pytest.approx(1.0) and default.index(max(default)) == 4
    given = lrs("schedule.max_lr=0.5", "schedule.pct_start=0.5")
    assert max(given) == pytest.approx(0.5) and given.index(max(given)) == 9


def test_the_optimizer_gets_optim_s_settings_and_is_fused_only_where_torch_has_the_kernel():
    cfg = load_config(None, ["optim.name=sgd", "optim.momentum=0.7"]).optim
    assert build_optimizer(nn.Linear(2, 2), cfg).defaults["momentum"] == 0.7
    cfg = load_config(None, ["optim.name=adam", "optim.betas=[0.8, 0.9]", "optim.eps=1e-6"]).optim
    adam = build_optimizer(nn.Linear(2, 2), cfg)
    assert (adam.defaults["betas"], adam.defaults["eps"]) == ((0.8, 0.9), 1e-6)
    adamw = load_config(None, []).optim
    assert build_optimizer(nn.Linear(2, 2), adamw).defaults["fused"] is True  # a CPU has it
    # no fused kernel on this device (meta: shapes only): torch's default kernel
    assert not build_optimizer(nn.Linear(2, 2).to("meta"), adamw).defaults["fused"]


def test_warmup_cosine_without_warmup_steps_is_the_plain_cosine_over_the_run():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cfg = load_config(None, ["schedule.name=warmup_cosine", "schedule.warmup_steps=0",
                             "schedule.eta_min=0.01"]).schedule
    sched, cadence = build_scheduler(opt, cfg, steps_per_epoch=10, total_steps=8)
    assert isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR) and cadence == "step"
    assert (sched.T_max, sched.eta_min) == (8, 0.01)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    for _ in range(8):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_every_schedule_key_reaches_torchs_scheduler():
    def built(*overrides: str):
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        cfg = load_config(None, list(overrides)).schedule
        return build_scheduler(opt, cfg, steps_per_epoch=4, total_steps=12)[0]

    plateau = built("schedule.name=plateau", "schedule.factor=0.3", "schedule.patience=7")
    assert (plateau.factor, plateau.patience) == (0.3, 7)
    restarts = built("schedule.name=cosine_restarts", "schedule.T_0=5", "schedule.T_mult=2",
                     "schedule.eta_min=0.02")
    assert (restarts.T_0, restarts.T_mult, restarts.eta_min) == (5, 2, 0.02)
    warm = built("schedule.name=warmup_cosine", "schedule.warmup_steps=3",
                 "schedule.warmup_start_factor=0.25")
    linear, cosine = warm._schedulers
    assert (linear.start_factor, linear.total_iters, warm._milestones) == (0.25, 3, [3])
    assert cosine.T_max == 12 - 3


def test_loss_huber_delta_sets_where_the_loss_turns_linear():
    cfg = load_config(None, ["loss.name=huber", "loss.huber_delta=0.5"]).loss
    out, target = torch.tensor([[2.0]]), torch.tensor([[0.0]])
    # |error| 2 > delta 0.5: delta * (|error| - delta / 2) = 0.5 * 1.75
    assert Loss(cfg)(out, target).item() == pytest.approx(0.875)


def test_an_optimizer_is_foreign_only_when_it_is_not_the_class_optim_name_builds():
    from ironloop.engine.optim import foreign

    model, cfg = nn.Linear(2, 2), load_config(None, ["optim.name=adam"]).optim
    assert foreign(build_optimizer(model, cfg), cfg) == ""
    assert foreign(torch.optim.SGD(model.parameters(), lr=0.1), cfg) == "SGD"


def test_a_fused_kernel_is_open_to_a_class_taking_fused_with_host_float_parameters_only():
    from ironloop.engine.optim import fused_open

    params = list(nn.Linear(2, 2).parameters())
    assert fused_open(torch.optim.AdamW(params)) is True  # a CPU has the kernel
    assert fused_open(torch.optim.LBFGS(params)) is False  # takes no fused argument
    assert fused_open(torch.optim.AdamW(nn.Linear(2, 2).to("meta").parameters())) is False


@pytest.mark.parametrize("keys, fused, foreach", [
    (["optim.foreach=true"], None, True),  # asked for: not fused, although a CPU has it
    (["optim.foreach=false"], None, False),
    (["optim.fused=false"], False, None),  # fused refused: torch's default kernel
])
def test_optim_fused_and_foreach_reach_the_optimizer_and_either_one_stops_the_default_fused(
        keys, fused, foreach):
    opt = build_optimizer(nn.Linear(2, 2), load_config(None, keys).optim)
    assert (opt.defaults["fused"], opt.defaults["foreach"]) == (fused, foreach)


def test_kl_div_takes_the_softmax_over_the_last_dim_of_a_sequence_output():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 3, 4, generator=g)
    target = torch.rand(2, 3, 4, generator=g).softmax(-1)  # a distribution per position
    per = nn.functional.kl_div(out.log_softmax(-1), target, reduction="none")
    want = per.reshape(2, -1).sum(-1).mean()  # summed over each sample's distributions
    torch.testing.assert_close(Loss(load_config(None, ["loss.name=kl_div"]).loss)(out, target),
                               want)


def test_warmup_is_cut_to_leave_the_cosine_at_least_one_step_and_a_0_step_run_is_1_step():
    def built(total_steps: int, *overrides: str):
        opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        cfg = load_config(None, ["schedule.name=warmup_cosine", *overrides]).schedule
        return build_scheduler(opt, cfg, steps_per_epoch=4, total_steps=total_steps)[0]

    warm = built(4, "schedule.warmup_steps=10", "schedule.eta_min=0.03")
    linear, cosine = warm._schedulers
    assert (linear.total_iters, warm._milestones, cosine.T_max) == (3, [3], 1)
    assert cosine.eta_min == 0.03
    assert built(0, "schedule.warmup_steps=5").T_max == 1  # no warmup left: the plain cosine
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cosine_cfg = load_config(None, ["schedule.name=cosine"]).schedule
    assert build_scheduler(opt, cosine_cfg, steps_per_epoch=4, total_steps=0)[0].T_max == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_output_s_loss_is_computed_in_float32(dtype):
    out, y = torch.randn(4, 3).to(dtype), torch.tensor([0, 1, 2, 0])
    for name in ("cross_entropy", "mse"):
        loss = Loss(load_config(None, [f"loss.name={name}"]).loss)(out, y)
        assert loss.dtype == torch.float32


def test_class_weights_are_checked_against_the_class_count_only_when_it_is_known():
    cfg = load_config(None, ["loss.class_weights=[1.0, 2.0]"]).loss
    assert Loss(cfg, None).weights.tolist() == [1.0, 2.0]
    assert Loss(cfg, 2).weights.tolist() == [1.0, 2.0]


def test_a_model_without_biases_or_norms_gets_one_group_and_frozen_parameters_none():
    model = nn.Sequential(nn.Linear(2, 3, bias=False), nn.Linear(3, 2))
    model[1].requires_grad_(False)
    groups = param_groups(model, 0.1, decay_all=False)
    assert len(groups) == 1 and [p.shape for p in groups[0]["params"]] == [torch.Size([3, 2])]
    lbfgs = build_optimizer(model, load_config(None, ["optim.name=LBFGS"]).optim)
    assert [p.shape for p in lbfgs.param_groups[0]["params"]] == [torch.Size([3, 2])]


def test_a_factory_that_returns_no_scheduler_is_refused_naming_what_it_returned():
    from ironloop.engine.optim import resolve_scheduler
    from ironloop.errors import UserError

    cfg = load_config(None, []).schedule
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    stateless = type("Stateless", (), {"step": lambda self: None})
    for made, name in ((lambda o: 3, "int"), (lambda o: stateless(), "Stateless")):
        with pytest.raises(UserError) as e:
            resolve_scheduler(made, opt, cfg, 4, 8)
        assert str(e.value) == ("scheduler= must be a torch LR scheduler or a factory "
                                f"factory(optimizer) returning one; got {name}")
