"""state/resume.py in-process: what a checkpoint's dict holds, and what restoring checks."""

from __future__ import annotations

import pytest
import torch

import ironloop
from ironloop.errors import CheckpointError
from ironloop.state import resume
from ironloop.state.io import FORMAT_VERSION


def test_a_checkpoints_dict_names_its_format_versions_config_parts_rng_and_values():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = resume.collect_state({"seed": 3}, model, {"optimizer": opt, "scaler": None},
                                 progress={"step": 7})
    assert state["format_version"] == FORMAT_VERSION
    assert state["ironloop_version"] == ironloop.__version__
    assert state["torch_version"] == str(torch.__version__)
    assert state["config"] == {"seed": 3} and state["progress"] == {"step": 7}
    assert state["model"].keys() == model.state_dict().keys()
    assert state["optimizer"] == opt.state_dict() and state["scaler"] is None
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}


def test_a_checkpoint_of_another_format_is_refused_naming_both_formats():
    model = torch.nn.Linear(2, 1)
    state = resume.collect_state({}, model, {})
    state["format_version"] = 99
    with pytest.raises(CheckpointError) as e:
        resume.restore_state(state, "ckpt.pt", model, {})
    assert str(e.value) == (f"ckpt.pt has checkpoint format 99, this ironloop reads "
                            f"{FORMAT_VERSION}; resume it with the ironloop that wrote it")
