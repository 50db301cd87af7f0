"""data/counting.py: each micro-batch is counted by what the sampler drew or the batch declares,
never by its first tensor's length; to_device moves objects that move themselves."""

from __future__ import annotations

import pytest
import torch

from ironloop.data.counting import check_rows, counted, declared_count, rank_share
from ironloop.data.loader import EpochSampler, EvalSampler, batch_size_of, to_device
from ironloop.errors import DataError


@pytest.mark.parametrize("total,world", [(7, 3), (2, 4), (8, 2), (1, 1)])
def test_rank_share_is_tensor_splits_size_for_every_rank(total, world):
    parts = torch.tensor_split(torch.arange(total), world)
    assert [rank_share(total, r, world) for r in range(world)] == [len(p) for p in parts]


@pytest.mark.parametrize("cls", [EpochSampler, EvalSampler])
@pytest.mark.parametrize("n,batch,world,offset", [(23, 4, 1, 0), (23, 4, 3, 5), (5, 4, 4, 0)])
def test_batch_sizes_are_the_sizes_index_batches_yields(cls, n, batch, world, offset):
    for rank in range(world):
        sampler = cls(n, batch, seed=0, shuffle=True, rank=rank, world_size=world)
        sampler.set_epoch(1, offset)
        assert list(sampler.batch_sizes()) == [len(b) for b in sampler.index_batches()]


class GraphBatch:
    """A hand-made graph batch: what PyTorch Geometric's Batch offers the loop."""

    def __init__(self, x, y, num_graphs):
        self.x, self.y, self.num_graphs = x, y, num_graphs
        self.moved_to = None

    def to(self, device, non_blocking=False):
        moved = GraphBatch(self.x.to(device), self.y.to(device), self.num_graphs)
        moved.moved_to = torch.device(device)
        return moved


def test_a_batch_that_declares_its_count_is_counted_by_it_and_moves_itself():
    batch = GraphBatch(torch.zeros(40, 3), torch.zeros(6), num_graphs=6)
    assert declared_count(batch) == 6 and counted(batch, 6) == 6 and batch_size_of(batch) == 6
    assert to_device(batch, torch.device("cpu"), False).moved_to == torch.device("cpu")
    check_rows(batch, 6)  # declared: its x is node-major, and that is fine
    assert to_device("text", torch.device("cpu"), False) == "text"  # str.to does not exist


def test_a_tuple_is_counted_by_its_drawn_samples_and_refused_only_where_rows_disagree():
    nodes = (torch.zeros(40, 3), torch.zeros(2, 80, dtype=torch.long), torch.zeros(6))
    assert counted(nodes, 6) == 6  # not 40
    with pytest.raises(DataError, match=r"a batch tuple\(Tensor\[40, 3\], Tensor\[2, 80\], "
                                        r"Tensor\[6\]\) has 40 rows .* drew 6 samples"):
        check_rows(nodes, 6)
    check_rows((torch.zeros(6, 3), torch.zeros(6)), 6)
    check_rows({"edge_index": torch.zeros(2, 9), "y": torch.zeros(6)}, 6)  # model(**batch)
