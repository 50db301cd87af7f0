"""Random augmentation inside __getitem__ is a pure function of (seed, epoch, index): the same
whatever the number of workers, and exact across a SIGKILL and a resume with another
data.num_workers (from the CLI, through a factory's DataLoader with a weighted sampler, with
the preflight doctor on)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import ironloop
from ironloop.data.loader import EpochSampler, make_loader
from tests.conftest import REPO, cfg, train_or_kill
from tests.data.helpers import Draws

AUGMENTED = '''
import random

import numpy as np
import torch
from torch import nn


class Augmented(torch.utils.data.Dataset):
    """Noise from torch, a scale from numpy and a sign flip from python: all three generators."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.3 * torch.randn(8)
        x = x * float(np.random.uniform(0.8, 1.2))
        if random.random() < 0.2:
            x = -x
        return x, self.y[i]


def data(root=None):
    """A DataLoader with a weighted sampler: its draw must be exact on resume too."""
    train = Augmented(480, 0)
    weights = torch.where(train.y == 1, 3.0, 1.0)
    sampler = torch.utils.data.WeightedRandomSampler(weights, len(train))
    return torch.utils.data.DataLoader(train, batch_size=16, sampler=sampler), Augmented(64, 1)


def model(input_shape=None, num_classes=None):
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))
'''


class Noisy(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((2,), float(i)) + torch.rand(2)


def batches(num_workers: int, seed_samples: bool, epoch: int = 0) -> torch.Tensor:
    s = EpochSampler(12, 4, seed=0, shuffle=True)
    s.set_epoch(epoch)
    loader = make_loader(Noisy(), s, num_workers=num_workers, pin_memory=False,
                         seed_samples=seed_samples)
    return torch.cat(list(loader))


def test_a_samples_randomness_depends_on_seed_epoch_and_index_only():
    one = batches(0, True)
    assert torch.equal(one, batches(2, True))  # other workers, same draws
    assert not torch.equal(one, batches(0, True, epoch=1))  # a new epoch, new draws
    before = torch.get_rng_state()
    batches(0, True)
    assert torch.equal(torch.get_rng_state(), before)  # the training's own stream is untouched
    # Without per-sample seeds the draws depend on where the sample is loaded.
    assert not torch.equal(batches(0, False), batches(2, False))


def _served(run_dir: Path, extra_draws: int, **overrides) -> torch.Tensor:
    """The samples fit() trains on over two epochs, its step drawing ``extra_draws`` numbers
    from torch's global stream (as dropout would)."""
    seen: list[torch.Tensor] = []

    def step(model, batch):
        seen.append(batch.clone())
        torch.rand(extra_draws)
        return model(batch).mean(), {}

    ironloop.fit(nn.Linear(2, 1), Noisy(), None,
                 cfg(run_dir, train__batch_size=4, checkpoint__enabled=False, **overrides),
                 step_fn=step)
    return torch.cat(seen)


def test_fit_seeds_each_sample_by_default_so_what_the_step_draws_changes_no_sample(tmp_path):
    assert torch.equal(_served(tmp_path / "a", 0), _served(tmp_path / "b", 5))
    # data.seed_samples=false: the samples draw from the same stream as the step
    off = {"data__seed_samples": False}
    assert not torch.equal(_served(tmp_path / "c", 0, **off), _served(tmp_path / "d", 5, **off))


def _train(tmp_path: Path, run_dir: Path, workers: int, kill_at: int | None = None) -> None:
    (tmp_path / "c.yaml").write_text("run: {seed: 0}\n")
    cmd = [sys.executable, "-m", "ironloop", "train", "c.yaml", "data.name=augmented:data",
           "model.name=augmented:model", "train.epochs=2", "train.batch_size=16",
           "checkpoint.every_steps=4", "log.every_steps=1", "log.progress=off",
           f"data.num_workers={workers}",
           f"run.dir={run_dir}", "--resume"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(tmp_path)])}
    train_or_kill(cmd, run_dir, tmp_path, env, kill_at)


@pytest.mark.slow
def test_augmentation_is_exact_after_sigkill_and_resume_with_other_num_workers(tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "augmented.py").write_text(AUGMENTED)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _train(tmp_path, reference, workers=0)
    _train(tmp_path, resumed, workers=2, kill_at=10)   # epoch 1 of 2 (30 steps per epoch)
    _train(tmp_path, resumed, workers=0, kill_at=41)   # epoch 2, resumed mid-epoch 1 before
    _train(tmp_path, resumed, workers=2)
    a, b = load_file(reference / "final.safetensors"), load_file(resumed / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_workers_numpy_and_python_seeds_are_torchs_worker_seed_mod_2_32():
    # torch gives each worker a 64-bit seed; numpy takes at most 32 bits, so both generators
    # get its low 32 bits (augmentations with np.random or random reproduce per worker)
    import random

    import numpy as np

    from ironloop.data.loader import _seed_worker

    states = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(2**40 + 12345)
            _seed_worker(0)
            got = np.random.randint(1 << 30), random.random()
        np.random.seed(12345)
        random.seed(12345)
        assert got == (np.random.randint(1 << 30), random.random())
    finally:  # this process's generators as they were
        np.random.set_state(states[0])
        random.setstate(states[1])


def test_seed_sample_seeds_numpy_with_the_samples_derived_seed_mod_2_32():
    import random

    import numpy as np

    from ironloop.data.seeding import derive_seed, seed_sample

    states = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng():
            seed_sample(3, 1, 5)
            got = np.random.randint(1 << 30), random.random(), torch.rand(1)
        s = derive_seed(3, 1, 5, "sample")
        np.random.seed(s % 2**32)
        random.seed(s)
        assert got[:2] == (np.random.randint(1 << 30), random.random())
        assert torch.equal(got[2], torch.rand(1, generator=torch.Generator().manual_seed(s)))
    finally:
        np.random.set_state(states[0])
        random.setstate(states[1])


# ------------------------------------------------------------------ seeding ----------------
def test_a_seeded_datasets_sample_draws_from_seed_epoch_and_index():
    from ironloop.data.seeding import SeededDataset, seed_sample

    ds = SeededDataset(Draws(), seed=5)
    seed_sample(5, 2, 7)
    expected = torch.rand(3)
    assert torch.equal(ds[(2, 7)], expected)
    assert torch.equal(ds.__getitems__([(2, 7)])[0], expected)
    assert not torch.equal(ds[(3, 7)], expected)  # another epoch, another draw
    assert len(ds) == 10


def test_derive_seed_is_blake2b_of_the_parts_joined_by_colons_in_63_bits():
    import hashlib

    from ironloop.data.seeding import derive_seed

    digest = hashlib.blake2b(b"3:1:order:0", digest_size=8).digest()
    assert derive_seed(3, 1, "order", 0) == int.from_bytes(digest, "little") & (2**63 - 1)
    assert 0 <= derive_seed("eval-subset") < 2**63
