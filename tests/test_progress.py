"""Meter: the per-step clip flags are summed when read, and survive a state_dict round trip."""

from __future__ import annotations

import torch

from ironloop.engine.progress import Meter


def _step(meter: Meter, clipped: bool) -> None:
    meter.add_micro(torch.tensor(1.0), 4)
    meter.add_step(torch.tensor(2.0), torch.tensor(clipped), None)


def test_clip_flags_count_per_window_epoch_and_across_a_checkpoint():
    meter = Meter(torch.device("cpu"))
    for flag in (True, False, True):
        _step(meter, flag)
    assert meter.flush_window()["clipped"] == 2
    _step(meter, True)
    state = meter.state_dict()  # a checkpoint mid-window takes the pending flag along
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(state)
    for m in (meter, resumed):
        _step(m, True)
        assert m.flush_window()["clipped"] == 2
        assert m.flush_epoch()["clipped_frac"] == 4 / 5
