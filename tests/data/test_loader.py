"""The data loader: EpochSampler order from (seed, epoch) only, resumable at any offset, sharded
by rank; evaluation shards that cover every sample once; workers that leave stop signals."""

from __future__ import annotations

import multiprocessing
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ironloop
from ironloop.data.loader import EpochSampler, EvalSampler, TensorData, make_loader
from ironloop.data.workers import STOP_SIGNALS, shielded
from tests.conftest import blobs, cfg, tiny_mlp
from tests.data.helpers import NONE, Draws


def flat(sampler) -> list[int]:
    return [i for batch in sampler for i in batch]


def test_order_depends_on_seed_and_epoch_not_batch_size():
    a, b = EpochSampler(103, 8, seed=1, shuffle=True), EpochSampler(103, 32, seed=1, shuffle=True)
    assert flat(a) == flat(b) and sorted(flat(a)) == list(range(103))
    a.set_epoch(1)
    assert flat(a) != flat(b)
    assert flat(EpochSampler(103, 8, seed=2, shuffle=True)) != flat(b)


def test_offset_resumes_exactly_where_it_stopped():
    s = EpochSampler(100, 16, seed=0, shuffle=True)
    s.set_epoch(3)
    full = flat(s)
    s.set_epoch(3, offset=48)
    assert flat(s) == full[48:] and len(s) == 4


def test_ranks_split_each_global_batch_and_cover_the_epoch():
    ranks = [EpochSampler(50, 4, seed=0, shuffle=True, rank=r, world_size=3) for r in range(3)]
    served = sorted(i for s in ranks for i in flat(s))
    # 50 = 4 global batches of 12 + a tail of 2 < 3 ranks, which is dropped
    assert ranks[0].usable == 48 and len(served) == 48 and len(set(served)) == 48


def test_state_dict_round_trip_and_dataset_change_is_caught():
    s = EpochSampler(10, 2, seed=3, shuffle=True)
    s.set_epoch(2, 4)
    t = EpochSampler(10, 2, seed=0, shuffle=True)
    t.load_state_dict(s.state_dict())
    assert flat(t) == flat(s)
    other = EpochSampler(11, 2, seed=0, shuffle=True)
    try:
        other.load_state_dict(s.state_dict())
        raise AssertionError("a different dataset size must be refused")
    except ValueError as e:
        assert "10 samples" in str(e)


def test_tensor_batches_are_one_slice_and_workers_give_the_same_batches():
    data = TensorData(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    s = EpochSampler(20, 6, seed=0, shuffle=True)
    plain = list(make_loader(data, s, num_workers=0, pin_memory=False))
    workers = list(make_loader(data, s, num_workers=2, pin_memory=False))
    assert [len(y) for _, y in plain] == [6, 6, 6, 2]
    for (x0, y0), (x1, y1) in zip(plain, workers):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
        assert torch.equal(x0[:, 0], 2.0 * y0)


def test_loader_leaves_the_global_rng_alone():
    data = TensorData(torch.zeros(10, 1), torch.zeros(10, dtype=torch.long))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(make_loader(data, EpochSampler(10, 3, 0, True), num_workers=0, pin_memory=False))
    assert torch.equal(before, torch.get_rng_state())


def test_in_memory_tensors_take_the_sliced_path_with_the_same_weights(tmp_path):
    """A TensorDataset, a DataLoader over one and an (x, y) pair train exactly like TensorData
    (issue 10: one index-slice per batch instead of per-sample __getitem__ + collate)."""

    import ironloop
    from ironloop.data.loader import as_tensor_data
    from tests.conftest import blobs, cfg, tiny_mlp

    d = blobs(n=100)
    forms = {"tensordata": d, "tensordataset": TensorDataset(d.x, d.y),
             "loader": DataLoader(TensorDataset(d.x, d.y), batch_size=32, shuffle=True),
             "pair": (d.x, d.y)}
    fast = {"train__epochs": 1, "checkpoint__enabled": False}
    weights = {name: ironloop.fit(tiny_mlp(), data, None, cfg(tmp_path / name, **fast)).model
               .state_dict()
               for name, data in forms.items()}
    for name in forms:
        assert all(torch.equal(weights[name][k], v) for k, v in weights["tensordata"].items())
    assert isinstance(as_tensor_data(TensorDataset(d.x, d.y)), TensorData)

    class Augmented(TensorDataset):  # its own __getitem__ must run: not converted
        pass

    assert as_tensor_data(Augmented(d.x, d.y)) is None
    assert as_tensor_data(TensorDataset(d.x, d.y, d.y)) is None


def test_tensordataset_labels_are_checked_once_in_full_before_training(tmp_path):
    import pytest

    import ironloop
    from ironloop.errors import DataError
    from tests.conftest import blobs, cfg, tiny_mlp

    d = blobs(n=100)
    y = d.y.clone()
    y[97] = 7  # 3 classes: one bad label in the last batch
    with pytest.raises(DataError, match=r"labels must be class indices in \[0, 3\)"):
        ironloop.fit(tiny_mlp(), TensorDataset(d.x, y), None, cfg(tmp_path))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


def test_a_shielded_worker_init_ignores_stop_signals_and_still_calls_the_users_with_its_id():
    seen: list[int] = []
    init = shielded(seen.append)
    assert shielded(init) is init  # a loader reused every epoch is not wrapped twice
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:  # runs here, not in a worker: this process's handlers are put back after
        init(3)
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in STOP_SIGNALS)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert seen == [3]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 64, 65, 359])
@pytest.mark.parametrize("batch_size", [1, 32, 179])
def test_eval_shards_cover_every_sample_once(n, batch_size, world):
    shards = [list(EvalSampler(n, batch_size, 0, shuffle=False, rank=r, world_size=world))
              for r in range(world)]
    seen = sorted(i for batches in shards for b in batches for i in b)
    assert seen == list(range(n))  # every sample, exactly once
    for r, batches in enumerate(shards):
        assert all(batches), "an empty batch"
        assert len(EvalSampler(n, batch_size, 0, False, rank=r, world_size=world)) \
            == len(batches)
        assert all(len(b) <= batch_size for b in batches)
    # For contrast: the training sampler drops such a tail, on purpose (DDP needs every rank).
    train_seen = sum(len(b) for r in range(world)
                     for b in EpochSampler(n, batch_size, 0, False, rank=r, world_size=world))
    assert n - train_seen < world


