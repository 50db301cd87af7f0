"""data/prefetch.py: the next batch is loaded (and on CUDA copied) while the current one trains;
the batches, their order and the training results are those of the plain loop."""

from __future__ import annotations

import pytest
import torch

import ironloop
from ironloop.data.loader import to_device
from ironloop.data.prefetch import prefetch
from ironloop.engine import loop
from ironloop.state.io import load_verified
from tests.conftest import blobs, cfg, tiny_mlp


def test_batches_come_out_unchanged_in_order_one_loaded_ahead():
    made, checked = [], []
    batches = [(torch.randn(4, 3), torch.arange(4) + i) for i in range(5)]

    def source():
        for i, b in enumerate(batches):
            made.append(i)
            yield b

    seen = []
    for i, b in enumerate(prefetch(source(), torch.device("cpu"), checked.append)):
        assert b[0] is batches[i][0] and b[1] is batches[i][1]  # the same tensors, no copy
        assert made == list(range(min(i + 2, 5)))  # batch i+1 was loaded before i is handed out
        seen.append(i)
    assert seen == list(range(5)) and [c[1][0].item() for c in checked] == list(range(5))


def test_empty_loader_and_nested_batches():
    assert list(prefetch(iter([]), torch.device("cpu"))) == []
    nested = [{"x": torch.ones(2), "meta": [torch.zeros(1), "name"]}]
    out = list(prefetch(nested, torch.device("cpu")))
    assert out[0]["x"] is nested[0]["x"] and out[0]["meta"][1] == "name"


def test_training_with_the_look_ahead_equals_training_without(tmp_path, monkeypatch):
    def run(name):
        ironloop.fit(tiny_mlp(dropout=0.1), blobs(n=200), None,
                     cfg(tmp_path / name, train__epochs=2, train__accumulation_steps=2,
                         train__batch_size=16), overwrite=True)
        return load_verified(tmp_path / name / "run" / "checkpoints" / "last.pt")

    ahead = run("ahead")

    def plain(batches, device, check=None, ahead=True):  # the loop as it was: check, copy, train
        for b in batches:
            if check is not None:
                check(b)
            yield to_device(b, device, False)

    monkeypatch.setattr(loop, "prefetch", plain)
    without = run("plain")
    assert all(torch.equal(ahead["model"][k], without["model"][k]) for k in ahead["model"])
    assert ahead["progress"] == without["progress"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a side stream")
def test_cuda_batches_arrive_on_the_device_equal_to_the_host_ones():
    host = [(torch.randn(64, 8).pin_memory(), torch.arange(64).pin_memory()) for _ in range(4)]
    dev = torch.device("cuda")
    for h, d in zip(host, prefetch(host, dev)):
        assert d[0].device.type == "cuda" and torch.equal(d[0].cpu(), h[0])
        assert torch.equal(d[1].cpu(), h[1])


def test_without_look_ahead_a_batch_is_read_only_when_it_is_trained():
    """A stream's loader keeps its position in its own state: nothing may be read early."""
    reads = []

    def source():
        for i in range(3):
            reads.append(i)
            yield (torch.full((2, 1), float(i)), torch.zeros(2, dtype=torch.long))

    it = prefetch(source(), torch.device("cpu"), ahead=False)
    next(it)
    assert reads == [0]  # with the look-ahead, batch 1 would have been read too
    it = prefetch(source(), torch.device("cpu"))
    reads.clear()
    next(it)
    assert reads == [0, 1]


def test_every_tensor_of_a_nested_batch_is_kept_alive_for_the_compute_stream():
    # The side stream's tensors must be recorded on the stream that reads them, in dicts and
    # lists alike, or the allocator may reuse their memory mid-step (CUDA streams: stood in
    # for here by a tensor type that records what it was given).
    from ironloop.data.prefetch import _keep_alive

    seen: list = []

    class Recorded(torch.Tensor):
        def record_stream(self, stream):
            seen.append(stream)

    def t():
        return torch.zeros(2).as_subclass(Recorded)

    compute = object()
    _keep_alive({"x": t(), "pair": (t(), [t()]), "meta": "text"}, compute)
    assert seen == [compute] * 3


class _Streams:
    """torch.cuda's streams, stood in for on a machine without CUDA: which stream is current,
    what the compute stream waited for, in order."""

    def __init__(self, monkeypatch):
        self.compute, self.current, self.events = "compute", "compute", []
        self.made: list = []
        streams = self

        class Stream:
            def __init__(self, device):
                streams.made.append(device)
                self.name = "side"

        class Compute:
            def wait_stream(self, stream):
                streams.events.append(("wait", stream.name))

        class Using:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                streams.current = self.stream.name

            def __exit__(self, *exc):
                streams.current = "compute"

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", Using)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Compute())


def _recorded_copies(monkeypatch, streams):
    """to_device as prefetch calls it: (batch, device, non_blocking), all three required."""
    import ironloop.data.prefetch as prefetch_module

    def copy(batch, device, non_blocking):
        streams.events.append(("copy", batch, device.type, non_blocking, streams.current))
        return ("on", device.type, batch)  # no tensors: nothing for _keep_alive to record

    monkeypatch.setattr(prefetch_module, "to_device", copy)


def test_on_cuda_each_batch_is_copied_non_blocking_on_the_side_stream_and_waited_for(
        monkeypatch):
    streams = _Streams(monkeypatch)
    _recorded_copies(monkeypatch, streams)
    cuda = torch.device("cuda")
    out = []
    for batch in prefetch(iter([0, 1, 2]), cuda):
        out.append(batch)
        streams.events.append(("train", batch[2]))
    assert out == [("on", "cuda", i) for i in range(3)] and streams.made == [cuda]
    assert streams.events == [
        ("copy", 0, "cuda", True, "side"),
        ("wait", "side"), ("copy", 1, "cuda", True, "side"), ("train", 0),
        ("wait", "side"), ("copy", 2, "cuda", True, "side"), ("train", 1),
        ("wait", "side"), ("train", 2)]


def test_without_a_side_stream_a_device_batch_is_a_plain_blocking_copy(monkeypatch):
    # A stream's loader on CUDA (no look-ahead) and any other accelerator (no side stream):
    # the copy is synchronous, on the current stream; no side stream is made.
    streams = _Streams(monkeypatch)
    _recorded_copies(monkeypatch, streams)
    assert list(prefetch(iter([0, 1]), torch.device("cuda"), ahead=False)) == \
        [("on", "cuda", 0), ("on", "cuda", 1)]
    assert list(prefetch(iter([2]), torch.device("meta"))) == [("on", "meta", 2)]
    assert streams.made == [] and streams.events == [
        ("copy", 0, "cuda", False, "compute"), ("copy", 1, "cuda", False, "compute"),
        ("copy", 2, "meta", False, "compute")]


def test_a_batch_for_a_device_without_a_side_stream_arrives_on_that_device():
    host = (torch.randn(4, 3), torch.arange(4))
    (moved,) = prefetch([host], torch.device("meta"))  # meta: a non-CPU device on any machine
    assert [t.device.type for t in moved] == ["meta", "meta"]
    assert [t.shape for t in moved] == [h.shape for h in host]
