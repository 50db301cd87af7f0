"""train.activation_checkpointing and train.compile: same training, same checkpoint keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ironloop
from ironloop.errors import ConfigError
from ironloop.parallel.wrap import checkpoint_activations, compile_model
from ironloop.state.io import load_verified
from tests.conftest import blobs, cfg


class Block(nn.Module):
    calls = 0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        Block.calls += 1
        return x + torch.relu(self.lin(x))


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 3))


def test_activation_checkpointing_recomputes_blocks_and_changes_nothing_else(tmp_path):
    Block.calls = 0
    plain = ironloop.fit(net(), blobs(), None, cfg(tmp_path, train__epochs=1))
    plain_calls, Block.calls = Block.calls, 0
    conf = {**cfg(tmp_path, train__epochs=1, train__activation_checkpointing=["Block"]),
            "run.dir": str(tmp_path / "ac")}
    ac = ironloop.fit(net(), blobs(), None, conf)
    # 7 steps x 2 blocks, plus the class-count probe; each block's forward runs again in backward
    assert plain_calls == 2 * 7 + 2 and Block.calls == plain_calls + 2 * 7
    for k, v in plain.model.state_dict().items():
        assert torch.equal(ac.model.state_dict()[k], v)  # same keys, same training
    with pytest.raises(ConfigError, match=r"no Blok module; its classes are Block, Linear"):
        ironloop.fit(net(), blobs(), None, {**conf, "train.activation_checkpointing": ["Blok"]},
                     overwrite=True)


def test_activation_checkpointing_names_every_class_the_model_lacks():
    with pytest.raises(ConfigError, match=r"\['Blocc', 'Blok'\]: the model has no Blocc, Blok "
                                          r"module; its classes are Block, Linear, Sequential$"):
        checkpoint_activations(net(), ["Blok", "Blocc"])


def test_compile_model_wraps_the_users_module_without_compiling_yet():
    model = net()
    compiled = compile_model(model, "default")  # torch compiles at the first forward
    assert isinstance(compiled, nn.Module) and compiled is not model
    assert compiled._orig_mod is model  # what micro_sync unwraps to reach DDP or FSDP


def test_train_compile_passes_compile_mode_to_torch_compile(tmp_path, monkeypatch):
    """The fast half of the test below: which mode the run asks torch.compile for (the
    stand-in returns the model as it is, so nothing compiles)."""
    modes = []

    def compile_(model, mode=None):
        modes.append(mode)
        return model

    monkeypatch.setattr(torch, "compile", compile_)
    ironloop.fit(net(), blobs(), None, cfg(tmp_path, train__compile=True, train__max_steps=1,
                                           train__compile_mode="reduce-overhead"))
    assert modes == ["reduce-overhead"]


@pytest.mark.slow  # compiling takes seconds, even with aot_eager
def test_compiled_and_uncompiled_runs_share_checkpoints(tmp_path, monkeypatch):
    # aot_eager traces forward and backward through dynamo and AOTAutograd like the default
    # backend, without inductor's C++ code generation (which takes a minute on 2 cores).
    compiled = []
    real = torch.compile

    def compile_(model, mode=None):
        compiled.append(mode)
        return real(model, mode=mode, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_)
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=7, checkpoint__keep_last=5)
    eager = ironloop.fit(net(), blobs(), None, conf)
    compiled_conf = {**conf, "run.dir": str(tmp_path / "c"), "train.compile": True,
                     "train.compile_mode": "max-autotune-no-cudagraphs", "train.max_steps": 7}
    ironloop.fit(net(), blobs(), None, compiled_conf)
    assert compiled == ["max-autotune-no-cudagraphs"]
    state = load_verified(tmp_path / "c" / "checkpoints" / "last.pt")
    assert list(state["model"]) == list(eager.model.state_dict())  # no _orig_mod. prefix
    # a compiled run's checkpoint resumes eagerly, and ends where the eager run ended
    model = net()
    ironloop.fit(model, blobs(), None, {**conf, "run.dir": str(tmp_path / "c")}, resume=True,
                 allow_config_change=True)  # extending max_steps is a length change
    for k, v in eager.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v)


def test_checkpointed_blocks_train_even_when_their_input_needs_no_grad():
    """use_reentrant=False: the first block's input is the batch itself (no grad), and its
    parameters still get gradients."""
    model = nn.Sequential(Block(), Block())
    assert checkpoint_activations(model, ["Block"]) == 2
    Block.calls = 0
    model(torch.ones(2, 16)).sum().backward()
    assert Block.calls == 4  # each forward once more in backward
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_a_model_is_not_a_block_of_itself():
    with pytest.raises(ConfigError, match=r"^train.activation_checkpointing=\['Block'\]: the "
                                          r"model has no Block module; its classes are Block, "
                                          r"Linear$"):
        checkpoint_activations(Block(), ["Block"])


@pytest.mark.parametrize("mode, passed", [("default", None), ("reduce-overhead",
                                                               "reduce-overhead")])
def test_compile_mode_default_is_torchs_own_default(monkeypatch, mode, passed):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, mode: seen.append(mode) or model)
    model = net()
    assert compile_model(model, mode) is model and seen == [passed]
