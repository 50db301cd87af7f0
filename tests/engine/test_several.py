"""Several optimizers (engine/several.py): examples/gan.py's two-optimizer GAN trains from
fit() and from a config, equals its hand loop, resumes torch.equal (both optimizers' states
included) after a stop and after a SIGKILL, and what cannot apply is refused in one line."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

import ironloop
from examples import gan
from ironloop.callbacks import Callback
from ironloop.errors import ConfigError, UserError
from tests.conftest import REPO, logged_step, piped_stderr, wait_running

STEPS = 14  # 200 samples / 32 = 7 steps an epoch (the last one ragged), two epochs


def images(n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 8, 8, generator=g) * 16, torch.zeros(n, dtype=torch.long)


def config(run_dir, **more) -> dict:
    return {"run.dir": str(run_dir), "run.device": "cpu", "train.epochs": 2,
            "train.batch_size": 32, "log.progress": "off", "log.every_steps": 1,
            "checkpoint.every_steps": 3, **more}


def fresh() -> gan.GAN:
    torch.manual_seed(0)
    return gan.model()


def both() -> dict:
    return {"generator": gan.adam, "discriminator": gan.adam}


def fit(run_dir, model=None, callbacks=None, resume=False, **more):
    return ironloop.fit(model or fresh(), images(), None, config(run_dir, **more),
                        step_fn=gan.step, optimizer=both(), callbacks=callbacks,
                        resume=resume, overwrite=not resume)


def checkpoint(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    """Model and every optimizer's state (moments, step counts), tensor by tensor."""
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert set(a["optimizer"]) == {"generator", "discriminator"}
    for opt in a["optimizer"]:
        ours, theirs = a["optimizer"][opt]["state"], b["optimizer"][opt]["state"]
        assert ours.keys() == theirs.keys() and ours, opt
        for i in ours:
            for k, v in ours[i].items():
                assert torch.equal(v, theirs[i][k]), (opt, i, k)


def test_gan_from_fit_equals_its_hand_loop_each_optimizer_clipped_on_its_own(tmp_path):
    """clip.max_norm on: each update is clipped by its own parameters' norm. The generator's
    loss leaves gradients on the discriminator, which its next update drops."""
    ours, hand = fresh(), fresh()
    fit(tmp_path / "run", ours, **{"clip.max_norm": 0.05, "data.shuffle": False})

    opt_g, opt_d = gan.adam(hand.generator.parameters()), gan.adam(hand.discriminator.parameters())
    x = images()[0]
    torch.manual_seed(0)  # run.seed: what fit() seeds before the first step
    for _ in range(2):
        for i in range(0, len(x), 32):
            real = x[i:i + 32].flatten(1) / 8 - 1
            fake = hand.generator(torch.randn(len(real), gan.LATENT))
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            opt_d.zero_grad()
            d_loss = F.binary_cross_entropy_with_logits(hand.discriminator(real), ones) + \
                F.binary_cross_entropy_with_logits(hand.discriminator(fake.detach()), zeros)
            d_loss.backward()
            nn.utils.clip_grad_norm_(hand.discriminator.parameters(), 0.05)
            opt_d.step()
            opt_g.zero_grad()
            F.binary_cross_entropy_with_logits(hand.discriminator(fake), ones).backward()
            nn.utils.clip_grad_norm_(hand.generator.parameters(), 0.05)
            opt_g.step()
    for (name, a), b in zip(ours.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(a, b), name


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run, row):
        if run.step == self.step:
            run.stop()


def test_gan_from_fit_stopped_mid_epoch_resumes_torch_equal_optimizers_included(tmp_path):
    whole = fit(tmp_path / "whole")
    assert whole.results["steps"] == STEPS
    stopped = fit(tmp_path / "stopped", callbacks=[StopAt(9)])  # mid-epoch 2, off the cadence
    assert stopped.results["steps"] == 9
    resumed = fit(tmp_path / "stopped", resume=True)
    assert resumed.results["steps"] == STEPS
    assert_same_state(checkpoint(tmp_path / "stopped"), checkpoint(tmp_path / "whole"))


@pytest.mark.parametrize("fused", [False, True])  # fused: skipped in the kernel, no host read
def test_a_non_finite_loss_skips_that_optimizers_update_alone(tmp_path, fused):
    """The guard judges each update on its own loss and norm: a NaN discriminator loss at one
    step leaves the discriminator as it was, and the generator still updates."""
    seen = {}

    def adam(params):
        return torch.optim.Adam(params, lr=2e-4, betas=(0.5, 0.999), fused=fused)

    def step(model, batch, optimizers):
        if optimizers["discriminator"].state and "before" not in seen:  # the second step
            seen["before"] = {k: v.clone() for k, v in model.state_dict().items()}
            real = batch[0].flatten(1)
            d_loss = model.discriminator(real).mean() * float("nan")
            optimizers.update("discriminator", d_loss)
            g_loss = -model.discriminator(model.generator(torch.randn(len(real), 16))).mean()
            optimizers.update("generator", g_loss)
            seen["after"] = {k: v.clone() for k, v in model.state_dict().items()}
            return g_loss.detach(), {}
        return gan.step(model, batch, optimizers)

    ironloop.fit(fresh(), images(), None, config(tmp_path / "run", **{"train.max_steps": 3}),
                 step_fn=step, optimizer={"generator": adam, "discriminator": adam},
                 overwrite=True)
    before, after = seen["before"], seen["after"]
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("discrim"))
    assert not any(torch.equal(before[k], after[k]) for k in before if k.startswith("gener"))


