"""Streams in fit(): an IterableDataset, however passed, trains and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

import ironloop
from ironloop.errors import CheckpointError, ConfigError, DataError, UserError
from ironloop.guard.reporter import GuardStop
from tests.conftest import blobs, cfg, tiny_mlp

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader

# Worker processes make a test slow (pytest -m "not slow" leaves them out; CI runs them).
DATA = blobs(104, seed=3)  # 104 = 6 batches of 16 and a partial one per epoch


class Plain(IterableDataset):
    """A user's reader without state: (seed, epoch) fix the order; each worker its share."""

    def __init__(self, n: int = 104, raise_at: int = -1):
        self.n, self.epoch, self.pos, self.raise_at = n, 0, 0, raise_at
        self.epochs_seen: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_seen.append(epoch)

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        info = get_worker_info()
        mine = order if info is None else order[info.id::info.num_workers]
        while self.pos < len(mine):
            i = int(mine[self.pos])
            self.pos += 1
            if i == self.raise_at:
                raise ValueError(f"sample {i}: corrupt record")
            yield DATA.x[i], DATA.y[i]
        self.pos = 0


class Reader(Plain):
    """The same reader with torchdata's Stateful protocol: its position is its state."""

    def state_dict(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


class Sized(Reader):
    def __init__(self, n: int = 104, claims: int = 104):
        super().__init__(n)
        self.claims = claims

    def __len__(self) -> int:
        return self.claims


def weights(result) -> dict:
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def fit(tmp_path, data, run: str = "run", **keys):
    conf = cfg(tmp_path, train__epochs=3, train__batch_size=16, run__dir=str(tmp_path / run),
               **keys)
    # Extending max_steps changes a trajectory key: allowed, the schedule is constant.
    return ironloop.fit(tiny_mlp(), data, config=conf, resume=True, allow_config_change=True)


def stop_and_go(tmp_path, make, stops, **keys):
    """Train in pieces, each a new process's worth of objects, stopped by max_steps."""
    for stop in stops:
        result = fit(tmp_path, make(), run="pieces", train__max_steps=stop, **keys)
    return result


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_stateful_stream_resumes_exactly_across_an_epoch_boundary(tmp_path, workers):
    """Stops mid-epoch 1, then mid-epoch 2 (over the boundary; torchdata #1437 dropped an epoch
    there), then runs to the end: the same weights as one uninterrupted run."""
    n = len(Sized()) // 16  # steps per epoch
    whole = fit(tmp_path, Sized(), data__num_workers=workers, train__max_steps=3 * n)
    pieces = stop_and_go(tmp_path, Sized, [5, n + 4, 2 * n, 3 * n], data__num_workers=workers)
    assert whole.results["steps"] == pieces.results["steps"] == 3 * n
    for k, v in weights(whole).items():
        assert torch.equal(v, pieces.model.state_dict()[k]), k


@pytest.mark.parametrize("make", [Sized, Plain], ids=["state", "replay"])
def test_a_stream_stopped_at_an_epochs_last_step_resumes_the_next_epoch_from_its_start(
        tmp_path, make):
    """Windows of 4 batches: 6 batches an epoch make 2 steps, the second ragged, so the loop
    knows the epoch's end at its last step. Stopped there, the checkpoint holds the finished
    loader with the next epoch's position; the resume starts that epoch from (seed, epoch), as
    the uninterrupted run does (it replayed the ended epoch's state, or found no batch)."""
    whole = fit(tmp_path, make(), train__max_steps=4, train__accumulation_steps=4)
    pieces = stop_and_go(tmp_path, make, [2, 4], train__accumulation_steps=4)
    assert whole.results["steps"] == pieces.results["steps"] == 4
    for k, v in weights(whole).items():
        assert torch.equal(v, pieces.model.state_dict()[k]), k


def test_stream_without_state_resumes_by_replay_and_says_so_once(tmp_path, capsys):
    whole = fit(tmp_path, Plain(), train__max_steps=18)
    capsys.readouterr()
    pieces = stop_and_go(tmp_path, Plain, [4, 9, 18])
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("reads again, and discards") == 3  # one per process (three fit calls)
    assert "state_dict() and load_state_dict()" in text
    assert "naively fast-forwarding" not in text  # torchdata's own warning, said once by ours
    for k, v in weights(whole).items():
        assert torch.equal(v, pieces.model.state_dict()[k]), k


def test_stream_without_len_trains_by_max_steps_and_sets_each_epoch(tmp_path):
    data = Plain()  # 6 full batches per epoch
    result = fit(tmp_path, data, train__max_steps=15)
    assert result.results["steps"] == 15
    assert data.epochs_seen == [0, 1, 2]


def test_a_stream_without_len_prints_no_epoch_count_or_length_it_does_not_know(tmp_path,
                                                                                capsys):
    """6 full batches an epoch, which the run learns only when the stream ends: max_steps=15
    ends it in epoch 3. No 'epoch 2/1', and no max_steps posing as the epoch's length."""
    stop_and_go(tmp_path, Plain, [4, 15])
    out = capsys.readouterr().out
    ends = [line.split("  ")[:2] for line in out.splitlines() if line.startswith("epoch ")]
    assert ends == [["epoch 1", "step 6"], ["epoch 2", "step 12"]], out
    (resumed,) = [line for line in out.splitlines() if line.startswith("resumed from")]
    assert "at step 4/15 (epoch 1, 4 steps into it)" in resumed, resumed


def test_stream_without_len_or_max_steps_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.max_steps"):
        fit(tmp_path, Plain())


def test_a_passed_stateful_dataloader_keeps_its_sampler_and_state(tmp_path):
    """A map-style StatefulDataLoader with its own shuffling: used as it is, and resumed from its
    own state, across an epoch boundary."""
    def make():
        return StatefulDataLoader(TensorDataset(DATA.x, DATA.y), batch_size=16, shuffle=True,
                                  drop_last=True, generator=torch.Generator().manual_seed(7))
    n = len(make())
    whole = fit(tmp_path, make(), train__max_steps=3 * n)
    pieces = stop_and_go(tmp_path, make, [4, n + 3, 3 * n])
    for k, v in weights(whole).items():
        assert torch.equal(v, pieces.model.state_dict()[k]), k
    # max_steps stopped the last piece mid-epoch: its checkpoint holds the loader's own state.
    ckpt = torch.load(tmp_path / "pieces" / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["sampler"]["loader"]["_num_yielded"] == n


def test_a_sized_streams_epoch_is_its_full_batches_in_optimizer_steps():
    from ironloop.data.stream import Stream, stream_steps

    # 104 samples = 6 batches of 16 and a partial one, which drop_last leaves out
    assert stream_steps(Stream(Sized()), 16, 1, max_steps=0) == 6
    assert stream_steps(Stream(Sized()), 16, 3, max_steps=0) == 2  # windows of 3 batches
    steps = stream_steps(Stream(Sized()), 16, 4, max_steps=0)  # a short last window counts
    assert steps == 2 and isinstance(steps, int)


def test_the_first_sample_of_a_stream_is_an_inputs_targets_pair_or_none():
    from ironloop.data.stream import Stream, first_sample

    class Rows(IterableDataset):
        def __iter__(self):
            yield {"x": DATA.x[0], "y": DATA.y[0]}

    x, y = first_sample(Stream(Reader()))
    assert x.shape == DATA.x[0].shape and y.ndim == 0
    # Named fields are no (inputs, targets) pair: nothing to infer classes or a shape from.
    assert first_sample(Stream(Rows())) is None


@pytest.mark.parametrize("how", ["dataset", "dataloader", "stateful", "with_len"])
def test_every_way_of_passing_a_stream_trains(tmp_path, how):
    data = {"dataset": Plain(), "dataloader": DataLoader(Reader(), batch_size=16),
            "stateful": StatefulDataLoader(Reader(), batch_size=16, drop_last=True),
            "with_len": Sized()}[how]
    result = fit(tmp_path, data, train__max_steps=8)
    assert result.results["steps"] == 8


def test_a_len_that_claims_too_much_is_an_error_naming_it(tmp_path):
    with pytest.raises(DataError, match="ended early.*__len__ says 300"):
        fit(tmp_path, Sized(claims=300))


def test_a_len_that_claims_too_little_is_an_error_naming_it(tmp_path):
    with pytest.raises(DataError, match="more than its __len__ of 60"):
        fit(tmp_path, Sized(claims=60))


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_sample_that_raises_names_itself_and_keeps_the_checkpoints(tmp_path, workers):
    fit(tmp_path, Plain(), data__num_workers=workers, train__max_steps=2)
    ckpts = tmp_path / "run" / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    bad = int(torch.randperm(104, generator=torch.Generator().manual_seed(0))[80])
    with pytest.raises(DataError, match=f"reading batch .*: ValueError: sample {bad}: "
                                        f"corrupt record\\. Fix"):
        fit(tmp_path, Plain(raise_at=bad), data__num_workers=workers, train__max_steps=10)
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before


class Poisoned(Reader):
    """Sample ``bad``'s input is NaN every time it is read (a corrupt record)."""

    bad = int(torch.randperm(104, generator=torch.Generator().manual_seed(0))[70])

    def __iter__(self):
        for x, y in super().__iter__():
            yield (x * float("nan") if bool((x == DATA.x[self.bad]).all()) else x), y


def test_a_transient_bad_step_on_a_stream_is_skipped_and_the_run_reads_on(tmp_path):
    result = fit(tmp_path, Reader(), train__max_steps=12, fault__nan_at_step=[5])
    assert result.results["bad_steps"] == 1 and result.results["steps"] == 12


def test_a_guard_rollback_on_a_stream_restores_the_loader_and_reads_the_same_samples(
        tmp_path, capsys):
    """A sample that is bad in itself: each rollback restores the loader state from the newest
    checkpoint, so the stream serves that sample again (a stream has no skip list), until
    guard.max_rollbacks stops the run with every checkpoint intact."""
    with pytest.raises(GuardStop, match="after 2 rollback") as stop:
        fit(tmp_path, Poisoned(), train__max_steps=12, checkpoint__every_steps=2,
            guard__max_bad_steps=1, guard__max_rollbacks=2)
    # the stop names what it found, the same step failing on every replay, before the LR
    assert "Step 5 failed again after every rollback: a bad sample there" in str(stop.value)
    text = capsys.readouterr().out
    assert text.count("rolled back from step 5 to step 4") == 2
    assert "0 samples added to the skip list" in text
    torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)


def test_fault_nan_sample_on_a_stream_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="fault.nan_at_step instead"):
        fit(tmp_path, Reader(), train__max_steps=4, fault__nan_sample=3)


