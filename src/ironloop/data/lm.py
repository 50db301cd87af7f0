"""Language-model data: contiguous streams for truncated BPTT, and packed sequences.

``ContiguousStreams`` is pytorch/examples' word_language_model (``batchify`` + ``get_batch``)
as a map-style dataset that the resumable sampler serves: the token sequence is cut into
``streams`` equal columns, and served in the dataset's own order (``data.shuffle=false``) with
``train.batch_size = streams`` (per step, over all ranks), batch ``i`` is chunk ``i`` of every
stream. A model that carries its hidden state from one batch to the next (a stateful step,
``ironloop.engine.carry``) then reads each stream contiguously::

    stream 0: tokens[0 : n]      chunk 0 | chunk 1 | ... | last chunk (shorter)
    stream 1: tokens[n : 2n]     chunk 0 | chunk 1 | ...
    ...

Batches are batch-first, ``(streams, bptt)``; ``get_batch``'s are time-first, ``(bptt,
streams)``, so a time-first model (word_language_model's ``RNNModel``) gets ``x.t()``
(examples/word_language_model.py). Sample ``k`` is chunk ``k // streams`` of stream
``k % streams``: ``bptt`` input tokens and the
same tokens shifted by one, the last chunk shorter (``min(bptt, n - 1 - start)``), exactly as
``get_batch``. A step that returns its token count as the loss weight makes that short chunk
count for what it holds (``ironloop.engine.step_fns.lm_step`` does).

``PackedSequences`` cuts one long token sequence into non-overlapping blocks of ``seq_len + 1``
(inputs and next-token targets): documents packed end to end, as GPT pre-training does.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ironloop.errors import ConfigError


def batchify(tokens: torch.Tensor, streams: int) -> torch.Tensor:
    """(streams, n): ``tokens`` cut into ``streams`` contiguous rows; the tail that does not
    fill a whole row is dropped (word_language_model's ``batchify``, batch-first)."""
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence, got shape {tuple(tokens.shape)}")
    n = len(tokens) // streams
    if n < 2:
        raise ValueError(f"{len(tokens)} tokens cannot make {streams} streams of at least 2")
    return tokens[:n * streams].view(streams, n)


class ContiguousStreams(Dataset):
    """``streams`` parallel token streams served chunk by chunk (see the module docstring).

    Needs ``data.shuffle=false`` and ``train.batch_size x ranks = streams``; ``fit`` checks
    both (``check_order``) and says so when they do not hold.
    """

    def __init__(self, tokens: torch.Tensor, streams: int, bptt: int):
        if streams < 1 or bptt < 1:
            raise ValueError(f"streams ({streams}) and bptt ({bptt}) must be >= 1")
        self.data = batchify(torch.as_tensor(tokens), streams)
        self.streams, self.bptt = streams, bptt
        self.chunks = -(-(self.data.shape[1] - 1) // bptt)  # get_batch's range(0, n - 1, bptt)

    def __len__(self) -> int:
        return self.streams * self.chunks

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= k < len(self):
            raise IndexError(f"sample {k} of {len(self)}")
        chunk, stream = divmod(k, self.streams)
        start = chunk * self.bptt
        length = min(self.bptt, self.data.shape[1] - 1 - start)
        row = self.data[stream]
        return row[start:start + length], row[start + 1:start + 1 + length]


def check_order(dataset, shuffle: bool, global_batch: int) -> None:
    """ContiguousStreams are only streams when served in order, one chunk per step."""
    if not isinstance(dataset, ContiguousStreams):
        return
    if shuffle:
        raise ConfigError("data.shuffle=true would serve ContiguousStreams' chunks in random "
                          "order; set data.shuffle=false")
    if global_batch != dataset.streams:
        raise ConfigError(f"train.batch_size x ranks = {global_batch}, but the data has "
                          f"{dataset.streams} streams; set train.batch_size so that one step "
                          f"takes one chunk of every stream")


def check_eval_order(dataset, what: str, batch_size: int, world_size: int, in_order: bool,
                     from_loader: bool) -> None:
    """Evaluation reads ContiguousStreams as training does: in order, one chunk of every stream
    per batch. Refused before training otherwise: a batch that mixes chunks crashes on the
    short last chunk, or mixes streams and reports a wrong loss."""
    if not isinstance(dataset, ContiguousStreams):
        return
    how = "its DataLoader's" if from_loader else "train.batch_size, its"
    if not in_order:
        raise ConfigError(f"{what}: its DataLoader's sampler would read ContiguousStreams' "
                          f"chunks out of order; pass it with shuffle=False and no sampler")
    if batch_size * world_size != dataset.streams:
        ranks = f" x {world_size} processes" if world_size > 1 else ""
        raise ConfigError(f"{what} has {dataset.streams} streams but evaluates in batches of "
                          f"{batch_size}{ranks} ({how} batch size); pass it as "
                          f"DataLoader({what.removesuffix('_data')}, batch_size="
                          f"{dataset.streams // world_size or 1}) so that each batch takes one "
                          f"chunk of every stream")


class PackedSequences(Dataset):
    """Non-overlapping blocks of ``seq_len + 1`` tokens of one long sequence: (inputs, targets)
    of ``seq_len`` each. The tail shorter than a block is dropped."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        tokens = torch.as_tensor(tokens)
        if seq_len < 1 or len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens make no block of seq_len + 1 = "
                             f"{seq_len + 1}")
        self.seq_len = seq_len
        self.blocks = tokens[:(len(tokens) // (seq_len + 1)) * (seq_len + 1)].view(
            -1, seq_len + 1)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[i]
        return block[:-1], block[1:]
