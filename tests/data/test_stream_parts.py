"""ironloop.data.stream, part by part and in process: which inputs are streams, which resume by
replay, a StreamOrder's epochs, windows and checkpoints, build_order and the first sample."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ironloop.errors import UserError
from tests.data.helpers import (
    Backwards,
    Claims,
    Counting,
    Draws,
    Indexed,
    Stateful,
    data_config,
    keep_rows,
)


# ------------------------------------------------------------------ stream -----------------
class _Buffer:
    """Stand-ins for Hugging Face's private example-iterable chain."""


class BufferShuffledExamplesIterable(_Buffer):
    ex_iterable = None


class _Link:
    def __init__(self, inner):
        self.ex_iterable = inner


class HFLike(IterableDataset):
    def __init__(self, chain):
        self._ex_iterable = chain

    def __iter__(self):
        return iter(())


def test_a_shuffle_buffer_is_found_anywhere_down_hugging_faces_chain():
    from ironloop.data.stream import hf_shuffle_buffer

    assert hf_shuffle_buffer(HFLike(BufferShuffledExamplesIterable()))
    assert hf_shuffle_buffer(HFLike(_Link(_Link(BufferShuffledExamplesIterable()))))
    assert not hf_shuffle_buffer(HFLike(_Link(_Link(None))))
    assert not hf_shuffle_buffer(Counting())


def test_a_stream_that_ends_before_its_len_says_how_many_batches_it_gave():
    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.errors import DataError

    order = StreamOrder(Stream(Claims(40, 104)), 16, 0)
    order.set_epoch(2)
    with pytest.raises(DataError) as e:
        list(order.batches())
    assert str(e.value) == (
        "the training stream Stream(Claims) ended early in epoch 3: 2 full batches of 16 (at "
        "most 32 + 15 samples), but its __len__ says 104; a shard may be missing or truncated, "
        "or __len__ is wrong")


def test_a_stream_one_batch_short_of_its_len_is_what_a_dropped_partial_batch_allows():
    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.errors import DataError

    # 104 claimed: 6 full batches of 16; 95 samples give 5, fewer than 6 - 1 + 1
    order = StreamOrder(Stream(Claims(96, 104)), 16, 0)
    assert len(list(order.batches())) == 6 and order.end == 96
    short = StreamOrder(Stream(Claims(95, 104)), 16, 0)
    with pytest.raises(DataError, match="ended early in epoch 1: 5 full batches"):
        list(short.batches())


def test_a_streams_epoch_is_at_least_one_step_and_counts_a_short_last_window():
    from ironloop.data.stream import Stream, stream_steps

    assert stream_steps(Stream(Claims(10, 10)), 16, 1, max_steps=0) == 1  # no full batch
    assert stream_steps(Stream(Claims(16, 16)), 16, 4, max_steps=0) == 1
    assert stream_steps(Stream(Claims(80, 80)), 16, 4, max_steps=0) == 2  # 5 batches
    assert stream_steps(Stream(Counting()), 16, 4, max_steps=7) == 7  # no __len__


def test_a_streams_own_collate_fn_makes_its_batches():
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Claims(4, 4), collate_fn=keep_rows), 2, 0)
    batches = list(order.batches())
    assert len(batches) == 2 and all(isinstance(b, list) and len(b) == 2 for b in batches)
    assert [float(row[0]) for b in batches for row in b] == [0.0, 1.0, 2.0, 3.0]


def test_what_is_read_as_a_stream_and_what_as_map_style():
    from ironloop.data.stream import Stream, as_stream, is_stateful_loader, is_stream

    ds = Draws()
    assert not is_stream(ds) and not is_stream(DataLoader(ds)) and as_stream(ds, "d") is None
    assert as_stream(None, "d") is None
    assert is_stream(Counting()) and is_stream(DataLoader(Counting(), batch_size=2))
    assert is_stream(Stream(ds)) and not is_stateful_loader(DataLoader(ds))
    s = Stream(ds)
    assert as_stream(s, "d") is s
    plain = as_stream(Counting(), "d")
    assert isinstance(plain.dataset, Counting) and plain.batch_size is None
    from_loader = as_stream(DataLoader(Counting(), batch_size=3), "d")
    assert (from_loader.batch_size, from_loader.collate_fn, from_loader.loader) == (3, None, None)
    own = as_stream(DataLoader(Counting(), batch_size=3, collate_fn=keep_rows), "d")
    assert own.collate_fn is keep_rows
    with pytest.raises(UserError, match=r"^train_data: a DataLoader with batch_size=None \(a "
                                        r"dataset that yields whole batches\) is not supported"):
        as_stream(DataLoader(Counting(), batch_size=None), "train_data")


