"""ironloop.data.source: opening a run's data (its splits, validation sets, eval subsets,
batching and the checks on its first samples), in process and fast."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler, TensorDataset

from ironloop.errors import UserError
from tests.data.helpers import Backwards, Claims, Counting, Draws, Indexed, data_config, keep_rows


# ------------------------------------------------------------------ source -----------------
@pytest.mark.parametrize("name", ["Noisy", "A1", "z_2", "9lives"])
def test_a_validation_set_name_may_use_capitals_digits_and_underscores(name):
    from ironloop.data.source import check_set_name

    check_set_name(name)


@pytest.mark.parametrize("name", ["avg", "_x", "a-b", "", 3, "a b"])
def test_a_validation_set_name_that_cannot_name_metrics_is_refused(name):
    from ironloop.data.source import check_set_name

    with pytest.raises(UserError, match=f"^val_data: the set name {name!r} cannot name "
                                        f"metrics;"):
        check_set_name(name)


def test_once_over_train_reads_a_dataset_in_this_process():
    """SWA's BatchNorm pass starts no worker process (a fork per epoch end, for one pass)."""
    from ironloop.data.source import RunData

    data = RunData(None, Draws(), {}, None, keep_rows)  # type: ignore[arg-type]
    loader = data.once_over_train(4, rank=0, size=1)
    assert isinstance(loader, DataLoader) and loader.num_workers == 0
    assert loader.collate_fn is keep_rows and not loader.pin_memory


def test_an_eval_split_is_read_in_its_dataloaders_sampler_order():
    from ironloop.config import Config
    from ironloop.data.source import EvalBatching, eval_loader

    batching = EvalBatching(2, sampler=Backwards(5))
    loader = eval_loader(Indexed(5), batching, Config(), 0, 1, torch.device("cpu"))
    assert [b.flatten().tolist() for b in loader] == [[4, 3], [2, 1], [0]]
    plain = eval_loader(Indexed(5), EvalBatching(2), Config(), 0, 1, torch.device("cpu"))
    assert [b.flatten().tolist() for b in plain] == [[0, 1], [2, 3], [4]]


def test_an_eval_split_gives_each_rank_its_own_share_of_every_global_batch():
    from ironloop.config import Config
    from ironloop.data.source import EvalBatching, eval_loader

    def batches(rank):
        loader = eval_loader(Indexed(7), EvalBatching(2), Config(), rank, 2, torch.device("cpu"))
        return [b.flatten().tolist() for b in loader]

    # global batches of 4: rank 0 the first 2 of each, rank 1 the next; the tail [4, 5, 6] split
    assert batches(0) == [[0, 1], [4, 5]]
    assert batches(1) == [[2, 3], [6]]


# ------------------------------------------------------------------ eval subsets -----------
def test_the_eval_subset_is_the_same_whatever_the_global_rng_state():
    from ironloop.config import Config
    from ironloop.data.source import eval_subset

    config = Config().with_overrides({"eval.max_batches": 2, "train.batch_size": 3})
    torch.manual_seed(0)
    first = eval_subset(Indexed(50), config, world_size=1)
    torch.manual_seed(1)
    again = eval_subset(Indexed(50), config, world_size=1)
    assert list(first.indices) == list(again.indices)
    assert len(first.indices) == 6 and list(first.indices) == sorted(first.indices)
    assert list(first.indices) != list(range(6))  # a random subset, not the first samples


def test_a_plain_test_split_is_batched_with_the_training_dataloaders_collate_fn():
    """As validation is: a plain dataset evaluates in train.batch_size with the collate_fn the
    training DataLoader brought (it may be what turns samples into tensors)."""
    from ironloop.data.source import open_data

    config = data_config(**{"train.batch_size": 4, "data.val_fraction": 0.0})
    train = DataLoader(Indexed(8), batch_size=4, collate_fn=keep_rows)
    test = TensorDataset(torch.zeros(3, 2), torch.zeros(3))
    data = open_data(config, train, None, test, 0, 1, torch.device("cpu"))
    assert data.batching["test"].collate_fn is keep_rows
    assert data.batching["test"].batch_size == 4
    data.close()


