"""data/lm.py: ContiguousStreams serves word_language_model's batchify + get_batch chunks, in
the dataset's own order with data.shuffle=false, and says when the config cannot serve them."""

from __future__ import annotations

import pytest
import torch

import ironloop
from ironloop.data.lm import ContiguousStreams, PackedSequences, batchify, check_order
from ironloop.data.loader import EpochSampler, make_loader
from ironloop.errors import ConfigError


def get_batch(source: torch.Tensor, i: int, bptt: int):
    """word_language_model's get_batch, on its (n, streams) layout."""
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len]


def test_streams_are_word_language_models_chunks_in_order():
    tokens, streams, bptt = torch.arange(103), 4, 7
    data = ContiguousStreams(tokens, streams, bptt)
    source = tokens[:len(tokens) // streams * streams].view(streams, -1).t()  # its batchify
    sampler = EpochSampler(len(data), streams, seed=0, shuffle=False)
    batches = list(make_loader(data, sampler, num_workers=0, pin_memory=False))
    expected = [get_batch(source, i, bptt) for i in range(0, len(source) - 1, bptt)]
    assert len(batches) == len(expected) == data.chunks
    for (x, y), (ex, ey) in zip(batches, expected):
        assert torch.equal(x, ex.t()) and torch.equal(y, ey.t())  # batch-first
    assert batches[-1][0].shape == (streams, (25 - 1) % bptt)  # the short last chunk


def test_shuffle_false_serves_the_dataset_order_and_resumes_at_its_offset():
    sampler = EpochSampler(10, 3, seed=5, shuffle=False)
    sampler.set_epoch(2, 6)
    assert list(sampler) == [[6, 7, 8], [9]]


def test_the_config_must_serve_streams_in_order_one_chunk_of_each_per_step(tmp_path):
    data = ContiguousStreams(torch.arange(100), 4, 5)
    with pytest.raises(ConfigError, match="data.shuffle=false"):
        check_order(data, True, 4)
    with pytest.raises(ConfigError, match="4 streams"):
        check_order(data, False, 8)
    check_order(data, False, 4)
    with pytest.raises(ConfigError, match="data.shuffle=false"):
        ironloop.fit(torch.nn.Linear(5, 5), data, None, {"run.dir": str(tmp_path),
                     "train.batch_size": 4, "log.progress": "off"})


def test_batchify_and_packed_sequences():
    assert batchify(torch.arange(10), 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match=r"tokens must be a 1-D sequence, got shape \(2, 5\)"):
        batchify(torch.arange(10).view(2, 5), 3)  # already batched: named with its shape
    packed = PackedSequences(torch.arange(11), 4)  # blocks of 5; the last token is dropped
    assert len(packed) == 2
    x, y = packed[1]
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
