"""ironloop.data.samplers: how a generator sampler's and a stateful sampler's epochs are drawn."""

from __future__ import annotations

import torch

from tests.data.helpers import NONE, Backwards


def test_a_generator_samplers_epoch_is_drawn_from_a_generator_seeded_by_seed_and_epoch():
    from torch.utils.data import WeightedRandomSampler

    from ironloop.data.samplers import order_of
    from ironloop.data.seeding import derive_seed

    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    mine = torch.Generator().manual_seed(0)
    order, warning = order_of(WeightedRandomSampler(weights, 40, generator=mine), 6, seed=7)
    mine_state = mine.get_state()
    expected = list(WeightedRandomSampler(weights, 40, generator=torch.Generator().manual_seed(
        derive_seed(7, 2, "sampler"))))
    assert warning is None and order.indices(2, NONE, 0, 40).tolist() == expected
    assert torch.equal(mine.get_state(), mine_state)  # the user's own generator is left alone


class Rotating(torch.utils.data.Sampler):
    """A sampler whose state moves on by one each time it is drawn: it yields 0..n-1 rotated by
    how many times it was drawn before (state_dict/load_state_dict, no generator)."""

    def __init__(self, n: int):
        self.n, self.turn = n, 0

    def __iter__(self):
        turn, self.turn = self.turn, self.turn + 1
        return iter([(i + turn) % self.n for i in range(self.n)])

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"turn": self.turn}

    def load_state_dict(self, state: dict) -> None:
        self.turn = state["turn"]


def test_a_stateful_samplers_epoch_is_drawn_again_from_its_state_at_the_epochs_start():
    from ironloop.data.samplers import order_of

    order, warning = order_of(Rotating(4), 4, seed=0)
    assert warning is None and order.how == "state"
    assert order.indices(0, NONE, 0, 4).tolist() == [0, 1, 2, 3]
    assert order.indices(1, NONE, 0, 4).tolist() == [1, 2, 3, 0]
    saved = order.state_dict()
    assert saved == {"epoch": 1, "start": {"turn": 1}, "after": {"turn": 2}}
    again, _ = order_of(Rotating(4), 4, seed=0)
    again.load_state_dict(saved)
    assert again.state_dict() is saved  # restored, not drawn yet: still the checkpoint's
    assert again.indices(1, NONE, 0, 4).tolist() == [1, 2, 3, 0]  # the epoch, drawn again
    later, _ = order_of(Rotating(4), 4, seed=0)
    later.load_state_dict(saved)
    assert later.indices(2, NONE, 0, 4).tolist() == [2, 3, 0, 1]  # the next: from "after"
    later.load_state_dict({})  # an order saved without state: nothing to restore
    assert later.state_dict()["epoch"] == 2
    assert order_of(Backwards(3), 3, seed=0)[0].state_dict() == {}
