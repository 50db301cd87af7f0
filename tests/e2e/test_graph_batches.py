"""Batches whose first tensor is not one row per sample (issue 59, items 1 and 2): a graph
batch made into a plain tuple ``(x_nodes, edge_index, batch, y)`` and PyTorch Geometric's own
``Batch``. The loop counts each micro-batch by the samples the sampler drew (or the count the
batch declares), so the update is the hand loop's; the default step refuses a tuple whose first
tensor it would misread."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import ironloop
from ironloop.errors import DataError
from tests.conftest import cfg

FEATURES, CLASSES = 5, 3


class Graphs(Dataset):
    """Small random graphs, 2 to 9 nodes each: (node features, edges, label)."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            k = int(torch.randint(2, 10, (1,), generator=g))
            edges = torch.randint(0, k, (2, 2 * k), generator=g)
            y = torch.randint(0, CLASSES, (), generator=g)
            x = torch.randn(k, FEATURES, generator=g) + y.float()
            self.items.append((x, edges, y))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def node_major(samples):
    """PyG's collation with plain torch: nodes stacked, edges offset, a node -> graph vector."""
    xs, edges, ys, owner, first = [], [], [], [], 0
    for g, (x, e, y) in enumerate(samples):
        xs.append(x)
        edges.append(e + first)
        owner.append(torch.full((len(x),), g, dtype=torch.long))
        ys.append(y)
        first += len(x)
    return torch.cat(xs), torch.cat(edges, 1), torch.cat(owner), torch.stack(ys)


class MeanPoolNet(nn.Module):
    """A message-passing layer, a mean over each graph's nodes, a classifier."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x, edge_index, owner, graphs: int):
        h = torch.relu(self.inp(x))
        h = h.index_add(0, edge_index[1], h[edge_index[0]])  # each node adds its neighbours
        pooled = torch.zeros(graphs, h.shape[1]).index_add(0, owner, h)
        counts = torch.bincount(owner, minlength=graphs).clamp(min=1).unsqueeze(1)
        return self.out(pooled / counts)


def tuple_step(model, batch):
    x, edge_index, owner, y = batch
    return F.cross_entropy(model(x, edge_index, owner, len(y)), y), {}


def hand_loop(model, data, batch_size: int, accum: int, lr: float):
    """The reference: SGD, in order, each micro-batch's mean loss weighted by its graphs over
    the window's graphs (a ragged last window included)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    idx = list(range(len(data)))
    for start in range(0, len(idx), batch_size * accum):
        window = idx[start:start + batch_size * accum]
        opt.zero_grad(set_to_none=True)
        for m in range(0, len(window), batch_size):
            drawn = window[m:m + batch_size]
            loss = tuple_step(model, node_major([data[i] for i in drawn]))[0]
            scale = len(drawn) / len(window)
            (loss if scale == 1.0 else loss * scale).backward()
        opt.step()


@pytest.mark.parametrize("accum", [1, 2])
def test_a_node_major_tuple_is_counted_by_its_drawn_graphs_and_equals_the_hand_loop(
        tmp_path, accum):
    # 22 graphs in micro-batches of 4: 2 accumulated give windows of 8, 8 and a ragged 6 (4 + 2).
    # Counted by the first tensor (nodes), each micro-batch's gradient was scaled by its nodes
    # per graph (about 5x here), silently.
    data = Graphs(22)
    model = MeanPoolNet()
    reference = copy.deepcopy(model)
    loader = DataLoader(data, batch_size=4, collate_fn=node_major)
    ironloop.fit(model, loader, None, cfg(tmp_path, train__epochs=1,
                                          train__accumulation_steps=accum, optim__name="sgd",
                                          optim__lr=0.1, optim__momentum=0.0,
                                          optim__weight_decay=0.0, clip__max_norm=0.0),
                 step_fn=tuple_step)
    hand_loop(reference, data, 4, accum, 0.1)
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_the_default_step_refuses_a_first_tensor_that_is_not_one_row_per_sample(tmp_path):
    class NodeClassifier(nn.Module):  # takes the first tensor, as the default step feeds it
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(FEATURES, CLASSES)

        def forward(self, x):
            return self.fc(x)

    loader = DataLoader(Graphs(12), batch_size=4, collate_fn=node_major)
    with pytest.raises(DataError, match=r"a batch tuple\(Tensor\[\d+, 5\], Tensor\[2, \d+\], "
                                        r".*\) has \d+ rows in its first tensor, but the sampler "
                                        r"drew 4 samples for it; .*put a per-sample tensor "
                                        r"first, or pass a step_fn"):
        ironloop.fit(NodeClassifier(), loader, None, cfg(tmp_path, train__epochs=1))


