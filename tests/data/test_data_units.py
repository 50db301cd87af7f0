"""ironloop.data, unit by unit: exact behaviour of its small pieces (the orders, samplers,
inputs, sources, streams and LM datasets), in process and fast. The end-to-end contracts (a
resume is exact, a DataLoader keeps its meaning) are in test_data_*.py, test_stream.py and
test_lm.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

from ironloop.errors import UserError

NONE = torch.zeros(0, dtype=torch.long)


class Noisy(Dataset):
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


def _collate(rows):
    return rows


# ------------------------------------------------------------------ seeding ----------------
def test_a_seeded_datasets_sample_draws_from_seed_epoch_and_index():
    from ironloop.data.seeding import SeededDataset, seed_sample

    ds = SeededDataset(Noisy(), seed=5)
    seed_sample(5, 2, 7)
    expected = torch.rand(3)
    assert torch.equal(ds[(2, 7)], expected)
    assert torch.equal(ds.__getitems__([(2, 7)])[0], expected)
    assert not torch.equal(ds[(3, 7)], expected)  # another epoch, another draw
    assert len(ds) == 10


# ------------------------------------------------------------------ order ------------------
def test_a_permutation_computes_in_int64_whatever_the_positions_integer_type():
    from ironloop.data.order import KeyedOrder

    perm = KeyedOrder(5000, seed=3, shuffle=True).permutation(1)
    wide = perm(torch.arange(5000))
    assert wide.dtype == torch.long and sorted(wide.tolist()) == list(range(5000))
    assert torch.equal(perm(torch.arange(5000, dtype=torch.int32)), wide)


# ------------------------------------------------------------------ loader -----------------
def test_a_samplers_permutation_is_its_whole_epoch_without_the_skipped_samples():
    from ironloop.data.loader import EpochSampler

    sampler = EpochSampler(20, 4, seed=1, shuffle=True)
    sampler.set_epoch(3)
    whole = sampler.permutation()
    assert sorted(whole.tolist()) == list(range(20))
    assert whole.tolist() == sampler.indices(0, 20)
    sampler.set_skip([4, 9])
    assert sampler.permutation().tolist() == [i for i in whole.tolist() if i not in (4, 9)]


# ------------------------------------------------------------------ lm ---------------------
def test_batchify_needs_two_tokens_per_stream_and_drops_the_tail():
    from ironloop.data.lm import batchify

    assert batchify(torch.arange(5), 2).tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="^3 tokens cannot make 2 streams of at least 2$"):
        batchify(torch.arange(3), 2)
    with pytest.raises(ValueError, match=r"^tokens must be a 1-D sequence, got shape \(2, 2\)$"):
        batchify(torch.zeros(2, 2), 1)


def test_packed_sequences_need_one_block_of_seq_len_plus_one_tokens():
    from ironloop.data.lm import PackedSequences

    one = PackedSequences(torch.arange(5), 4)
    assert len(one) == 1 and [t.tolist() for t in one[0]] == [[0, 1, 2, 3], [1, 2, 3, 4]]
    for short in (4, 3):
        with pytest.raises(ValueError, match=f"^{short} tokens make no block of seq_len \\+ 1 "
                                             f"= 5$"):
            PackedSequences(torch.arange(short), 4)
    with pytest.raises(ValueError, match="make no block of seq_len"):
        PackedSequences(torch.arange(5), 0)


# ------------------------------------------------------------------ inputs -----------------
def test_a_dataloaders_own_collate_fn_is_kept_and_the_default_is_not():
    from ironloop.data.inputs import map_style

    ds = Noisy()
    assert map_style(DataLoader(ds, batch_size=4, collate_fn=_collate), "d").collate_fn \
        is _collate
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
    given = map_style(DataLoader(data, batch_size=3, collate_fn=_collate, drop_last=True), "d")
    assert given.dataset is data and given.collate_fn is None
    assert (given.batch_size, given.drop_last) == (3, True)
    # a plain TensorDataset with its own collate_fn is read per sample, with it
    plain = TensorDataset(torch.zeros(6, 2), torch.zeros(6))
    kept = map_style(DataLoader(plain, batch_size=3, collate_fn=_collate), "d")
    assert kept.dataset is plain and kept.collate_fn is _collate


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

    loader = DataLoader(Noisy(), batch_sampler=Buckets(SequentialSampler(range(10)), 2, False))
    with pytest.raises(UserError, match=r"^train_data: the DataLoader's batch_sampler \(Buckets\) "
                                        r"cannot be resumed mid-epoch"):
        map_style(loader, "train_data")


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

    data = RunData(None, Noisy(), {}, None, _collate)  # type: ignore[arg-type]
    loader = data.once_over_train(4, rank=0, size=1)
    assert isinstance(loader, DataLoader) and loader.num_workers == 0
    assert loader.collate_fn is _collate and not loader.pin_memory


# ------------------------------------------------------------------ user -------------------
def test_a_data_factorys_stream_offers_its_first_samples_shape(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data

    (tmp_path / "byo_units_stream.py").write_text(
        "from tests.data.test_data_units import Counting\n"
        "def data():\n"
        "    return Counting(), None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = user_data(DataConfig(name="byo_units_stream:data"))
    assert bundle.input_shape == (5,) and isinstance(bundle.train, Counting)


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


def test_an_eval_sampler_serves_the_order_it_is_given():
    from ironloop.data.loader import EvalSampler
    from ironloop.data.order import KeyedOrder

    order = KeyedOrder(9, seed=4, shuffle=True)
    sampler = EvalSampler(9, 4, seed=0, shuffle=False, order=order)
    assert sampler.permutation().tolist() == order.indices(0, NONE, 0, 9).tolist()
    assert sampler.permutation().tolist() != list(range(9))


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


class Claims(IterableDataset):
    """A stream of ``n`` samples whose __len__ says ``claims``."""

    def __init__(self, n: int, claims: int):
        self.n, self.claims = n, claims

    def __len__(self) -> int:
        return self.claims

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(0)


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

    order = StreamOrder(Stream(Claims(4, 4), collate_fn=_collate), 2, 0)
    batches = list(order.batches())
    assert len(batches) == 2 and all(isinstance(b, list) and len(b) == 2 for b in batches)
    assert [float(row[0]) for b in batches for row in b] == [0.0, 1.0, 2.0, 3.0]


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


@pytest.mark.parametrize("from_loader, world, text", [
    (True, 1, "val_data has 6 streams but evaluates in batches of 4 (its DataLoader's batch "
              "size); pass it as DataLoader(val, batch_size=6) so that each batch takes one "
              "chunk of every stream"),
    (False, 2, "test_data has 6 streams but evaluates in batches of 4 x 2 processes "
               "(train.batch_size, its batch size); pass it as DataLoader(test, batch_size=3) "
               "so that each batch takes one chunk of every stream"),
])
def test_contiguous_streams_evaluated_in_other_batches_are_refused_saying_which(
        from_loader, world, text):
    from ironloop.data.lm import ContiguousStreams, check_eval_order
    from ironloop.errors import ConfigError

    data = ContiguousStreams(torch.arange(60), streams=6, bptt=3)
    what = "val_data" if world == 1 else "test_data"
    with pytest.raises(ConfigError) as e:
        check_eval_order(data, what, 4, world, in_order=True, from_loader=from_loader)
    assert str(e.value) == text
    check_eval_order(data, what, 6 // world, world, in_order=True, from_loader=from_loader)
    with pytest.raises(ConfigError, match=f"^{what}: its DataLoader's sampler would read"):
        check_eval_order(data, what, 6 // world, world, in_order=False, from_loader=True)


# ------------------------------------------------------------------ loaders ----------------
def test_a_loaders_worker_seeds_come_from_the_run_seed_and_its_epoch():
    """A DataLoader draws its workers' base seed from its generator: seeded from (seed, epoch)
    for one epoch's loader, from (seed, "every epoch") for the run's persistent one."""
    from ironloop.data.loader import EpochSampler, make_loader
    from ironloop.data.seeding import derive_seed

    sampler = EpochSampler(10, 2, seed=3, shuffle=True)
    sampler.set_epoch(2)
    once = make_loader(Noisy(), sampler, num_workers=0, pin_memory=False)
    assert once.generator.initial_seed() == derive_seed(3, 2, "loader")
    run = make_loader(Noisy(), sampler, num_workers=0, pin_memory=False, persistent=True)
    assert run.generator.initial_seed() == derive_seed(3, "every epoch", "loader")


def test_the_epoch_loader_keeps_one_loader_for_the_run_unless_samples_are_unseeded():
    from ironloop.data.loader import EpochLoader, EpochSampler
    from ironloop.data.seeding import derive_seed

    sampler = EpochSampler(10, 5, seed=3, shuffle=False)
    loader = EpochLoader(Noisy(), sampler, num_workers=0, pin_memory=False)
    assert len(list(loader)) == 2
    kept = loader._loader
    assert kept.generator.initial_seed() == derive_seed(3, "every epoch", "loader")
    sampler.set_epoch(1)
    assert len(list(loader)) == 2 and loader._loader is kept  # the same loader, next epoch
    loader.close()
    assert loader._loader is None
    sampler.set_epoch(4)
    unseeded = EpochLoader(Noisy(), sampler, num_workers=0, pin_memory=False,
                           seed_samples=False)
    list(unseeded)
    assert unseeded._loader.generator.initial_seed() == derive_seed(3, 4, "loader")


# ------------------------------------------------------------------ the keyed order --------
def _reference_order(n: int, seed: int, epoch: int) -> list[int]:
    """data/order.py's docstring, written out in plain Python ints: a 6-round balanced Feistel
    network on the smallest even number of bits (at least 2) that covers n, keyed by
    derive_seed(seed, epoch, "order", round), each round's function a 32-bit multiply-xorshift
    hash, cycle-walked back into [0, n)."""
    import hashlib

    def seed_of(*parts) -> int:
        digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def mix(x: int) -> int:
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
        return (x >> 16) ^ x

    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = 2**half - 1
    keys = [seed_of(seed, epoch, "order", r) % 2**32 for r in range(6)]

    def network(x: int) -> int:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (mix(right ^ k) & mask)
        return (left << half) | right

    out = []
    for p in range(n):
        y = network(p)
        while y >= n:
            y = network(y)
        out.append(y)
    return out


@pytest.mark.parametrize("n, seed, epoch", [(10, 0, 0), (64, 3, 1), (100, 7, 2), (1000, 1, 5)])
def test_the_keyed_order_is_the_documented_feistel_network(n, seed, epoch):
    """The order is part of a checkpoint's meaning (a resume slices it at the saved offset): it
    must stay the documented function of (seed, epoch), release after release."""
    from ironloop.data.order import KeyedOrder

    got = KeyedOrder(n, seed, shuffle=True).indices(epoch, NONE, 0, n).tolist()
    assert got == _reference_order(n, seed, epoch)


def test_derive_seed_is_blake2b_of_the_parts_joined_by_colons_in_63_bits():
    import hashlib

    from ironloop.data.seeding import derive_seed

    digest = hashlib.blake2b(b"3:1:order:0", digest_size=8).digest()
    assert derive_seed(3, 1, "order", 0) == int.from_bytes(digest, "little") & (2**63 - 1)
    assert 0 <= derive_seed("eval-subset") < 2**63


# ------------------------------------------------------------------ stream units -----------
class Stateful(Claims):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_what_is_read_as_a_stream_and_what_as_map_style():
    from ironloop.data.stream import Stream, as_stream, is_stateful_loader, is_stream

    ds = Noisy()
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
    own = as_stream(DataLoader(Counting(), batch_size=3, collate_fn=_collate), "d")
    assert own.collate_fn is _collate
    with pytest.raises(UserError, match=r"^train_data: a DataLoader with batch_size=None \(a "
                                        r"dataset that yields whole batches\) is not supported"):
        as_stream(DataLoader(Counting(), batch_size=None), "train_data")


def test_a_passed_stateful_loader_is_the_stream_with_its_batch_size_and_collate_fn():
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ironloop.data.stream import as_stream, is_stateful_loader, is_stream

    loader = StatefulDataLoader(Noisy(), batch_size=4, collate_fn=_collate)
    assert is_stateful_loader(loader) and is_stream(loader)
    s = as_stream(loader, "d")
    assert (s.dataset, s.batch_size, s.collate_fn, s.loader) == (loader.dataset, 4, _collate,
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
    refuse_eval_stream(Noisy(), "val_data")
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


# ------------------------------------------------------------------ source units -----------
def _config(**keys):
    from ironloop.config import Config

    return Config().with_overrides(keys)


def test_a_plain_test_split_is_batched_with_the_training_dataloaders_collate_fn():
    """As validation is: a plain dataset evaluates in train.batch_size with the collate_fn the
    training DataLoader brought (it may be what turns samples into tensors)."""
    from ironloop.data.source import open_data

    config = _config(**{"train.batch_size": 4, "data.val_fraction": 0.0})
    train = DataLoader(Indexed(8), batch_size=4, collate_fn=_collate)
    test = TensorDataset(torch.zeros(3, 2), torch.zeros(3))
    data = open_data(config, train, None, test, 0, 1, torch.device("cpu"))
    assert data.batching["test"].collate_fn is _collate
    assert data.batching["test"].batch_size == 4
    data.close()


def test_a_stream_runs_validation_keeps_the_val_dataloaders_own_batch_size():
    """A stream trains, but its validation DataLoader is evaluated as it was given (batch size
    and collate_fn), as beside map-style training data."""
    from ironloop.data.source import open_data

    config = _config(**{"train.batch_size": 2, "train.max_steps": 3})
    val = DataLoader(TensorDataset(torch.zeros(6, 5), torch.zeros(6)), batch_size=3,
                     collate_fn=_collate)
    data = open_data(config, Counting(), val, None, 0, 1, torch.device("cpu"))
    assert data.collate_fn is None  # the stream branch: its batches come from the stream
    assert data.batching["val"].batch_size == 3 and data.batching["val"].collate_fn is _collate
    data.close()


def test_open_data_splits_a_map_style_run_and_counts_its_steps(capsys):
    from ironloop.data.source import MapSource, open_data

    config = _config(**{"train.batch_size": 4, "train.accumulation_steps": 2, "data.shuffle":
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
    config = _config(**{"train.batch_size": 4})
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
        open_data(_config(), Indexed(0), None, None, 0, 1, torch.device("cpu"))


def test_a_batch_larger_than_the_training_split_is_one_step_and_a_warning(capsys):
    from ironloop.data.source import _warn_batch_size

    _warn_batch_size(_config(**{"train.batch_size": 8}), 10, 2, 0)
    assert capsys.readouterr().out == (
        "warning: train.batch_size=8 x 2 processes is larger than the training split (10 "
        "samples): each epoch is a single optimizer step; lower train.batch_size\n")
    _warn_batch_size(_config(**{"train.batch_size": 16}), 10, 1, 0)
    assert capsys.readouterr().out.startswith("warning: train.batch_size=16 is larger than the "
                                              "training split (10 samples)")
    _warn_batch_size(_config(**{"train.batch_size": 5}), 10, 2, 0)  # exactly the split
    _warn_batch_size(_config(**{"train.batch_size": 16}), 10, 1, 1)  # not rank 0
    assert capsys.readouterr().out == ""


def test_a_passed_dataloaders_batch_size_becomes_the_runs():
    from ironloop.data.source import resolve_batch_size

    config = _config(**{"train.batch_size": 32})
    assert resolve_batch_size(config, DataLoader(Noisy(), batch_size=5)).train.batch_size == 5
    assert resolve_batch_size(config, DataLoader(Counting(), batch_size=3)).train.batch_size == 3
    assert resolve_batch_size(config, Noisy()) is config
    assert resolve_batch_size(config, DataLoader(Noisy(), batch_size=32)) is config


def test_validation_sets_by_name_and_their_batching():
    from ironloop.data.source import validation_sets
    from ironloop.errors import DataError

    a, b = Indexed(4), Indexed(6)
    sets, batching = validation_sets({"a": a, "b": DataLoader(b, batch_size=3, drop_last=True)},
                                     _config(**{"train.batch_size": 2}), _collate, 1)
    assert sets == {"a": a, "b": b}
    assert batching["val_a"].batch_size == 2 and batching["val_a"].collate_fn is _collate
    assert (batching["val_b"].batch_size, batching["val_b"].drop_last) == (3, True)
    assert validation_sets(None, _config(), None, 1) == ({}, {"val": batching["val_a"].__class__(
        _config().train.batch_size, None, None)})
    with pytest.raises(DataError, match=r"^val_data\['a'\] is None; give each named set a "
                                        r"dataset, or leave 'a' out"):
        validation_sets({"a": None}, _config(), None, 1)
    with pytest.raises(DataError, match=r"^val_data=\{\} names no validation set"):
        validation_sets({}, _config(), None, 1)


def test_plateau_and_early_stopping_need_validation_data():
    from ironloop.data.source import check_needs_val
    from ironloop.errors import ConfigError

    plateau = _config(**{"schedule.name": "plateau"})
    with pytest.raises(ConfigError, match="^schedule.name='plateau' needs validation data to "
                                          "monitor val_loss; set data.val_fraction > 0"):
        check_needs_val(plateau, None)
    check_needs_val(plateau, Indexed(1))
    patient = _config(**{"early_stop.patience": 1})
    with pytest.raises(ConfigError, match="^early_stop.patience > 0 needs validation data"):
        check_needs_val(patient, Indexed(0))
    check_needs_val(_config(), None)


def test_an_eval_subset_keeps_contiguous_streams_whole_and_tensors_sliced():
    from ironloop.data.lm import ContiguousStreams
    from ironloop.data.loader import TensorData
    from ironloop.data.source import eval_subset

    config = _config(**{"eval.max_batches": 2, "train.batch_size": 3})
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
    assert eval_subset(whole, _config(**{"eval.max_batches": 0}), world_size=1) is whole


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


# ------------------------------------------------------------------ arguments passed on ----
def test_the_loader_built_for_a_stream_has_the_orders_batching_pinning_and_epoch_seed():
    from ironloop.data.seeding import derive_seed
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Claims(8, 8), collate_fn=_collate), 2, seed=7, pin_memory=True)
    order.set_epoch(3)
    loader = order.open()
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (2, True, 0)
    assert loader.pin_memory is True and loader.collate_fn is _collate
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


def test_an_inverse_permutation_computes_in_int64_whatever_the_indices_integer_type():
    from ironloop.data.order import KeyedOrder

    perm = KeyedOrder(5000, seed=3, shuffle=True).permutation(1)
    back = perm.inverse(perm(torch.arange(5000)))
    assert back.dtype == torch.long and back.tolist() == list(range(5000))
    assert torch.equal(perm.inverse(perm(torch.arange(5000)).to(torch.int32)), back)


def test_an_eval_sampler_is_rank_zero_of_one_by_default():
    from ironloop.data.loader import EvalSampler

    sampler = EvalSampler(5, 2, seed=0, shuffle=False)
    assert (sampler.rank, sampler.world_size) == (0, 1)
    assert list(sampler) == [[0, 1], [2, 3], [4]] and len(sampler) == 3


def test_a_loader_seeds_each_sample_from_seed_epoch_and_index_by_default():
    from ironloop.data.loader import EpochSampler, make_loader
    from ironloop.data.seeding import seed_sample

    sampler = EpochSampler(10, 2, seed=5, shuffle=False)
    sampler.set_epoch(2)
    first = next(iter(make_loader(Noisy(), sampler, num_workers=0, pin_memory=False)))
    seed_sample(5, 2, 1)
    assert torch.equal(first[1], torch.rand(3))


def test_an_eval_subset_of_contiguous_streams_reads_their_first_chunks():
    from ironloop.data.lm import ContiguousStreams
    from ironloop.data.source import eval_subset

    config = _config(**{"eval.max_batches": 1, "train.batch_size": 3})
    streams = ContiguousStreams(torch.arange(100), streams=3, bptt=4)
    sub = eval_subset(streams, config, world_size=1)
    assert sub.dataset is streams
    assert [torch.equal(sub[k][0], streams[k][0]) for k in range(3)] == [True] * 3


def test_a_data_factory_gets_torchruns_rank_and_world_size(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data

    (tmp_path / "byo_units_ranks.py").write_text(
        "import torch\n"
        "def data(rank, world_size):\n"
        "    n = 2 + rank + 10 * world_size\n"
        "    return (torch.zeros(4, n), torch.zeros(4)), None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert user_data(DataConfig(name="byo_units_ranks:data")).input_shape == (33,)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert user_data(DataConfig(name="byo_units_ranks:data")).input_shape == (12,)


def test_a_loaders_workers_are_shielded_and_seeded_and_persist_only_when_asked():
    from ironloop.data import workers
    from ironloop.data.loader import EpochSampler, _seed_worker, make_loader

    sampler = EpochSampler(10, 2, seed=3, shuffle=False)
    alone = make_loader(Noisy(), sampler, num_workers=0, pin_memory=False, persistent=True)
    assert alone.worker_init_fn is None and not alone.persistent_workers
    pool = make_loader(Noisy(), sampler, num_workers=2, pin_memory=False, persistent=True)
    assert pool.worker_init_fn.func is workers._init
    assert pool.worker_init_fn.args == (_seed_worker,)
    assert pool.num_workers == 2 and pool.persistent_workers
    assert not make_loader(Noisy(), sampler, num_workers=2, pin_memory=False).persistent_workers


def test_build_order_takes_its_batching_workers_resume_mode_and_pinning_from_the_config():
    from ironloop.data.stream import Stream, build_order

    config = _config(**{"train.batch_size": 4, "train.accumulation_steps": 3, "run.seed": 11,
                        "data.num_workers": 2, "data.pin_memory": True,
                        "data.stream_resume": "replay"})
    order = build_order(config, Stream(Stateful(40, 40)), 0, 1, torch.device("cuda"))
    assert (order.batch_size, order.accumulation, order.seed) == (4, 3, 11)
    assert (order.num_workers, order.pin_memory, order.replay) == (2, True, True)
    assert order.device == torch.device("cuda") and order.steps_per_epoch == 4  # 10 batches / 3
    on_cpu = build_order(config, Stream(Stateful(40, 40)), 0, 1, torch.device("cpu"))
    assert on_cpu.pin_memory is False


def test_a_map_sources_loader_takes_workers_pinning_and_sample_seeding_from_the_config():
    from ironloop.data.source import _map_source

    config = _config(**{"train.batch_size": 4, "run.seed": 11, "data.num_workers": 2,
                        "data.pin_memory": True, "data.seed_samples": False,
                        "data.shuffle": False})
    source = _map_source(config, Indexed(10), None, _collate, 1, 2, torch.device("cuda"))
    assert source.loader.options == {"num_workers": 2, "pin_memory": True,
                                     "collate_fn": _collate, "seed_samples": False}
    s = source.sampler
    assert (s.n, s.batch_size, s.seed, s.shuffle, s.rank, s.world_size) == (10, 4, 11, False,
                                                                             1, 2)
    assert source.steps_per_epoch == 2  # ceil(10 / 8)
    cpu = _map_source(config, Indexed(10), None, None, 0, 1, torch.device("cpu"))
    assert cpu.loader.options["pin_memory"] is False


def test_an_eval_loader_takes_workers_pinning_and_sample_seeding_from_the_config():
    from ironloop.data.source import EvalBatching, eval_loader

    config = _config(**{"data.num_workers": 2, "data.pin_memory": True,
                        "data.seed_samples": False, "run.seed": 11})
    loader = eval_loader(Indexed(7), EvalBatching(2, collate_fn=_collate, drop_last=True),
                         config, 1, 2, torch.device("cuda"))
    assert (loader.num_workers, loader.pin_memory, loader.collate_fn) == (2, True, _collate)
    s = loader.batch_sampler  # unseeded samples: the sampler itself, not keyed batches
    assert (s.seed, s.rank, s.world_size, s.drop_last, s.shuffle) == (11, 1, 2, True, False)
    assert list(s) == [[2, 3]]  # 7 samples, global batches of 4, the tail dropped
    cpu = eval_loader(Indexed(7), EvalBatching(2), config, 0, 1, torch.device("cpu"))
    assert cpu.pin_memory is False


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


def test_a_data_factorys_result_must_name_its_training_split_and_hold_samples(tmp_path,
                                                                               monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data
    from ironloop.errors import ConfigError, DataError

    (tmp_path / "byo_units_shapes.py").write_text(
        "import torch\n"
        "def no_train():\n"
        "    return {'val': None, 'vocab_size': 3}\n"
        "def one():\n"
        "    return [torch.zeros(1)]\n"
        "def number():\n"
        "    return 7\n"
        "def empty_pair():\n"
        "    return (torch.zeros(0, 2), torch.zeros(0)), None\n"
        "def meta():\n"
        "    return {'train': (torch.zeros(3, 2), torch.zeros(3)), 'num_classes': 4, 'k': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^data factory 'byo_units_shapes:no_train' returned "
                                          r"a dict without 'train'; return \{'train': \.\.\., "
                                          r"'val': \.\.\., 'vocab_size': \.\.\.\}$"):
        user_data(DataConfig(name="byo_units_shapes:no_train"))
    for name, kind in (("one", "list"), ("number", "int")):
        with pytest.raises(ConfigError, match=f"^data factory 'byo_units_shapes:{name}' "
                                              f"returned {kind}; return \\(train, val\\) or"):
            user_data(DataConfig(name=f"byo_units_shapes:{name}"))
    with pytest.raises(DataError, match=r"^data factory 'byo_units_shapes:empty_pair' returned "
                                        r"an empty training split \(inputs of length 0\);"):
        user_data(DataConfig(name="byo_units_shapes:empty_pair"))
    bundle = user_data(DataConfig(name="byo_units_shapes:meta"))
    assert (bundle.input_shape, bundle.num_classes) == ((2,), 4)
    assert bundle.meta == {"num_classes": 4, "k": 1} and bundle.val is None


def test_contiguous_streams_refuse_empty_shapes_and_indices_past_their_end():
    from ironloop.data.lm import ContiguousStreams

    for streams, bptt in ((0, 4), (2, 0)):
        with pytest.raises(ValueError, match=f"^streams \\({streams}\\) and bptt \\({bptt}\\) "
                                             f"must be >= 1$"):
            ContiguousStreams(torch.arange(20), streams, bptt)
    data = ContiguousStreams(torch.arange(20), 2, 4)  # rows of 10: chunks at 0, 4, 8
    assert len(data) == 6 and [t.tolist() for t in data[5]] == [[18], [19]]
    for k in (6, -1):
        with pytest.raises(IndexError, match=f"^sample {k} of 6$"):
            data[k]


def test_only_datasets_loaders_and_pairs_are_map_style_data():
    from ironloop.data.inputs import map_style

    with pytest.raises(UserError, match="^val_data must be a torch Dataset, a DataLoader, a "
                                        "Hugging Face datasets.Dataset or an \\(inputs, "
                                        "targets\\) pair, not dict$"):
        map_style({"x": 1}, "val_data")


def test_a_subset_of_an_eval_split_is_read_in_order_whatever_its_loaders_sampler():
    from ironloop.data.source import eval_split

    loader = DataLoader(Indexed(50), batch_size=2, sampler=Backwards(50))
    config = _config(**{"eval.max_batches": 1})
    sub, batching = eval_split(loader, "val_data", config, None, 1)
    assert len(sub) == 2 and batching.sampler is None and batching.batch_size == 2
    whole, kept = eval_split(loader, "val_data", _config(), None, 1)
    assert whole is loader.dataset and kept.sampler is loader.sampler


def test_only_floating_tensors_hold_nonfinite_inputs():
    from ironloop.data.source import _has_nonfinite

    assert _has_nonfinite({"a": ["text", torch.tensor([float("inf")])]})
    assert not _has_nonfinite(["nan", float("nan"), torch.tensor([1, 2])])


def test_a_stream_that_cannot_be_copied_offers_no_first_sample():
    import threading

    from ironloop.data.stream import Stream, first_sample

    class Locked(Counting):
        lock = None

        def __init__(self):
            self.lock = threading.Lock()  # deepcopy cannot copy a lock

    assert first_sample(Stream(Locked())) is None
    assert first_sample(Stream(Counting()))[0].tolist() == [0.0] * 5


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_a_builtin_dataset_with_an_empty_training_split_is_refused():
    from ironloop.config import DataConfig
    from ironloop.data.builtin.datasets import build_data
    from ironloop.errors import DataError

    config = DataConfig(name="synthetic", num_samples=1, val_fraction=0.6, input_shape=[2])
    with pytest.raises(DataError, match="^data.name='synthetic': the training split is empty$"):
        build_data(config)
    assert len(build_data(DataConfig(name="synthetic", num_samples=5, val_fraction=0.2,
                                     input_shape=[2])).train) == 4


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


def test_a_data_factory_that_cannot_be_imported_names_data_name():
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data
    from ironloop.errors import ConfigError

    with pytest.raises(ConfigError, match="^data.name='no_such_module_here:data': cannot import "
                                          "module 'no_such_module_here'"):
        user_data(DataConfig(name="no_such_module_here:data"))


def test_a_map_style_stateful_loaders_epoch_is_its_own_length_in_batches():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ironloop.data.stream import Stream, stream_steps

    loader = StatefulDataLoader(Indexed(10), batch_size=3)  # 4 batches, the last of 1
    stream = Stream(loader.dataset, 3, loader=loader)
    assert stream.samples == 10
    assert stream_steps(stream, 3, 3, max_steps=0) == 2 and stream_steps(stream, 3, 4, 0) == 1
    assert stream_steps(Stream(Claims(10, 10)), 3, 3, max_steps=0) == 1  # 3 full batches


def test_a_bundles_first_validation_set_is_the_first_named_one_or_the_only_one():
    from ironloop.data.bundle import DataBundle

    a, b = Indexed(1), Indexed(2)
    assert DataBundle(a, {"x": b, "y": a}, None, (), None).first_val is b
    assert DataBundle(a, a, None, (), None).first_val is a
    assert DataBundle(a, {}, None, (), None).first_val is None
    assert DataBundle(a, None, None, (), None).meta == {}


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


def test_open_data_refuses_a_stream_loader_that_yields_whole_batches_naming_train_data():
    from ironloop.data.source import open_data

    with pytest.raises(UserError, match=r"^train_data: a DataLoader with batch_size=None \(a "
                                        r"dataset that yields whole batches\) is not supported"):
        open_data(_config(), DataLoader(Counting(), batch_size=None), None, None, 0, 1,
                  torch.device("cpu"))


def test_contiguous_streams_evaluate_from_an_in_order_loader_and_say_whose_batch_size_is_wrong():
    from ironloop.data.lm import ContiguousStreams
    from ironloop.data.source import eval_split
    from ironloop.errors import ConfigError

    streams = ContiguousStreams(torch.arange(100), streams=3, bptt=4)
    config = _config(**{"train.batch_size": 2})
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
        validation_sets({}, _config(), None, 1)
    assert str(e.value) == ("val_data={} names no validation set; pass None for a run without "
                            "validation, or {name: dataset, ...}")