def test_a_stream_runs_validation_keeps_the_val_dataloaders_own_batch_size():
    """A stream trains, but its validation DataLoader is evaluated as it was given (batch size
    and collate_fn), as beside map-style training data."""
    from ironloop.data.source import open_data

    config = data_config(**{"train.batch_size": 2, "train.max_steps": 3})
    val = DataLoader(TensorDataset(torch.zeros(6, 5), torch.zeros(6)), batch_size=3,
                     collate_fn=keep_rows)
    data = open_data(config, Counting(), val, None, 0, 1, torch.device("cpu"))
    assert data.collate_fn is None  # the stream branch: its batches come from the stream
    assert data.batching["val"].batch_size == 3 and data.batching["val"].collate_fn is keep_rows
    data.close()


def test_open_data_splits_a_map_style_run_and_counts_its_steps(capsys):
    from ironloop.data.source import MapSource, open_data

    config = data_config(**{"train.batch_size": 4, "train.accumulation_steps": 2, "data.shuffle":
                        False, "data.val_fraction": 0.0})
    val = TensorDataset(torch.zeros(3, 2), torch.zeros(3))
    data = open_data(config, Indexed(21), val, None, 0, 1, torch.device("cpu"))
    assert isinstance(data.source, MapSource) and data.source.steps_per_epoch == 3  # 21/8
    assert data.source.global_batch == 4 and data.source.usable == 21
    assert data.val_sets[""].x.shape == (3, 2) and data.test is None
    assert data.described() == {"train": {"type": "Indexed", "size": 21},
                                "val": {"type": "TensorData", "size": 3}}
    assert [b.flatten().tolist() for b in data.source.batches()][:2] == [[0, 1, 2, 3],
                                                                         [4, 5, 6, 7]]
    assert data.source.indices(4, 6) == [4, 5]
    data.source.set_epoch(1, 8)
    assert data.source.state_dict()["offset"] == 8 and data.source.state_dict()["epoch"] == 1
    assert not data.in_memory() and capsys.readouterr().out == ""
    data.close()


def test_open_data_warns_of_an_empty_validation_split_on_rank_zero_only(capsys):
    from ironloop.data.source import open_data

    empty = TensorDataset(torch.zeros(0, 2), torch.zeros(0))
    train = TensorDataset(torch.zeros(8, 2), torch.zeros(8))
    config = data_config(**{"train.batch_size": 4})
    open_data(config, train, empty, None, 1, 2, torch.device("cpu"))
    assert capsys.readouterr().out == ""
    open_data(config, train, empty, None, 0, 1, torch.device("cpu"))
    assert capsys.readouterr().out == (
        "warning: the validation split is empty (0 samples): this run reports no val_* metric "
        "and best.pt tracks nothing; check data.val_fraction or val_data\n")
    assert open_data(config, train, None, None, 0, 1, torch.device("cpu")).in_memory()


def test_open_data_refuses_an_empty_training_split():
    from ironloop.data.source import open_data
    from ironloop.errors import DataError

    with pytest.raises(DataError, match=r"^the training split is empty \(0 samples\): check"):
        open_data(data_config(), Indexed(0), None, None, 0, 1, torch.device("cpu"))


def test_a_batch_larger_than_the_training_split_is_one_step_and_a_warning(capsys):
    from ironloop.data.source import _warn_batch_size

    _warn_batch_size(data_config(**{"train.batch_size": 8}), 10, 2, 0)
    assert capsys.readouterr().out == (
        "warning: train.batch_size=8 x 2 processes is larger than the training split (10 "
        "samples): each epoch is a single optimizer step; lower train.batch_size\n")
    _warn_batch_size(data_config(**{"train.batch_size": 16}), 10, 1, 0)
    assert capsys.readouterr().out.startswith("warning: train.batch_size=16 is larger than the "
                                              "training split (10 samples)")
    _warn_batch_size(data_config(**{"train.batch_size": 5}), 10, 2, 0)  # exactly the split
    _warn_batch_size(data_config(**{"train.batch_size": 16}), 10, 1, 1)  # not rank 0
    assert capsys.readouterr().out == ""