def test_a_stream_as_validation_data_is_refused_naming_it(tmp_path):
    with pytest.raises(UserError, match="val_data is a stream.*streaming=False"):
        ironloop.fit(tiny_mlp(), Reader(), Plain(), cfg(tmp_path, train__max_steps=2))


def dict_step(model, batch):
    """A step for Hugging Face rows: a dict batch of tensors."""
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]), {}


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_hugging_face_iterable_dataset_resumes_from_its_own_state(tmp_path, workers,
                                                                    capsys):
    """Passed to fit() as it is; HF's own state_dict (no shuffle buffer: exact) is the position,
    restored in each worker, across an epoch boundary."""
    datasets = pytest.importorskip("datasets")

    def make():
        rows = datasets.Dataset.from_dict({"x": DATA.x.tolist(), "y": DATA.y.tolist()})
        return rows.to_iterable_dataset(num_shards=4).with_format("torch")
    whole = ironloop.fit(tiny_mlp(), make(), step_fn=dict_step, config=cfg(
        tmp_path, train__epochs=3, train__batch_size=16, train__max_steps=18,
        data__num_workers=workers))
    for stop in (4, 9, 18):
        pieces = ironloop.fit(tiny_mlp(), make(), step_fn=dict_step, resume=True,
                              allow_config_change=True, config=cfg(
                                  tmp_path, run__dir=str(tmp_path / "pieces"), train__epochs=3,
                                  train__batch_size=16, train__max_steps=stop,
                                  data__num_workers=workers))
    assert "reads again" not in capsys.readouterr().out  # its state, not a replay
    for k, v in weights(whole).items():
        assert torch.equal(v, pieces.model.state_dict()[k]), k


