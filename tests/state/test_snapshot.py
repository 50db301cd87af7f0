"""The CPU copies behind an async checkpoint and the guard's rollback point (state/snapshot.py):
a deep copy of every tensor and container, atoms kept as they are, the last copy's tensors
reused."""

from __future__ import annotations

import torch

from ironloop.state.snapshot import copies_done, snapshot


def _state() -> dict:
    return {"config": {"train": {"lr": 0.1, "name": "adamw", "on": True, "none": None}},
            "model": {"w": torch.arange(4.0)}, "rng": [torch.zeros(2), ("a", 3)],
            "step": 7}


def test_a_snapshot_copies_every_tensor_and_container_and_keeps_atoms_as_they_are():
    state = _state()
    snap = snapshot(state)
    assert snap["config"] == state["config"] and snap["config"] is not state["config"]
    assert snap["config"]["train"] is not state["config"]["train"]
    assert snap["step"] == 7 and snap["rng"][1] == ("a", 3) and isinstance(snap["rng"], list)
    state["config"]["train"]["lr"] = 0.5  # the run changes its own dicts and tensors later
    state["model"]["w"].add_(1)
    state["rng"][0].fill_(9)
    assert snap["config"]["train"]["lr"] == 0.1
    assert snap["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert snap["rng"][0].tolist() == [0.0, 0.0]


def test_the_next_snapshot_copies_into_the_last_ones_tensors_and_a_cpu_one_waits_for_nothing():
    state = _state()
    first = snapshot(state, pinned=True)
    kept = first["model"]["w"]
    state["model"]["w"].add_(10)
    second = snapshot(state, first, pinned=True)
    assert second["model"]["w"] is kept and kept.tolist() == [10.0, 11.0, 12.0, 13.0]
    assert copies_done(state)() is None  # no CUDA tensor: nothing was queued