# --- PyTorch Geometric: its Batch through fit(), moved and counted by num_graphs ---------------

def _gcn_setup():
    pyg = pytest.importorskip("torch_geometric")  # the graph extra (pure Python)
    from torch_geometric.datasets import FakeDataset
    from torch_geometric.nn import GCNConv, global_mean_pool

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.head = GCNConv(8, 16), nn.Linear(16, 2)

        def forward(self, data):
            h = torch.relu(self.conv(data.x, data.edge_index))
            return self.head(global_mean_pool(h, data.batch, size=data.num_graphs))

    torch.manual_seed(0)
    data = FakeDataset(num_graphs=30, avg_num_nodes=10, num_channels=8, num_classes=2,
                       task="graph")
    return pyg, GCN, [data[i] for i in range(len(data))]


def _gcn_conf(tmp_path, **extra):
    base = dict(train__epochs=2, train__batch_size=4, train__accumulation_steps=2,
                optim__name="sgd", optim__lr=0.1, optim__momentum=0.0, optim__weight_decay=0.0,
                clip__max_norm=0.0)
    return cfg(tmp_path, **{**base, **extra})


def test_a_pyg_gcn_trains_through_the_default_step_as_its_hand_loop(tmp_path):
    # DataError before: "a batch is a DataBatch, which holds no tensor to count its samples by".
    pyg, gcn, graphs = _gcn_setup()
    model = gcn()
    reference = copy.deepcopy(model)
    loader = pyg.loader.DataLoader(graphs, batch_size=4)
    ironloop.fit(model, loader, None, _gcn_conf(tmp_path))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):  # 30 graphs: windows of 8 graphs (2 x 4), the last one 6 (4 + 2)
        for start in range(0, 30, 8):
            window = graphs[start:start + 8]
            opt.zero_grad(set_to_none=True)
            for m in range(0, len(window), 4):
                batch = pyg.data.Batch.from_data_list(window[m:m + 4])
                loss = F.cross_entropy(reference(batch), batch.y)
                scale = batch.num_graphs / len(window)
                (loss if scale == 1.0 else loss * scale).backward()
            opt.step()
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_a_pyg_gcn_with_a_step_fn_and_validation_resumes_exactly(tmp_path):
    pyg, gcn, graphs = _gcn_setup()
    from tests.conftest import StopAt

    def step(model, batch):
        out = model(batch)
        return F.cross_entropy(out, batch.y), {"acc": (out.argmax(-1) == batch.y).float().mean()}

    def run(where, stop=None, resume=False):
        model = gcn()
        ironloop.fit(model, pyg.loader.DataLoader(graphs[:22], batch_size=4, shuffle=True),
                     pyg.loader.DataLoader(graphs[22:], batch_size=3),
                     _gcn_conf(where, optim__name="adamw"),
                     step_fn=step, callbacks=[StopAt(stop)] if stop else None, resume=resume)
        return model

    whole = run(tmp_path / "whole")
    run(tmp_path / "cut", stop=4)  # mid-epoch 2 (3 steps an epoch)
    resumed = run(tmp_path / "cut", resume=True)
    for (name, mine), theirs in zip(resumed.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(mine, theirs), name
    from ironloop.outputs.readers import read_jsonl
    evals = read_jsonl(tmp_path / "whole" / "run" / "evals.jsonl")
    assert 0.0 <= evals[-1]["val_acc"] <= 1.0 and evals[-1]["val_loss"] > 0