def test_a_mid_epoch_resume_with_other_workers_is_refused_naming_the_value(tmp_path):
    fit(tmp_path, Reader(), train__max_steps=3)
    with pytest.raises(CheckpointError, match="resume with data.num_workers=0"):
        fit(tmp_path, Reader(), train__max_steps=6, data__num_workers=2)


def test_a_mid_epoch_resume_on_another_number_of_ranks_is_refused_naming_the_boundary():
    from ironloop.data.stream import Stream, StreamOrder

    two = StreamOrder(Stream(Reader()), 4, 0, world_size=2)
    two.set_epoch(1, offset=8)  # mid-epoch 2, as a checkpoint of 2 ranks holds it
    state = two.state_dict()
    with pytest.raises(CheckpointError, match=r"mid-epoch 2 in a stream read by 2 rank\(s\), "
                                              r"and this run has 1; .* resume with 2 rank\(s\) "
                                              r"\(the number of ranks may change at an epoch "
                                              r"boundary"):
        StreamOrder(Stream(Reader()), 4, 0, world_size=1).load_state_dict(state)
    again = StreamOrder(Stream(Reader()), 4, 0, world_size=2)  # the same ranks: accepted
    again.load_state_dict(state)
    assert (again.epoch, again.offset) == (1, 8)
    two.set_epoch(2)  # at the boundary: any number of ranks
    StreamOrder(Stream(Reader()), 4, 0, world_size=1).load_state_dict(two.state_dict())