def test_a_passed_dataloaders_batch_size_becomes_the_runs():
    from ironloop.data.source import resolve_batch_size

    config = data_config(**{"train.batch_size": 32})
    assert resolve_batch_size(config, DataLoader(Draws(), batch_size=5)).train.batch_size == 5
    assert resolve_batch_size(config, DataLoader(Counting(), batch_size=3)).train.batch_size == 3
    assert resolve_batch_size(config, Draws()) is config
    assert resolve_batch_size(config, DataLoader(Draws(), batch_size=32)) is config


def test_validation_sets_by_name_and_their_batching():
    from ironloop.data.source import validation_sets
    from ironloop.errors import DataError

    a, b = Indexed(4), Indexed(6)
    sets, batching = validation_sets({"a": a, "b": DataLoader(b, batch_size=3, drop_last=True)},
                                     data_config(**{"train.batch_size": 2}), keep_rows, 1)
    assert sets == {"a": a, "b": b}
    assert batching["val_a"].batch_size == 2 and batching["val_a"].collate_fn is keep_rows
    assert (batching["val_b"].batch_size, batching["val_b"].drop_last) == (3, True)
    assert validation_sets(None, data_config(), None, 1) == (
        {}, {"val": batching["val_a"].__class__(data_config().train.batch_size, None, None)})
    with pytest.raises(DataError, match=r"^val_data\['a'\] is None; give each named set a "
                                        r"dataset, or leave 'a' out"):
        validation_sets({"a": None}, data_config(), None, 1)
    with pytest.raises(DataError, match=r"^val_data=\{\} names no validation set"):
        validation_sets({}, data_config(), None, 1)


def test_plateau_and_early_stopping_need_validation_data():
    from ironloop.data.source import check_needs_val
    from ironloop.errors import ConfigError

    plateau = data_config(**{"schedule.name": "plateau"})
    with pytest.raises(ConfigError, match="^schedule.name='plateau' needs validation data to "
                                          "monitor val_loss; set data.val_fraction > 0"):
        check_needs_val(plateau, None)
    check_needs_val(plateau, Indexed(1))
    patient = data_config(**{"early_stop.patience": 1})
    with pytest.raises(ConfigError, match="^early_stop.patience > 0 needs validation data"):
        check_needs_val(patient, Indexed(0))
    check_needs_val(data_config(), None)


def test_an_eval_subset_keeps_contiguous_streams_whole_and_tensors_sliced():
    from ironloop.data.lm import ContiguousStreams
    from ironloop.data.loader import TensorData
    from ironloop.data.source import eval_subset

    config = data_config(**{"eval.max_batches": 2, "train.batch_size": 3})
    streams = ContiguousStreams(torch.arange(100), streams=3, bptt=4)
    sub = eval_subset(streams, config, world_size=1)
    assert list(sub.indices) == list(range(6))
    data = TensorData(torch.arange(20.0).unsqueeze(1), torch.arange(20))
    cut = eval_subset(data, config, world_size=1)
    assert isinstance(cut, TensorData) and len(cut) == 6
    assert torch.equal(cut.x.flatten(), cut.y.float()) and cut.y.tolist() == sorted(cut.y.tolist())
    assert eval_subset(Indexed(6), config, world_size=1).__class__ is Indexed  # cap == size
    assert eval_subset(None, config, world_size=1) is None
    whole = Indexed(50)
    assert eval_subset(whole, data_config(**{"eval.max_batches": 0}), world_size=1) is whole


def test_a_split_is_described_by_the_users_type_and_size():
    from ironloop.data.source import describe
    from ironloop.data.stream import Stream

    assert describe(None) is None
    assert describe(Indexed(3)) == {"type": "Indexed", "size": 3}
    assert describe(Stream(Claims(2, 9))) == {"type": "Claims", "size": 9}
    assert describe(Stream(Counting())) == {"type": "Counting", "size": None}