def test_to_device_moves_every_tensor_of_a_nested_batch_and_keeps_its_shape():
    from ironloop.data.loader import to_device

    x, y, mask = torch.ones(2, 3), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.bool)
    moved = to_device({"x": x, "pair": (y, [mask]), "name": "batch-1"}, torch.device("meta"),
                      False)
    assert set(moved) == {"x", "pair", "name"} and moved["name"] == "batch-1"
    assert moved["x"].device.type == "meta" and moved["x"].shape == (2, 3)
    (ty, (tmask,)) = moved["pair"]
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert (ty.device.type, ty.dtype, tmask.dtype) == ("meta", torch.long, torch.bool)


def test_a_tensordatas_batch_of_no_indices_is_empty_not_an_error():
    data = TensorData(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 2]))
    x, y = data.__getitems__([])
    assert x.shape == (0, 2) and y.shape == (0,)
    x, y = data.__getitems__([2, 0])
    assert x.tolist() == [[4.0, 5.0], [0.0, 1.0]] and y.tolist() == [2, 0]


def test_once_over_train_is_this_ranks_share_of_every_sample_in_order():
    from ironloop.data.source import RunData
    from ironloop.data.stream import Stream

    train = TensorData(torch.arange(7.0)[:, None], torch.arange(7))
    run = RunData(None, train, {}, None, None)  # no source: once_over_train needs none
    shares = [[b[1].tolist() for b in run.once_over_train(2, rank, 2)] for rank in (0, 1)]
    # global batches of 2 x 2 ranks, in order: [0 1 | 2 3], [4 5 | 6]
    assert shares == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert RunData(None, Stream(None), {}, None, None).once_over_train(2, 0, 1) is None


def test_the_records_name_one_unnamed_validation_set_val_and_named_ones_val_name():
    from ironloop.data.source import RunData

    train, val = TensorData(torch.zeros(5, 1), torch.zeros(5)), TensorData(torch.zeros(2, 1),
                                                                          torch.zeros(2))
    one = RunData(None, train, {"": val}, None, None).described()
    assert one == {"train": {"type": "TensorData", "size": 5},
                   "val": {"type": "TensorData", "size": 2}}
    assert set(RunData(None, train, {"noisy": val}, None, None).described()) == \
        {"train", "val_noisy"}


class Raising(torch.utils.data.Dataset):
    """Blobs whose sample ``bad`` raises when read: a corrupt record."""

    def __init__(self, bad: int = -1):
        self.data, self.bad = blobs(64), bad

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"sample {i}: corrupt record")
        return self.data[i]


