"""Truncated BPTT with an LSTM language model: ironloop, and the plain torch loop it equals.

This is pytorch/examples' word_language_model, on bytes: the text is cut into ``streams``
contiguous columns (``batchify``), each step reads the next ``bptt`` tokens of every column,
and the LSTM's hidden state flows from one step to the next, detached at the step boundary.
ironloop provides each piece:

- ``ironloop.data.lm.ContiguousStreams`` serves chunk ``i`` of every stream as batch ``i``
  (with ``data.shuffle=false`` and ``train.batch_size = streams``);
- the step takes a third parameter, ``state``: the hidden state lives there, detached, reset at
  each epoch's start, kept apart for evaluation, and checkpointed (a kill -9 mid-epoch resumes
  with the same state);
- the step returns its token count as the loss weight, so the short last chunk counts for the
  tokens it holds, in training and evaluation alike, and ``val_ppl`` is exp(val_loss) per token;
- the data factory returns ``vocab_size``, which the model factory receives.

``plain_loop`` below is the same training in plain torch, with no ironloop import;
``tests/e2e/test_tbptt_lstm.py`` proves the two give equal weights (``torch.equal``).

From the CLI (run from the repository root, with any text file in DATA_DIR/input.txt)::

    ironloop train configs/tbptt_lstm.yaml data.root=DATA_DIR
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256  # bytes


def read_bytes(path: Path) -> torch.Tensor:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: put a text file there, or set data.root / data.kwargs")
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def data(root: str, file: str = "input.txt", streams: int = 16, bptt: int = 32,
         val_fraction: float = 0.1) -> dict:
    """The data factory: train and val streams, and the vocabulary size for the model."""
    from ironloop.data.lm import ContiguousStreams

    tokens = read_bytes(Path(root) / file)
    cut = int(len(tokens) * (1 - val_fraction))
    return {"train": ContiguousStreams(tokens[:cut], streams, bptt),
            "val": ContiguousStreams(tokens[cut:], streams, bptt),
            "vocab_size": VOCAB}


class LSTMLM(nn.Module):
    """Embedding -> LSTM -> linear head; ``forward(x, hidden)`` returns (logits, hidden)."""

    def __init__(self, vocab_size: int, dim: int = 64, hidden: int = 128, layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.lstm = nn.LSTM(dim, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor, hidden=None):
        out, hidden = self.lstm(self.embed(x), hidden)
        return self.head(out), hidden


def model(vocab_size: int, dim: int = 64, hidden: int = 128, layers: int = 1) -> LSTMLM:
    """The model factory: ``vocab_size`` comes from the data factory."""
    return LSTMLM(vocab_size, dim, hidden, layers)


def step(model: nn.Module, batch, state):
    """Next-token cross-entropy, the hidden state carried in ``state``, weighted by tokens."""
    x, y = batch
    logits, hidden = model(x, state.get("hidden"))  # None at an epoch's (or evaluation's) start
    state["hidden"] = hidden  # stored detached: the gradient stops here
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()), {}, y.numel()


# --- the same training in plain torch ------------------------------------------------------

def batchify(tokens: torch.Tensor, streams: int) -> torch.Tensor:
    n = len(tokens) // streams
    return tokens[:n * streams].view(streams, n)


def chunks(data: torch.Tensor, bptt: int):
    for i in range(0, data.shape[1] - 1, bptt):
        n = min(bptt, data.shape[1] - 1 - i)
        yield data[:, i:i + n], data[:, i + 1:i + 1 + n]


def plain_evaluate(model: LSTMLM, tokens: torch.Tensor, streams: int, bptt: int) -> float:
    """Mean loss per token over the whole split (word_language_model's ``evaluate``)."""
    model.eval()
    total, count, hidden = 0.0, 0, None
    with torch.no_grad():
        for x, y in chunks(batchify(tokens, streams), bptt):
            logits, hidden = model(x, hidden)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def plain_loop(model: LSTMLM, train_tokens: torch.Tensor, val_tokens: torch.Tensor,
               streams: int, bptt: int, lr: float, epochs: int, clip: float) -> list[float]:
    """SGD with gradient clipping, the hidden state detached between chunks and reset at each
    epoch; returns the validation perplexity after each epoch."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data, ppl = batchify(train_tokens, streams), []
    for _ in range(epochs):
        model.train()
        hidden = None
        for x, y in chunks(data, bptt):
            opt.zero_grad(set_to_none=True)
            logits, hidden = model(x, hidden)
            hidden = tuple(h.detach() for h in hidden)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        ppl.append(math.exp(plain_evaluate(model, val_tokens, streams, bptt)))
    return ppl