def test_a_passed_stateful_loader_is_the_stream_with_its_batch_size_and_collate_fn():
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ironloop.data.stream import as_stream, is_stateful_loader, is_stream

    loader = StatefulDataLoader(Draws(), batch_size=4, collate_fn=keep_rows)
    assert is_stateful_loader(loader) and is_stream(loader)
    s = as_stream(loader, "d")
    assert (s.dataset, s.batch_size, s.collate_fn, s.loader) == (loader.dataset, 4, keep_rows,
                                                                loader)
    assert s.samples == 10  # a map-style dataset's length, through its loader


def test_a_streams_samples_are_its_len_or_none():
    from ironloop.data.stream import Stream

    assert Stream(Claims(3, 7)).samples == 7
    assert Stream(Counting()).samples is None
    assert repr(Stream(Counting())) == "Stream(Counting)"


def test_an_eval_stream_is_refused_naming_the_split_and_its_type():
    from ironloop.data.stream import refuse_eval_stream

    refuse_eval_stream(None, "val_data")
    refuse_eval_stream(Draws(), "val_data")
    with pytest.raises(UserError, match=r"^val_data\['b'\] is a stream \(Counting\); evaluation "
                                        r"reads a map-style dataset"):
        refuse_eval_stream(Counting(), "val_data['b']")


def test_which_streams_resume_by_replay():
    from ironloop.data.stream import Stream, resumes_by_replay
    from ironloop.errors import ConfigError

    assert resumes_by_replay(Stream(Claims(4, 4)), "auto")
    assert not resumes_by_replay(Stream(Stateful(4, 4)), "auto")
    assert resumes_by_replay(Stream(Stateful(4, 4)), "replay")
    assert not resumes_by_replay(Stream(Stateful(4, 4)), "state")
    assert not resumes_by_replay(Stream(Claims(4, 4), loader=object()), "replay")
    with pytest.raises(ConfigError, match=r"^data.stream_resume=state: Claims has no "
                                          r"state_dict\(\)/load_state_dict\(\); implement them"):
        resumes_by_replay(Stream(Claims(4, 4)), "state")


def test_the_replay_warning_names_a_shuffle_buffer_as_the_reason():
    from ironloop.data.stream import Stream, replay_warning

    text = replay_warning(Stream(HFLike(BufferShuffledExamplesIterable())))
    assert text.startswith("warning: HFLike is a stream and its shuffle buffer is not part of "
                           "its state_dict (Hugging Face drops it on resume): a mid-epoch "
                           "resume reads again")


def test_a_stream_orders_counts_and_epochs():
    from ironloop.data.stream import Stream, StreamOrder

    s = Stream(Stateful(40, 40))
    order = StreamOrder(s, 4, 9, accumulation=2, rank=1, world_size=3)
    assert order.dataset is s and order.global_batch == 12 and order.expected == 40
    assert order.usable > 10**15 and order.indices(0, 8) == []
    assert order.nonfinite_inputs([1, 2]) == [] and order.close() is None
    order.set_skip([5, 3, 5])
    assert order.skip == [3, 5]
    order.pending = {"held": 1}
    order.set_epoch(2, 24)
    assert (order.epoch, order.offset, order.end, order.pending) == (2, 24, None, {"held": 1})
    order.set_epoch(3)
    assert (order.epoch, order.offset, order.pending) == (3, 0, None)
    assert StreamOrder(Stream(Stateful(40, 40), loader=object()), 4, 0).expected is None


def test_build_order_gives_the_stream_order_this_processs_rank_and_world_size():
    from ironloop.config import Config
    from ironloop.data.stream import Stream, build_order

    order = build_order(Config(), Stream(Stateful(40, 40)), 1, 2, torch.device("cpu"))
    assert (order.rank, order.world_size) == (1, 2)
    assert order.global_batch == 2 * Config().train.batch_size


def test_a_replayed_stream_passes_set_epoch_on_to_its_dataset():
    from ironloop.data.stream import Replayed

    class Epoched(Claims):
        epoch = None

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    inner = Epoched(3, 3)
    Replayed(inner).set_epoch(4)
    assert inner.epoch == 4
    Replayed(Claims(3, 3)).set_epoch(4)  # a stream without set_epoch: nothing to pass on