def test_a_hugging_face_shuffle_buffer_is_resumed_by_replay():
    """HF's state_dict leaves the shuffle buffer out, so resuming from it is not exact; the
    detection reads HF's private iterable chain, and this test notices if that changes."""
    datasets = pytest.importorskip("datasets")
    from ironloop.data.stream import Stream, resumes_by_replay

    rows = datasets.Dataset.from_dict({"x": list(range(32))}).to_iterable_dataset(num_shards=2)
    assert not resumes_by_replay(Stream(rows), "auto")
    assert resumes_by_replay(Stream(rows.shuffle(seed=0, buffer_size=8)), "auto")
    assert resumes_by_replay(Stream(rows), "replay")



def test_a_passed_loader_resumes_from_its_own_state_never_by_replay():
    from ironloop.data.stream import Stream, resumes_by_replay

    loader = StatefulDataLoader(Plain(), batch_size=16)  # a stateless reader inside it
    assert resumes_by_replay(Stream(Plain()), "auto")  # ironloop's own loader would replay it
    assert not resumes_by_replay(Stream(Plain(), loader=loader), "auto")
    assert not resumes_by_replay(Stream(Plain(), loader=loader), "replay")


def test_a_passed_loaders_own_worker_init_fn_still_runs_in_its_workers():
    import signal

    from ironloop.data.stream import Stream, StreamOrder
    from ironloop.data.workers import STOP_SIGNALS

    seen: list[int] = []
    loader = StatefulDataLoader(Plain(), batch_size=16, num_workers=2,
                                worker_init_fn=seen.append)
    opened = StreamOrder(Stream(loader.dataset, loader=loader), 16, seed=0).open()
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        opened.worker_init_fn(1)  # what worker 1 runs first, here in this process
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert seen == [1]

