"""engine/carry.py: a stateful step's state is detached, checkpointable, reset at the top of an
epoch only, and kept apart for evaluation."""

from __future__ import annotations

import torch
from torch import nn

from ironloop.engine.carry import Carry, StatefulStep, stateful


def test_values_are_stored_detached_and_round_trip_through_a_state_dict():
    c = Carry()
    w = torch.ones(2, requires_grad=True)
    c["hidden"] = (w * 2, {"m": w * 3})
    h, inner = c["hidden"]
    assert not h.requires_grad and not inner["m"].requires_grad
    other = Carry()
    other.load_state_dict(c.state_dict())
    assert torch.equal(other["hidden"][0], h) and "hidden" in other


def test_the_model_mode_picks_the_state_and_resets_follow_the_epoch():
    def step(model, batch, state):
        state["n"] = state.get("n", 0) + 1
        return torch.zeros(()), {}

    wrapped, carry = stateful(step, "cpu")
    assert isinstance(carry, StatefulStep) and wrapped is carry
    model = nn.Linear(1, 1)
    wrapped(model, None)
    wrapped(model, None)
    model.eval()
    wrapped(model, None)
    assert carry.train["n"] == 2 and carry.eval["n"] == 1
    carry.start_epoch(offset=32)  # a resumed epoch keeps its state
    assert carry.train["n"] == 2
    carry.start_epoch(offset=0)
    carry.start_evaluation()
    assert "n" not in carry.train and "n" not in carry.eval
    never = StatefulStep(step, reset="never")
    never.train["n"] = 5
    never.start_epoch(0)
    assert never.train["n"] == 5


def test_a_plain_step_is_left_alone():
    def step(model, batch):
        return torch.zeros(()), {}

    assert stateful(step, "cpu") == (step, None)


def test_a_stateful_step_resets_at_the_top_of_each_epoch_by_default():
    def step(model, batch, state):
        return torch.zeros(()), {}

    default = StatefulStep(step)
    default.train["n"] = 1
    default.start_epoch(0)
    assert "n" not in default.train


def test_a_resume_mid_epoch_continues_with_the_carry_its_checkpoint_holds(tmp_path):
    """The training carry is in every checkpoint (key ``carry``): a run stopped mid-epoch and
    resumed hands its next step the state the stopped one had, not an empty one."""
    import ironloop
    from ironloop.state.io import load_verified
    from tests.conftest import blobs, cfg, tiny_mlp

    seen: list[float] = []

    def step(model, batch, state):
        x, y = batch
        count = float(state.get("n", torch.zeros(())))
        seen.append(count)
        state["n"] = torch.tensor(count + 1)
        return nn.functional.cross_entropy(model(x), y), {}

    config = cfg(tmp_path, train__epochs=1, train__max_steps=3)  # 7 steps an epoch
    ironloop.fit(tiny_mlp(), blobs(), None, config, step_fn=step)
    assert seen == [0.0, 1.0, 2.0]
    saved = load_verified(tmp_path / "run" / "checkpoints" / "last.pt")
    assert float(saved["carry"]["train"]["n"]) == 3.0
    ironloop.fit(tiny_mlp(), blobs(), None, {**config, "train.max_steps": 5}, step_fn=step,
                 resume=True, allow_config_change=True)
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_checkpointed_carry_is_a_host_copy_and_loads_onto_the_runs_device_shape_for_shape():
    c = Carry()
    c["hidden"] = (torch.ones(2), [torch.ones(1), 3], {"m": torch.ones(3)})
    c["steps"] = 4  # not a tensor: kept as it is
    state = c.state_dict()
    h, rest, inner = state["hidden"]
    assert type(state["hidden"]) is tuple and type(rest) is list and rest[1] == 3
    assert {h.device.type, rest[0].device.type, inner["m"].device.type} == {"cpu"}
    assert state["steps"] == 4
    back = Carry("meta")  # the run's device, other than the host's (no GPU needed)
    back = Carry("meta")
    back.load_state_dict({"hidden": (torch.zeros(2), [torch.zeros(1), 3], {"m": torch.zeros(3)}),
                          "steps": 4})
    h, rest, inner = back["hidden"]
    assert type(back["hidden"]) is tuple and type(rest) is list
    assert {h.device.type, rest[0].device.type, inner["m"].device.type} == {"meta"}
    assert back.get("steps") == 4 and back.get("none", 7) == 7 and "none" not in back
    back.load_state_dict(None)  # a checkpoint from before carries: empty
    assert "hidden" not in back and back.get("steps") is None


def test_a_detached_carry_keeps_its_containers_and_non_tensor_values():
    c = Carry()
    w = torch.ones(1, requires_grad=True)
    c["v"] = [w * 2, (w * 3, "tag")]
    listed, (inner, tag) = c["v"]
    assert type(c["v"]) is list and tag == "tag"
    assert not listed.requires_grad and not inner.requires_grad
    c.clear()
    assert "v" not in c


def test_a_stateful_steps_checkpoint_holds_the_training_carry_only():
    def step(model, batch, state):
        return torch.zeros(()), {}

    s = StatefulStep(step)
    s.train["n"], s.eval["n"] = torch.tensor(1.0), torch.tensor(9.0)
    assert list(s.state_dict()) == ["train"] and float(s.state_dict()["train"]["n"]) == 1.0
    s.load_state_dict({"train": {"n": torch.tensor(5.0)}})
    assert float(s.train["n"]) == 5.0
    for empty in (None, {}, {"train": None}):  # from before carries: a fresh one
        s.load_state_dict(empty)
        assert "n" not in s.train
    assert stateful(lambda model, batch, *, state: None, "cpu")[1] is not None  # a keyword
    assert stateful(print, "cpu")[1] is None  # a plain callable
    assert stateful(max, "cpu") == (max, None)  # no signature to read (ValueError): plain

    class NoSignature:
        __signature__ = "not one"  # inspect raises TypeError

        def __call__(self, model, batch):
            return None

    odd = NoSignature()
    assert stateful(odd, "cpu") == (odd, None)