class FailsInEvaluation(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_mlp()

    def forward(self, x):
        if not self.training:
            raise RuntimeError("the evaluation forward failed")
        return self.net(x)


@pytest.mark.parametrize("where", ["train", "stream", "evaluation"])
def test_a_failed_run_stops_its_loader_workers_while_its_error_is_still_held(tmp_path, where):
    """Workers ignore SIGTERM (data/workers.py), and Python's exit sends SIGTERM to its
    children, then waits for them: a worker still alive when a script ends on fit()'s error
    (its traceback holds the iterator) hung the script forever. fit() now stops them itself."""
    from tests.data.test_stream import Plain

    model, train, val, steps = tiny_mlp(), Raising(bad=40), None, 0
    if where == "stream":
        train, steps = Plain(n=64, raise_at=40), 4  # a stream's length is its max_steps
    elif where == "evaluation":
        model, train, val = FailsInEvaluation(), Raising(), Raising()
    with pytest.raises(Exception, match="corrupt record|evaluation forward failed") as error:
        ironloop.fit(model, train, val, cfg(tmp_path, train__epochs=1, train__batch_size=16,
                                             data__num_workers=2, train__max_steps=steps))
    assert error.value.__traceback__ is not None  # what a notebook or an uncaught error keeps
    assert multiprocessing.active_children() == []


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


def test_an_eval_sampler_serves_the_order_it_is_given():
    from ironloop.data.loader import EvalSampler
    from ironloop.data.order import KeyedOrder

    order = KeyedOrder(9, seed=4, shuffle=True)
    sampler = EvalSampler(9, 4, seed=0, shuffle=False, order=order)
    assert sampler.permutation().tolist() == order.indices(0, NONE, 0, 9).tolist()
    assert sampler.permutation().tolist() != list(range(9))


# ------------------------------------------------------------------ loaders ----------------
def test_a_loaders_worker_seeds_come_from_the_run_seed_and_its_epoch():
    """A DataLoader draws its workers' base seed from its generator: seeded from (seed, epoch)
    for one epoch's loader, from (seed, "every epoch") for the run's persistent one."""
    from ironloop.data.loader import EpochSampler, make_loader
    from ironloop.data.seeding import derive_seed

    sampler = EpochSampler(10, 2, seed=3, shuffle=True)
    sampler.set_epoch(2)
    once = make_loader(Draws(), sampler, num_workers=0, pin_memory=False)
    assert once.generator.initial_seed() == derive_seed(3, 2, "loader")
    run = make_loader(Draws(), sampler, num_workers=0, pin_memory=False, persistent=True)
    assert run.generator.initial_seed() == derive_seed(3, "every epoch", "loader")


def test_the_epoch_loader_keeps_one_loader_for_the_run_unless_samples_are_unseeded():
    from ironloop.data.loader import EpochLoader, EpochSampler
    from ironloop.data.seeding import derive_seed

    sampler = EpochSampler(10, 5, seed=3, shuffle=False)
    loader = EpochLoader(Draws(), sampler, num_workers=0, pin_memory=False)
    assert len(list(loader)) == 2
    kept = loader._loader
    assert kept.generator.initial_seed() == derive_seed(3, "every epoch", "loader")
    sampler.set_epoch(1)
    assert len(list(loader)) == 2 and loader._loader is kept  # the same loader, next epoch
    loader.close()
    assert loader._loader is None
    sampler.set_epoch(4)
    unseeded = EpochLoader(Draws(), sampler, num_workers=0, pin_memory=False,
                           seed_samples=False)
    list(unseeded)
    assert unseeded._loader.generator.initial_seed() == derive_seed(3, 4, "loader")


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
    first = next(iter(make_loader(Draws(), sampler, num_workers=0, pin_memory=False)))
    seed_sample(5, 2, 1)
    assert torch.equal(first[1], torch.rand(3))


def test_a_loaders_workers_are_shielded_and_seeded_and_persist_only_when_asked():
    from ironloop.data import workers
    from ironloop.data.loader import EpochSampler, _seed_worker, make_loader

    sampler = EpochSampler(10, 2, seed=3, shuffle=False)
    alone = make_loader(Draws(), sampler, num_workers=0, pin_memory=False, persistent=True)
    assert alone.worker_init_fn is None and not alone.persistent_workers
    pool = make_loader(Draws(), sampler, num_workers=2, pin_memory=False, persistent=True)
    assert pool.worker_init_fn.func is workers._init
    assert pool.worker_init_fn.args == (_seed_worker,)
    assert pool.num_workers == 2 and pool.persistent_workers
    assert not make_loader(Draws(), sampler, num_workers=2, pin_memory=False).persistent_workers
