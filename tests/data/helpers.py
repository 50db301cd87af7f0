"""Small datasets, samplers and streams that several of the data tests read."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset

NONE = torch.zeros(0, dtype=torch.long)


class Draws(Dataset):
    """Each sample is a draw from torch's global generator: what a random augmentation reads."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return torch.rand(3)


class Counting(IterableDataset):
    """A stream of (x, y) pairs, x of shape (5,)."""

    def __iter__(self):
        for i in range(6):
            yield torch.full((5,), float(i)), torch.tensor(i % 2)


def keep_rows(rows):
    return rows


class Indexed(Dataset):
    """Sample i is the tensor [i]: a batch shows the order it was read in."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([i])


class Backwards(torch.utils.data.Sampler):
    """A user's sampler: n-1 .. 0, a pure function of the epoch (it has set_epoch)."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Claims(IterableDataset):
    """A stream of ``n`` samples whose __len__ says ``claims``."""

    def __init__(self, n: int, claims: int):
        self.n, self.claims = n, claims

    def __len__(self) -> int:
        return self.claims

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(0)


# ------------------------------------------------------------------ stream units -----------
class Stateful(Claims):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ------------------------------------------------------------------ source units -----------
def data_config(**keys):
    from ironloop.config import Config

    return Config().with_overrides(keys)
