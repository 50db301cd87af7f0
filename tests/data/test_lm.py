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
    with pytest.raises(ConfigError, match=r"^data\.shuffle=true would serve ContiguousStreams' "
                                          r"chunks in random order; set data\.shuffle=false$"):
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


class TimeFirstRNN(torch.nn.Module):
    """word_language_model's RNNModel contract: forward(input (T, B), hidden) -> (log-probs
    (T*B, V), hidden), init_hidden(bsz), an nn.LSTM without batch_first."""

    def __init__(self, ntoken: int = 11, nhid: int = 12):
        super().__init__()
        self.ntoken, self.nhid = ntoken, nhid
        self.encoder = torch.nn.Embedding(ntoken, 8)
        self.rnn = torch.nn.LSTM(8, nhid, 1)
        self.decoder = torch.nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return torch.log_softmax(self.decoder(output).view(-1, self.ntoken), dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return w.new_zeros(1, bsz, self.nhid), w.new_zeros(1, bsz, self.nhid)


def test_word_language_models_time_first_loop_equals_the_examples_step_on_batch_first_streams(
        tmp_path):
    """ContiguousStreams is batch-first; word_language_model's batchify + get_batch are
    time-first. examples/word_language_model.py's step transposes, and equals main.py's loop
    (its batchify, get_batch, repackage_hidden, clip 0.25, p -= lr * grad) weight for weight."""
    from examples.word_language_model import step

    ids = torch.arange(300) * 7 % 11
    streams, bptt, lr = 4, 9, 0.5
    torch.manual_seed(0)
    ours, plain = TimeFirstRNN(), TimeFirstRNN()
    plain.load_state_dict(ours.state_dict())
    ironloop.fit(ours, ContiguousStreams(ids, streams, bptt), None, {
        "run.dir": str(tmp_path / "run"), "train.epochs": 1, "train.batch_size": streams,
        "train.step_fn": "examples.word_language_model:step", "data.shuffle": False,
        "optim.name": "sgd", "optim.lr": lr, "optim.momentum": 0.0, "optim.weight_decay": 0.0,
        "clip.max_norm": 0.25, "log.progress": "off", "checkpoint.keep_last": 0}, step_fn=step)
    data = ids[:len(ids) // streams * streams].view(streams, -1).t().contiguous()  # batchify
    hidden = plain.init_hidden(streams)
    for i in range(0, data.size(0) - 1, bptt):
        seq_len = min(bptt, len(data) - 1 - i)  # get_batch
        x, y = data[i:i + seq_len], data[i + 1:i + 1 + seq_len].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
        plain.zero_grad()
        output, hidden = plain(x, hidden)
        torch.nn.functional.nll_loss(output, y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.25)
        with torch.no_grad():
            for p in plain.parameters():
                p.add_(p.grad, alpha=-lr)
    for (name, a), b in zip(ours.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


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