def test_gan_from_a_config_optimizers_built_by_a_module_factory(tmp_path):
    """optim.name='module:factory' and train.step_fn: the config alone builds both."""
    cfg = {**config(tmp_path / "run"), "optim.name": "examples.gan:optimizers",
           "train.step_fn": "examples.gan:step"}
    result = ironloop.fit(fresh(), images(), None, cfg, overwrite=True)
    assert result.results["steps"] == STEPS
    assert set(checkpoint(tmp_path / "run")["optimizer"]) == {"generator", "discriminator"}


def _cli(run_dir, *extra):
    return [sys.executable, "-m", "ironloop", "train", "configs/gan.yaml", f"run.dir={run_dir}",
            "train.epochs=2", "checkpoint.every_steps=3", "log.every_steps=1",
            "log.progress=off", *extra]


@pytest.mark.slow
def test_gan_from_the_cli_sigkilled_resumes_torch_equal_optimizers_included(tmp_path):
    whole = subprocess.run(_cli(tmp_path / "whole"), cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert "skipped: model (the step updates several optimizers itself" in whole.stdout
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cli(run_dir), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    # 1438 digits / 64 = 23 steps an epoch: killed inside the first, past a checkpoint
    wait_running(proc, lambda: logged_step(run_dir) >= 8, "step 8", piped_stderr(proc))
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    resumed = subprocess.run(_cli(run_dir, "--resume"), cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_file(run_dir / "final.safetensors"), load_file(tmp_path / "whole" /
                                                               "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_state(checkpoint(run_dir), checkpoint(tmp_path / "whole"))


# ------------------------------------------------------------------ refusals and mistakes --
def test_a_list_of_optimizers_gets_the_intended_message_naming_the_dict(tmp_path):
    m = fresh()
    opts = [gan.adam(m.generator.parameters()), gan.adam(m.discriminator.parameters())]
    with pytest.raises(UserError, match=r"optimizer= must be a torch.optim.Optimizer or a "
                                        r"factory.*a dict \{name: optimizer\}.*got list"):
        ironloop.fit(m, images(), None, config(tmp_path / "run"), step_fn=gan.step,
                     optimizer=opts, overwrite=True)


@pytest.mark.parametrize(("override", "names"), [
    ({"train.accumulation_steps": 2}, "train.accumulation_steps"),
    ({"train.cuda_graph": True}, "train.cuda_graph"),
    ({"average.kind": "ema"}, "average.kind=ema"),
    ({"schedule.name": "cosine"}, "schedule.name=cosine"),
    ({"guard.rollback_to": "memory"}, "guard.rollback_to=memory"),
    ({"guard.spike_factor": 6.0}, "guard.spike_factor=6.0"),
])
def test_what_several_optimizers_cannot_run_with_is_refused_in_one_line(tmp_path, override,
                                                                       names):
    with pytest.raises(ConfigError, match=f"several optimizers cannot run with {names}") as e:
        fit(tmp_path / "run", **override)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("override", "ranks", "names"), [
    ({"train.precision": "fp16"}, 1, "train.precision=fp16"),  # fp16 needs CUDA to get here
    ({}, 2, "2 processes"),                                    # and this, torchrun
])
def test_fp16_and_several_processes_are_refused_in_one_line(override, ranks, names):
    from ironloop.config import Config
    from ironloop.engine.several import refuse

    cfg = Config().with_overrides(override)
    with pytest.raises(ConfigError, match=f"several optimizers cannot run with {names}"):
        refuse(cfg, ranks, scheduler_given=False)
    refuse(Config(), 1, scheduler_given=False)  # the defaults run


def test_a_scheduler_with_several_optimizers_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="several optimizers cannot run with a scheduler="):
        ironloop.fit(fresh(), images(), None, config(tmp_path / "run"), step_fn=gan.step,
                     optimizer=both(), scheduler=lambda opt: None, overwrite=True)


def _plain_step(model, batch):
    return model.discriminator(batch[0].flatten(1)).mean(), {}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"step_fn": _plain_step}, "takes no 'optimizers' parameter"),
    ({"step_fn": None}, "several optimizers need a step that updates each one"),
    ({"step_fn": gan.step, "optimizer": None}, "takes 'optimizers', and the run has one"),
    ({"optimizer": {"critic": gan.adam}}, "no submodule 'critic'.*children: generator, "
                                          "discriminator"),
    ({"optimizer": {"generator": 3}}, r"each value must be a torch.optim.Optimizer"),
])
def test_a_step_and_optimizers_that_do_not_fit_are_refused(tmp_path, kwargs, message):
    given = {"step_fn": gan.step, "optimizer": both(), **kwargs}
    with pytest.raises(UserError, match=message):
        ironloop.fit(fresh(), images(), None, config(tmp_path / "run"), overwrite=True,
                     **given)


def test_a_parameter_in_two_optimizers_is_refused(tmp_path):
    m = fresh()
    with pytest.raises(UserError, match="is in both optimizer 'all' and 'discriminator'"):
        ironloop.fit(m, images(), None, config(tmp_path / "run"), step_fn=gan.step,
                     optimizer={"all": gan.adam(m.parameters()), "discriminator": gan.adam},
                     overwrite=True)


def test_the_time_split_charges_each_updates_forward_backward_and_step_to_their_parts(
        tmp_path):
    """The step calls backward and step inside optimizers.update: without its marks, the whole
    step was charged to 'optimizer' and forward and backward read 0."""
    result = fit(tmp_path / "run")
    split = result.results["time_split"]
    assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer"] > 0
