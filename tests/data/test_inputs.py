"""Every way of passing map-style data keeps its meaning: a DataLoader's sampler and
shuffle=False are honoured, samplers are redrawn exactly on resume (or a warning says what
resume does), and a Hugging Face datasets.Dataset and a DataLoader from a CLI factory work."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import ironloop
from ironloop.data.loader import EpochSampler
from ironloop.data.samplers import order_of
from ironloop.errors import UserError
from tests.conftest import blobs, cfg, tiny_mlp
from tests.data.helpers import Draws, keep_rows


class Indexed(Dataset):
    """x[0] is the sample's index, so a step can see the order it was served."""

    def __init__(self, n: int = 48):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i), 1.0]), torch.tensor(i % 2)


def served(data, tmp_path, **overrides) -> list[int]:
    """The sample indices fit() trains on, in order, from one epoch."""
    seen: list[int] = []
    model = nn.Linear(2, 2)

    def step(m, batch):
        seen.extend(int(v) for v in batch[0][:, 0])
        out = m(batch[0])
        return nn.functional.cross_entropy(out, batch[1]), {}

    ironloop.fit(model, data, None, cfg(tmp_path, train__epochs=1, checkpoint__enabled=False,
                                        **overrides), step_fn=step)
    return seen


def test_a_dataloaders_shuffle_false_and_shuffle_true_are_honoured(tmp_path):
    in_order = served(DataLoader(Indexed(), batch_size=8), tmp_path / "a")
    assert in_order == list(range(48))
    shuffled = served(DataLoader(Indexed(), batch_size=8, shuffle=True), tmp_path / "b")
    assert sorted(shuffled) == list(range(48)) and shuffled != in_order
    assert shuffled == served(Indexed(), tmp_path / "c", train__batch_size=8)


def test_a_weighted_sampler_keeps_its_weights_and_redraws_exactly(tmp_path):
    weights = torch.tensor([0.0 if i % 2 else 1.0 for i in range(48)])  # even indices only
    loader = DataLoader(Indexed(), batch_size=8,
                        sampler=WeightedRandomSampler(weights, 48, replacement=True))
    seen = served(loader, tmp_path)
    assert len(seen) == 48 and all(i % 2 == 0 for i in seen)
    # The draw is a pure function of (seed, epoch): a fresh sampler (a resumed process) starting
    # at an offset serves the rest of the same epoch.
    def sampler(offset: int) -> list[int]:
        order, _ = order_of(WeightedRandomSampler(weights, 48), 48, seed=0)
        s = EpochSampler(48, 8, seed=0, shuffle=True, order=order)
        s.set_epoch(2, offset)
        return [i for b in s for i in b]
    assert sampler(16) == sampler(0)[16:]


class StatefulShuffle(Sampler):
    """A sampler with its own generator and state_dict (torchdata's Stateful protocol)."""

    def __init__(self, n: int):
        self.n, self.g = n, torch.Generator().manual_seed(123)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.g).tolist())

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"g": self.g.get_state()}

    def load_state_dict(self, state):
        self.g.set_state(state["g"])


class EpochShuffle(Sampler):
    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


def _epochs(sampler: EpochSampler, epochs) -> list[list[int]]:
    out = []
    for epoch, offset in epochs:
        sampler.set_epoch(epoch, offset)
        out.append([i for b in sampler for i in b])
    return out


def test_a_stateful_or_set_epoch_sampler_resumes_mid_epoch_and_across_epochs():
    for make in (StatefulShuffle, EpochShuffle):
        def fresh(make=make):
            return EpochSampler(20, 4, seed=0, shuffle=True, order=order_of(make(20), 20, 0)[0])

        whole = _epochs(fresh(), [(0, 0), (1, 0), (2, 0)])
        assert whole[0] != whole[1] != whole[2]
        # Mid-epoch (the epoch is drawn), and at an epoch boundary (the next one is not yet).
        for epoch, offset, drawn in [(1, 8, True), (2, 0, False)]:
            a = fresh()
            _epochs(a, [(e, 0) for e in range(epoch + drawn)])
            a.set_epoch(epoch, offset)
            state = a.state_dict()
            b = fresh()  # a resumed process
            b.load_state_dict(state)
            rest = [i for batch in b for i in batch]
            assert rest == whole[epoch][offset:], make.__name__
            if epoch + 1 < len(whole):  # and the epoch after it is the same as well
                assert _epochs(b, [(epoch + 1, 0)])[0] == whole[epoch + 1], make.__name__