def test_a_stream_checkpoint_from_other_workers_is_refused_only_mid_epoch():
    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.errors import CheckpointError

    state = {"seed": 1, "epoch": 2, "offset": 32, "num_workers": 2, "loader": None,
             "stream": True}
    order = StreamOrder(Stream(Stateful(40, 40)), 16, 0)
    with pytest.raises(CheckpointError) as e:
        order.load_state_dict(state)
    assert str(e.value) == (
        "the checkpoint stopped mid-epoch in a stream read by data.num_workers=2; a stream's "
        "order and state depend on its workers, so resume with data.num_workers=2 (it may "
        "change at an epoch boundary)")
    order.load_state_dict({**state, "offset": 0})
    assert (order.seed, order.epoch, order.offset) == (1, 2, 0)
    user = StreamOrder(Stream(Stateful(40, 40), loader=object()), 16, 0)
    user.load_state_dict(state)  # the user's loader: its state, whatever data.num_workers
    assert user.offset == 32


def test_a_mid_epoch_stream_checkpoint_without_loader_state_is_refused():
    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.errors import CheckpointError

    order = StreamOrder(Stream(Stateful(40, 40)), 16, 0)
    order.load_state_dict({"seed": 0, "epoch": 0, "offset": 16, "num_workers": 0,
                           "loader": None, "stream": True})
    with pytest.raises(CheckpointError, match="^the checkpoint stopped mid-epoch in a stream "
                                              "but holds no loader state;"):
        list(order.batches())


def test_a_stream_that_yields_more_than_its_len_is_an_error_naming_it():
    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.errors import DataError

    order = StreamOrder(Stream(Claims(40, 31)), 16, 0)
    with pytest.raises(DataError) as e:
        list(order.batches())
    assert str(e.value) == (
        "the training stream Stream(Claims) yielded more than its __len__ of 31 samples in "
        "epoch 1: its __len__ is wrong; make it return the samples it yields per epoch (per "
        "process), or remove it and set train.max_steps")
    assert len(list(StreamOrder(Stream(Claims(40, 32)), 16, 0).batches())) == 2


class Breaks(IterableDataset):
    def __iter__(self):
        for i in range(5):
            yield torch.tensor([float(i)]), torch.tensor(0)
        raise OSError("shard 3 truncated")


def test_a_stream_that_fails_says_where_in_the_epoch():
    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.errors import DataError

    order = StreamOrder(Stream(Breaks()), 2, 0, accumulation=2)
    order.set_epoch(1)
    got = []
    with pytest.raises(DataError) as e:
        for batch in order.batches():
            got.append(batch)
    assert len(got) == 2
    assert str(e.value) == (
        "the training stream Stream(Breaks) failed in epoch 2 reading batch 3 (after 4 samples "
        "on this process): OSError: shard 3 truncated. Fix or remove that shard or sample and "
        "resume with --resume; the checkpoints written so far are intact")


def test_a_stream_ends_its_epoch_one_window_ahead_with_its_true_size():
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Claims(10, 10)), 2, 0, accumulation=2)
    seen = []
    for _ in order.batches():
        seen.append((len(seen), order.end))
    # 5 batches: windows of 2, 2 and 1; the last window is read before its batch is served
    assert seen == [(0, None), (1, None), (2, None), (3, None), (4, 10)]
    assert order.loader is None and order.usable == 10


def test_reading_a_stream_leaves_the_global_rng_and_torchdatas_log_level_alone():
    import logging

    from ironloop.data.stream import Stream, StreamOrder

    log = logging.getLogger("torchdata.stateful_dataloader.stateful_dataloader")
    log.setLevel(logging.INFO)
    torch.manual_seed(11)
    expected = torch.rand(2)
    torch.manual_seed(11)
    assert len(list(StreamOrder(Stream(Claims(8, 8)), 2, 0).batches())) == 4
    assert torch.equal(torch.rand(2), expected)
    assert log.level == logging.INFO
    log.setLevel(logging.NOTSET)


