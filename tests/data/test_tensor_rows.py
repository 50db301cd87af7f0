"""Plain TensorDatasets of one tensor or of three and more (issue 59, item 7): sliced like
TensorData, one ``index_select`` per tensor, with the batches the DataLoader gave, no per-sample
seeding, and an exact resume."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ironloop
from ironloop.data.loader import EpochSampler, make_loader
from ironloop.data.seeding import SeededDataset
from tests.conftest import StopAt, cfg, tiny_mlp


def _reference(dataset, sampler) -> list:
    """What a DataLoader gives for the same index batches: per-sample reads and collate."""
    return list(DataLoader(dataset, batch_sampler=[b.tolist() for b in sampler.index_batches()]))


def test_one_and_three_tensor_datasets_are_sliced_into_the_dataloaders_batches():
    for tensors in ((torch.arange(40.0).reshape(20, 2),),
                    (torch.arange(20.0), torch.arange(20).remainder(3), torch.ones(20, 2, 2))):
        dataset, sampler = TensorDataset(*tensors), EpochSampler(20, 6, seed=0, shuffle=True)
        sliced = make_loader(dataset, sampler, num_workers=0, pin_memory=False)
        assert not isinstance(sliced, DataLoader)  # in this process, no per-sample path
        batches, expected = list(sliced), _reference(dataset, sampler)
        assert [len(b[0]) for b in batches] == [6, 6, 6, 2]
        for got, want in zip(batches, expected):
            assert type(got) is list and len(got) == len(tensors)  # as default_collate made it
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        workers = make_loader(dataset, sampler, num_workers=2, pin_memory=False)
        assert not isinstance(workers.dataset, SeededDataset)  # nothing random to seed
        for got, want in zip(workers, expected):
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_subclass_keeps_its_own_getitem_and_its_seeding():
    class Noisy(TensorDataset):  # an augmentation: must run per sample, seeded
        def __getitem__(self, i):
            return (self.tensors[0][i] + torch.randn(()),)

    loader = make_loader(Noisy(torch.zeros(8)), EpochSampler(8, 4, 0, True), num_workers=0,
                         pin_memory=False)
    assert isinstance(loader.dataset, SeededDataset)


def _images_step(model, batch):
    """A generative model's step on images alone: a one-tensor batch, noise drawn per step."""
    (x,) = batch
    target = torch.randint(0, 3, (len(x),))
    return F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), target), {}


def test_a_one_tensor_dataset_resumes_exactly_mid_epoch(tmp_path):
    images = TensorDataset(torch.randn(100, 8, generator=torch.Generator().manual_seed(0)))

    def run(where, stop=None, resume=False):
        model = tiny_mlp()
        ironloop.fit(model, images, None, cfg(where, train__epochs=2, checkpoint__every_steps=1),
                     step_fn=_images_step, callbacks=[StopAt(stop)] if stop else None,
                     resume=resume)
        return model

    whole = run(tmp_path / "whole")
    run(tmp_path / "cut", stop=5)  # mid-epoch 2 (4 steps an epoch)
    resumed = run(tmp_path / "cut", resume=True)
    for (name, mine), theirs in zip(resumed.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(mine, theirs), name