class Plain(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


def test_a_sampler_that_cannot_be_redrawn_is_used_with_one_warning(tmp_path, capsys):
    seen = served(DataLoader(Indexed(), batch_size=8, sampler=Plain(48)), tmp_path)
    assert seen == list(range(47, -1, -1))
    warnings = [line for line in capsys.readouterr().out.splitlines() if "Plain" in line]
    assert len(warnings) == 1 and "skips the samples already consumed" in warnings[0]


def test_a_drawn_orders_skip_list_leaves_those_samples_out_and_moves_no_other():
    order, _ = order_of(Plain(10), 10, seed=0)  # the guard's skip list, on a drawn order
    skip = torch.tensor([2, 7])
    assert order.size(0, skip) == 8
    assert order.indices(0, skip, 0, 8).tolist() == [9, 8, 6, 5, 4, 3, 1, 0]
    assert order.indices(0, skip, 2, 5).tolist() == [6, 5, 4]


def test_a_hugging_face_dataset_trains_like_the_same_tensors(tmp_path):
    import datasets

    d = blobs(n=96)
    hf = datasets.Dataset.from_dict({"x": d.x.tolist(), "y": d.y.tolist()})

    def dict_step(model, batch):
        out = model(batch["x"])
        return nn.functional.cross_entropy(out, batch["y"]), {}

    def pair_step(model, batch):
        return dict_step(model, {"x": batch[0], "y": batch[1]})

    a = ironloop.fit(tiny_mlp(), hf, None, cfg(tmp_path / "hf"), step_fn=dict_step).model
    b = ironloop.fit(tiny_mlp(), (d.x, d.y), None, cfg(tmp_path / "t"), step_fn=pair_step).model
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_a_dataloaders_drop_last_is_kept_for_a_hugging_face_dataset():
    import datasets

    from ironloop.data.inputs import map_style

    hf = datasets.Dataset.from_dict({"x": [[0.0], [1.0], [2.0]], "y": [0, 1, 0]})
    assert map_style(DataLoader(hf, batch_size=2, drop_last=True), "train").drop_last
    assert not map_style(DataLoader(hf, batch_size=2), "train").drop_last


def test_a_users_own_class_named_dataset_is_a_torch_dataset_not_a_hugging_face_one(tmp_path):
    # Only datasets.Dataset (module datasets.*) gets the HF treatment (with_format, .format).
    own = type("Dataset", (Indexed,), {})  # a class named Dataset, in this test's module
    assert served(own(32), tmp_path, data__shuffle=False) == list(range(32))


def test_the_preflight_doctor_takes_dataloaders_from_a_factory(tmp_path):
    from ironloop.config import Config
    from ironloop.tools.doctor.run import check, subject

    d = blobs(n=64)
    loader = DataLoader(torch.utils.data.TensorDataset(d.x, d.y), batch_size=16, shuffle=True)
    s = subject(tiny_mlp(), loader, DataLoader(Indexed(8)), None, Config())
    findings = check(s)
    assert s.num_classes == 3 and findings


FACTORY = '''
import datasets
import pytest
import torch
from torch import nn


def data(root=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = (x[:, 0] > 0).long()
    train = datasets.Dataset.from_dict({"x": x[:64].tolist(), "y": y[:64].tolist()})
    return train, (x[64:], y[64:])  # an HF Dataset, and an (inputs, targets) pair


def model(input_shape=None, num_classes=None):
    return nn.Linear(8, 2)


def step(model, batch):
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    out = model(x)
    return nn.functional.cross_entropy(out, y), {"acc": (out.argmax(1) == y).float().mean()}
'''


def test_a_cli_factory_may_return_an_hf_dataset_and_a_tensor_pair(tmp_path, monkeypatch):
    from ironloop.cli import main
    from ironloop.outputs.readers import read_jsonl

    (tmp_path / "hf_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)  # only the CWD makes it importable
    (tmp_path / "c.yaml").write_text("log: {progress: 'off'}\n")
    assert main(["train", "c.yaml", "data.name=hf_factory:data", "model.name=hf_factory:model",
                 "train.step_fn=hf_factory:step", "train.epochs=2", "train.batch_size=16",
                 "run.dir=r"]) == 0
    evals = read_jsonl(tmp_path / "r" / "evals.jsonl")
    assert len(evals) == 2 and evals[-1]["val_loss"] > 0


def test_which_order_each_torch_sampler_gets():
    from torch.utils.data import (
        DistributedSampler,
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
    )

    from ironloop.data.order import KeyedOrder
    from ironloop.data.samplers import DrawnOrder

    ds = Indexed(10)
    for sampler, shuffle in [(SequentialSampler(ds), False), (RandomSampler(ds), True),
                             (DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False), False),
                             (DistributedSampler(ds, num_replicas=2, rank=1), True)]:
        order, warning = order_of(sampler, 10, seed=0)
        assert isinstance(order, KeyedOrder) and order.shuffle is shuffle and warning is None
    for sampler in (RandomSampler(ds, replacement=True), SubsetRandomSampler([1, 3, 5])):
        order, warning = order_of(sampler, 10, seed=0)
        assert isinstance(order, DrawnOrder) and order.how == "generator" and warning is None
        assert torch.equal(order.indices(4, torch.zeros(0, dtype=torch.long), 0, 3),
                           order_of(sampler, 10, seed=0)[0].indices(
                               4, torch.zeros(0, dtype=torch.long), 0, 3))


def test_the_guard_finds_nan_inputs_in_a_map_style_dataset_of_tuples_or_dicts():
    from torch.utils.data import TensorDataset

    from ironloop.data.source import nonfinite_inputs

    x = torch.zeros(4, 3)
    x[2, 1] = float("nan")
    pairs = TensorDataset(x, torch.arange(4))  # not TensorData: read sample by sample
    assert nonfinite_inputs(pairs, [0, 1, 2, 3]) == [2]
    records = [{"x": x[i], "mask": torch.ones(3, dtype=torch.long)} for i in range(4)]
    records[3]["x"] = torch.full((3,), float("inf"))
    assert nonfinite_inputs(records, [1, 2, 3]) == [2, 3]


def test_an_empty_validation_set_counts_as_none_for_plateau_and_early_stopping():
    from ironloop.data.loader import TensorData
    from ironloop.data.source import check_needs_val
    from ironloop.errors import ConfigError

    empty = TensorData(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    config = ironloop.Config()
    check_needs_val(config, empty)  # nothing asks for validation
    for key, value, needs in [("schedule.name", "plateau", "schedule.name='plateau' needs"),
                              ("early_stop.patience", 2, "early_stop.patience > 0 needs")]:
        with pytest.raises(ConfigError, match=needs):
            check_needs_val(config.with_overrides({key: value}), empty)
        check_needs_val(config.with_overrides({key: value}), blobs(8))


def test_a_stream_is_described_by_its_datasets_type_and_length_when_it_has_one():

    from ironloop.data.source import describe
    from ironloop.data.stream import Stream

    class Sized(IterableDataset):
        def __iter__(self):
            return iter(range(5))

        def __len__(self):
            return 5

    class Endless(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    assert describe(Stream(Sized(), 2)) == {"type": "Sized", "size": 5}
    assert describe(Stream(Endless(), 2)) == {"type": "Endless", "size": None}


def test_a_dataloader_over_a_dataset_without_len_is_refused_naming_the_split():
    from ironloop.data.inputs import map_style
    from ironloop.errors import UserError

    class NoLen(Dataset):
        def __getitem__(self, i: int):
            return torch.zeros(2), torch.tensor(0)

    with pytest.raises(UserError, match=r"^val_data: ironloop needs a map-style dataset "
                                        r"\(with __getitem__ and __len__\)"):
        map_style(DataLoader(NoLen(), batch_size=2), "val_data")


def test_a_dataloader_over_a_hugging_face_dataset_keeps_it_formatted_as_torch():
    datasets = pytest.importorskip("datasets")
    from ironloop.data.inputs import map_style

    hf = datasets.Dataset.from_dict({"x": [[0.0], [1.0], [2.0]], "y": [0, 1, 0]})
    got = map_style(DataLoader(hf, batch_size=2), "train_data")
    assert got.dataset.format["type"] == "torch" and len(got.dataset) == 3
    assert torch.equal(got.dataset[1]["x"], torch.tensor([1.0])) and got.batch_size == 2


def byo_module(tmp_path, monkeypatch, name: str, body: str) -> None:
    """A data factory module ``name`` importable from the CWD (a name per test: imports are
    cached)."""
    (tmp_path / f"{name}.py").write_text("import torch\n" + body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_data_factory_gets_data_root_and_its_test_split_is_kept(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data

    byo_module(tmp_path, monkeypatch, "byo_rooted",
               "def data(root):\n"
               "    x = torch.zeros(4, 3)\n"
               "    return (x, torch.zeros(4)), None, (x[:2] + len(root), torch.ones(2))\n")
    bundle = user_data(DataConfig(name="byo_rooted:data", root="some/where"))
    assert bundle.val is None and bundle.input_shape == (3,)
    test_x, test_y = bundle.test  # the third split, as returned: root reached the factory
    assert torch.equal(test_x, torch.full((2, 3), 10.0)) and torch.equal(test_y, torch.ones(2))


def test_a_data_factory_whose_training_split_is_none_says_so(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data
    from ironloop.errors import DataError

    byo_module(tmp_path, monkeypatch, "byo_no_train", "def data():\n    return None, None\n")
    with pytest.raises(DataError, match=r"returned an empty training split \(None\);"):
        user_data(DataConfig(name="byo_no_train:data"))


def test_a_data_factory_whose_training_split_has_no_samples_names_its_type(tmp_path,
                                                                          monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data
    from ironloop.errors import DataError

    byo_module(tmp_path, monkeypatch, "byo_empty_train",
               "from torch.utils.data import TensorDataset\n"
               "def data():\n    return TensorDataset(torch.zeros(0, 3), torch.zeros(0)), None\n")
    with pytest.raises(DataError, match=r"^data factory 'byo_empty_train:data' returned an empty "
                                        r"training split \(a TensorDataset of length 0\); return "
                                        r"at least one training sample$"):
        user_data(DataConfig(name="byo_empty_train:data"))


def test_the_eval_subset_is_max_batches_of_every_rank_and_reads_the_ranks_from_torchrun(
        monkeypatch):
    """eval.max_batches caps each rank's batches, so the shared subset is that many batches of
    every rank: WORLD_SIZE (torchrun's) when the caller does not say, one process without it."""
    from ironloop.config import Config
    from ironloop.data.loader import TensorData
    from ironloop.data.source import eval_subset

    val = TensorData(torch.arange(100.0).unsqueeze(1), torch.zeros(100, dtype=torch.long))
    config = Config().with_overrides({"eval.max_batches": 2, "train.batch_size": 5})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert len(eval_subset(val, config)) == 10
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert len(eval_subset(val, config)) == 30
    assert len(eval_subset(val, config, world_size=2)) == 20


def test_the_doctor_batches_with_the_collate_fn_the_run_will_use():
    """A collate_fn passed to the doctor, or the training DataLoader's, is the one its subject
    (and so every check) batches with; the one passed wins over the loader's."""
    from ironloop.config import Config
    from ironloop.tools.doctor.run import subject

    def passed(batch):
        return torch.utils.data.default_collate(batch)

    def loaders(batch):
        return torch.utils.data.default_collate(batch)

    d = blobs(n=16)
    data = torch.utils.data.TensorDataset(d.x, d.y)
    assert subject(tiny_mlp(), data, None, None, Config(), num_classes=3,
                   collate_fn=passed).collate_fn is passed
    loader = DataLoader(data, batch_size=4, collate_fn=loaders)
    assert subject(tiny_mlp(), loader, None, None, Config(), num_classes=3).collate_fn is loaders
    assert subject(tiny_mlp(), loader, None, None, Config(), num_classes=3,
                   collate_fn=passed).collate_fn is passed


# ------------------------------------------------------------------ inputs -----------------
def test_a_dataloaders_own_collate_fn_is_kept_and_the_default_is_not():
    from ironloop.data.inputs import map_style

    ds = Draws()
    assert map_style(DataLoader(ds, batch_size=4, collate_fn=keep_rows), "d").collate_fn \
        is keep_rows
    given = map_style(DataLoader(ds, batch_size=4), "d")
    assert given.collate_fn is None and given.dataset is ds and given.batch_size == 4


def test_a_plain_tensordataset_becomes_tensordata_even_when_empty():
    """An empty validation split is still in memory (its labels are checked once, in full)."""
    from torch.utils.data import TensorDataset

    from ironloop.data.inputs import map_style
    from ironloop.data.loader import TensorData

    for n in (0, 3):
        given = map_style(TensorDataset(torch.zeros(n, 2), torch.zeros(n)), "d").dataset
        assert isinstance(given, TensorData) and len(given) == n


def test_a_tensordata_in_a_dataloader_is_sliced_whatever_its_collate_fn():
    """TensorData's __getitems__ returns a finished batch: a collate_fn would get it whole."""
    from ironloop.data.inputs import map_style
    from ironloop.data.loader import TensorData

    data = TensorData(torch.zeros(6, 2), torch.zeros(6))
    given = map_style(DataLoader(data, batch_size=3, collate_fn=keep_rows, drop_last=True), "d")
    assert given.dataset is data and given.collate_fn is None
    assert (given.batch_size, given.drop_last) == (3, True)
    # a plain TensorDataset with its own collate_fn is read per sample, with it
    plain = TensorDataset(torch.zeros(6, 2), torch.zeros(6))
    kept = map_style(DataLoader(plain, batch_size=3, collate_fn=keep_rows), "d")
    assert kept.dataset is plain and kept.collate_fn is keep_rows


def test_a_plain_tensordataset_in_a_dataloader_is_sliced_as_tensordata():
    """A DataLoader over in-memory (inputs, targets) with the default collate_fn: one slice per
    batch, with the loader's batching kept."""
    from ironloop.data.inputs import map_style
    from ironloop.data.loader import TensorData

    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    given = map_style(DataLoader(TensorDataset(x, y), batch_size=4, drop_last=True), "d")
    assert isinstance(given.dataset, TensorData) and given.collate_fn is None
    assert given.dataset.x is x and given.dataset.y is y
    assert (given.batch_size, given.drop_last) == (4, True)


def test_a_custom_batch_sampler_is_refused_naming_its_type():
    from ironloop.data.inputs import map_style

    class Buckets(BatchSampler):
        pass

    loader = DataLoader(Draws(), batch_sampler=Buckets(SequentialSampler(range(10)), 2, False))
    with pytest.raises(UserError, match=r"^train_data: the DataLoader's batch_sampler \(Buckets\) "
                                        r"cannot be resumed mid-epoch"):
        map_style(loader, "train_data")


def test_only_datasets_loaders_and_pairs_are_map_style_data():
    from ironloop.data.inputs import map_style

    with pytest.raises(UserError, match="^val_data must be a torch Dataset, a DataLoader, a "
                                        "Hugging Face datasets.Dataset or an \\(inputs, "
                                        "targets\\) pair, not dict$"):
        map_style({"x": 1}, "val_data")