def test_the_first_sample_leaves_every_rng_as_it_was_and_is_none_for_unpaired_batches():
    import random

    import numpy as np

    from ironloop.data.stream import Stream, first_sample

    class Draws(IterableDataset):
        def __iter__(self):
            random.random(), np.random.rand(), torch.rand(1)
            yield torch.zeros(2), torch.tensor(1)

    class Single(IterableDataset):
        def __iter__(self):
            yield torch.zeros(2)

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = random.random(), np.random.rand(), torch.rand(1)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    x, y = first_sample(Stream(Draws()))
    assert torch.equal(x, torch.zeros(2)) and int(y) == 1
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert first_sample(Stream(Single())) is None
    assert first_sample(Stream(Breaks())) is not None


# ------------------------------------------------------------------ arguments passed on ----
def test_the_loader_built_for_a_stream_has_the_orders_batching_pinning_and_epoch_seed():
    from ironloop.data.seeding import derive_seed
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Claims(8, 8), collate_fn=keep_rows), 2, seed=7, pin_memory=True)
    order.set_epoch(3)
    loader = order.open()
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (2, True, 0)
    assert loader.pin_memory is True and loader.collate_fn is keep_rows
    assert loader.generator.initial_seed() == derive_seed(7, 3, "loader")
    assert StreamOrder(Stream(Claims(8, 8)), 2, 0).open().pin_memory is False


def test_a_users_stateful_loaders_generator_is_reseeded_and_its_sampler_told_the_epoch():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ironloop.data.seeding import derive_seed
    from ironloop.data.stream import Stream, StreamOrder

    ds = Indexed(6)
    user = StatefulDataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator())
    order = StreamOrder(Stream(ds, 2, loader=user), 2, seed=7)
    order.set_epoch(3)
    assert order.open() is user
    assert user.generator.initial_seed() == derive_seed(7, 3, "loader")
    backwards = Backwards(6)
    ordered = StatefulDataLoader(ds, batch_size=2, sampler=backwards)
    order = StreamOrder(Stream(ds, 2, loader=ordered), 2, seed=7)
    order.set_epoch(4)
    assert order.open() is ordered and backwards.epoch == 4  # its sampler learns the epoch


def test_build_order_takes_its_batching_workers_resume_mode_and_pinning_from_the_config():
    from ironloop.data.stream import Stream, build_order

    config = data_config(**{"train.batch_size": 4, "train.accumulation_steps": 3, "run.seed": 11,
                        "data.num_workers": 2, "data.pin_memory": True,
                        "data.stream_resume": "replay"})
    order = build_order(config, Stream(Stateful(40, 40)), 0, 1, torch.device("cuda"))
    assert (order.batch_size, order.accumulation, order.seed) == (4, 3, 11)
    assert (order.num_workers, order.pin_memory, order.replay) == (2, True, True)
    assert order.device == torch.device("cuda") and order.steps_per_epoch == 4  # 10 batches / 3
    on_cpu = build_order(config, Stream(Stateful(40, 40)), 0, 1, torch.device("cpu"))
    assert on_cpu.pin_memory is False


def test_under_ddp_a_stream_window_is_the_fewest_batches_any_rank_has(monkeypatch):
    from ironloop.data.stream import Stream, StreamOrder

    seen = []

    def all_reduce(t, op):
        seen.append((t.tolist(), op))
        t.fill_(1)  # another rank has one batch

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    order = StreamOrder(Stream(Claims(8, 8)), 2, 0, rank=1, world_size=2)
    assert order._agree(3) == 1
    assert seen == [([3], torch.distributed.ReduceOp.MIN)]
    assert StreamOrder(Stream(Claims(8, 8)), 2, 0)._agree(3) == 3 and len(seen) == 1


def test_a_stream_that_cannot_be_copied_offers_no_first_sample():
    import threading

    from ironloop.data.stream import Stream, first_sample

    class Locked(Counting):
        lock = None

        def __init__(self):
            self.lock = threading.Lock()  # deepcopy cannot copy a lock

    assert first_sample(Stream(Locked())) is None
    assert first_sample(Stream(Counting()))[0].tolist() == [0.0] * 5


def test_a_map_style_stateful_loaders_epoch_is_its_own_length_in_batches():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ironloop.data.stream import Stream, stream_steps

    loader = StatefulDataLoader(Indexed(10), batch_size=3)  # 4 batches, the last of 1
    stream = Stream(loader.dataset, 3, loader=loader)
    assert stream.samples == 10
    assert stream_steps(stream, 3, 3, max_steps=0) == 2 and stream_steps(stream, 3, 4, 0) == 1
    assert stream_steps(Stream(Claims(10, 10)), 3, 3, max_steps=0) == 1  # 3 full batches