def test_the_nonfinite_inputs_are_found_in_tensors_tuples_and_dicts():
    from ironloop.data.loader import TensorData
    from ironloop.data.source import nonfinite_inputs

    x = torch.zeros(4, 2)
    x[1, 0], x[3, 1] = float("nan"), float("inf")
    assert nonfinite_inputs(TensorData(x, torch.zeros(4)), [0, 1, 2, 3]) == [1, 3]
    assert nonfinite_inputs(TensorData(x, torch.zeros(4)), [3, 0]) == [3]
    ints = TensorData(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4))
    assert nonfinite_inputs(ints, [0, 1]) == []

    class Rows(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 0:
                return {"a": x[1], "b": [1]}, 0
            if i == 1:
                return (torch.zeros(2), [x[3]]), torch.tensor(float("nan"))  # targets: not read
            if i == 2:
                return x[1]  # the sample alone: its inputs
            return torch.zeros(2, dtype=torch.long), 1

    assert nonfinite_inputs(Rows(), [0, 1, 2, 3]) == [0, 1, 2]


def test_the_targets_of_an_inputs_targets_sample_are_not_checked_for_nonfinite_values():
    from ironloop.data.source import nonfinite_inputs

    class Pairs(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(2), torch.tensor(float("nan") if i == 0 else float("inf"))

    assert nonfinite_inputs(Pairs(), [0, 1]) == []


def test_the_first_training_sample_of_a_map_style_run_is_its_first_item():
    from ironloop.data.source import RunData
    from ironloop.data.stream import Stream

    data = RunData(None, Indexed(3), {}, None, None)  # type: ignore[arg-type]
    assert data.first_sample().tolist() == [0] and data.val is None
    streamed = RunData(None, Stream(Counting()), {"": Indexed(2)}, None, None)  # type: ignore[arg-type]
    x, _ = streamed.first_sample()
    assert x.shape == (5,) and streamed.val.n == 2
    assert streamed.once_over_train(2, 0, 1) is None


def test_an_eval_subset_of_contiguous_streams_reads_their_first_chunks():
    from ironloop.data.lm import ContiguousStreams
    from ironloop.data.source import eval_subset

    config = data_config(**{"eval.max_batches": 1, "train.batch_size": 3})
    streams = ContiguousStreams(torch.arange(100), streams=3, bptt=4)
    sub = eval_subset(streams, config, world_size=1)
    assert sub.dataset is streams
    assert [torch.equal(sub[k][0], streams[k][0]) for k in range(3)] == [True] * 3


def test_a_map_sources_loader_takes_workers_pinning_and_sample_seeding_from_the_config():
    from ironloop.data.source import _map_source

    config = data_config(**{"train.batch_size": 4, "run.seed": 11, "data.num_workers": 2,
                        "data.pin_memory": True, "data.seed_samples": False,
                        "data.shuffle": False})
    source = _map_source(config, Indexed(10), None, keep_rows, 1, 2, torch.device("cuda"))
    assert source.loader.options == {"num_workers": 2, "pin_memory": True,
                                     "collate_fn": keep_rows, "seed_samples": False}
    s = source.sampler
    assert (s.n, s.batch_size, s.seed, s.shuffle, s.rank, s.world_size) == (10, 4, 11, False,
                                                                             1, 2)
    assert source.steps_per_epoch == 2  # ceil(10 / 8)
    cpu = _map_source(config, Indexed(10), None, None, 0, 1, torch.device("cpu"))
    assert cpu.loader.options["pin_memory"] is False


def test_an_eval_loader_takes_workers_pinning_and_sample_seeding_from_the_config():
    from ironloop.data.source import EvalBatching, eval_loader

    config = data_config(**{"data.num_workers": 2, "data.pin_memory": True,
                        "data.seed_samples": False, "run.seed": 11})
    loader = eval_loader(Indexed(7), EvalBatching(2, collate_fn=keep_rows, drop_last=True),
                         config, 1, 2, torch.device("cuda"))
    assert (loader.num_workers, loader.pin_memory, loader.collate_fn) == (2, True, keep_rows)
    s = loader.batch_sampler  # unseeded samples: the sampler itself, not keyed batches
    assert (s.seed, s.rank, s.world_size, s.drop_last, s.shuffle) == (11, 1, 2, True, False)
    assert list(s) == [[2, 3]]  # 7 samples, global batches of 4, the tail dropped
    cpu = eval_loader(Indexed(7), EvalBatching(2), config, 0, 1, torch.device("cpu"))
    assert cpu.pin_memory is False


def test_a_subset_of_an_eval_split_is_read_in_order_whatever_its_loaders_sampler():
    from ironloop.data.source import eval_split

    loader = DataLoader(Indexed(50), batch_size=2, sampler=Backwards(50))
    config = data_config(**{"eval.max_batches": 1})
    sub, batching = eval_split(loader, "val_data", config, None, 1)
    assert len(sub) == 2 and batching.sampler is None and batching.batch_size == 2
    whole, kept = eval_split(loader, "val_data", data_config(), None, 1)
    assert whole is loader.dataset and kept.sampler is loader.sampler


def test_only_floating_tensors_hold_nonfinite_inputs():
    from ironloop.data.source import _has_nonfinite

    assert _has_nonfinite({"a": ["text", torch.tensor([float("inf")])]})
    assert not _has_nonfinite(["nan", float("nan"), torch.tensor([1, 2])])


def test_a_bundles_first_validation_set_is_the_first_named_one_or_the_only_one():
    from ironloop.data.bundle import DataBundle

    a, b = Indexed(1), Indexed(2)
    assert DataBundle(a, {"x": b, "y": a}, None, (), None).first_val is b
    assert DataBundle(a, a, None, (), None).first_val is a
    assert DataBundle(a, {}, None, (), None).first_val is None
    assert DataBundle(a, None, None, (), None).meta == {}


def test_open_data_refuses_a_stream_loader_that_yields_whole_batches_naming_train_data():
    from ironloop.data.source import open_data

    with pytest.raises(UserError, match=r"^train_data: a DataLoader with batch_size=None \(a "
                                        r"dataset that yields whole batches\) is not supported"):
        open_data(data_config(), DataLoader(Counting(), batch_size=None), None, None, 0, 1,
                  torch.device("cpu"))


def test_contiguous_streams_evaluate_from_an_in_order_loader_and_say_whose_batch_size_is_wrong():
    from ironloop.data.lm import ContiguousStreams
    from ironloop.data.source import eval_split
    from ironloop.errors import ConfigError

    streams = ContiguousStreams(torch.arange(100), streams=3, bptt=4)
    config = data_config(**{"train.batch_size": 2})
    dataset, batching = eval_split(DataLoader(streams, batch_size=3), "val_data", config, None, 1)
    assert dataset is streams and type(batching.sampler) is SequentialSampler
    with pytest.raises(ConfigError, match=r"^val_data: its DataLoader's sampler would read "):
        eval_split(DataLoader(streams, batch_size=3, shuffle=True), "val_data", config, None, 1)
    with pytest.raises(ConfigError, match=r"^val_data has 3 streams but evaluates in batches of "
                                          r"2 \(its DataLoader's batch size\); pass it as "
                                          r"DataLoader\(val, batch_size=3\)"):
        eval_split(DataLoader(streams, batch_size=2), "val_data", config, None, 1)
    with pytest.raises(ConfigError, match=r"^test_data has 3 streams but evaluates in batches of "
                                          r"2 \(train.batch_size, its batch size\)"):
        eval_split(streams, "test_data", config, None, 1)


def test_an_empty_dict_of_validation_sets_is_refused_saying_what_to_pass():
    from ironloop.data.source import validation_sets
    from ironloop.errors import DataError

    with pytest.raises(DataError) as e:
        validation_sets({}, data_config(), None, 1)
    assert str(e.value) == ("val_data={} names no validation set; pass None for a run without "
                            "validation, or {name: dataset, ...}")