def test_stream_resume_state_needs_a_state_dict(tmp_path):
    with pytest.raises(ConfigError, match="data.stream_resume=state: Plain has no state_dict"):
        fit(tmp_path, Plain(), train__max_steps=2, data__stream_resume="state")


def test_without_torchdata_a_stream_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)  # "not installed"
    with pytest.raises(UserError, match=r"pip install 'ironloop\[stream\]'"):
        fit(tmp_path, Plain(), train__max_steps=2)


def test_the_first_sample_passes_a_batchs_non_tensor_parts_through():
    from ironloop.data.stream import Stream, first_sample

    def collate(rows):  # a user's collate_fn with metadata beside the tensors
        return (torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                {"shard": "a"})

    x, y, meta = first_sample(Stream(Reader(), collate_fn=collate))
    assert x.shape == DATA.x[0].shape and y.ndim == 0 and meta == {"shard": "a"}


def test_the_replay_warning_says_why_the_stream_is_replayed():
    from ironloop.data.stream import Stream, replay_warning

    text = replay_warning(Stream(Plain()))
    assert text.startswith("warning: Plain is a stream and it has no state_dict()/"
                           "load_state_dict(): a mid-epoch resume reads again")


def test_a_map_style_checkpoint_is_refused_by_a_stream_run():
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Reader()), 16, 0)
    with pytest.raises(CheckpointError, match="^the checkpoint was taken on a map-style "
                                              "dataset, this run reads a stream"):
        order.load_state_dict({"seed": 0, "epoch": 0, "offset": 32, "n": 104, "order": {}})


def test_a_streams_position_round_trips_through_its_state_dict():
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Reader()), 16, 7)  # read in this process by default
    order.set_epoch(2, 32)
    state = order.state_dict()
    assert state == {"seed": 7, "epoch": 2, "offset": 32, "num_workers": 0, "world_size": 1,
                     "loader": None,
                     "stream": True}
    again = StreamOrder(Stream(Reader()), 16, 0)
    again.load_state_dict({**state, "loader": {"a": 1}})
    assert (again.seed, again.epoch, again.offset, again.pending) == (7, 2, 32, {"a": 1})


def test_a_stream_shorter_than_one_batch_is_an_error_naming_the_epoch():
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Plain(n=10)), 16, 0)
    order.set_epoch(1)
    with pytest.raises(DataError, match=r"yielded no full batch of 16 samples in epoch 2; "):
        list(order.batches())


def test_under_ddp_a_ranks_surplus_batches_are_dropped_with_a_warning_naming_rank_and_epoch(
        capsys):
    from ironloop.data.stream import Stream, StreamOrder

    order = StreamOrder(Stream(Plain(n=64)), 4, 0, accumulation=2, rank=1, world_size=2)
    order._agree = lambda k: min(k, 1)  # the all-reduce: another rank has one batch left
    order.set_epoch(2)
    assert len(list(order.batches())) == 1
    assert order.end == 8  # one global batch of 4 * 2 samples
    assert capsys.readouterr().err == (
        "warning: rank 1's share of the stream held 1 batch(es) more than another rank's in "
        "epoch 3; dropped (give every rank an equal share)\n")


def test_a_worker_error_is_described_by_its_own_last_line_any_other_by_type_and_first_line():
    from ironloop.data.stream import _describe

    wrapped = RuntimeError("Caught ValueError in DataLoader worker process 1.\n"
                           "Original Traceback (most recent call last):\n"
                           '  File "reader.py", line 3, in __iter__\n'
                           "    raise ValueError('bad shard 7')\n"
                           "ValueError: bad shard 7\n\n")
    assert _describe(wrapped) == "ValueError: bad shard 7"
    assert _describe(OSError("disk gone\nmore")) == "OSError: disk gone"
    assert _describe(KeyError()) == "KeyError: (no message)"
