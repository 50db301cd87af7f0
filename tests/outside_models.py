"""Outside code as a new user brings it (issue 36), small enough for the test suite: a
nanoGPT-style GPT whose ``forward(idx, targets=None)`` computes its own loss and returns only
the last position's logits without targets, and word_language_model-style data whose
validation streams come as a DataLoader with their own batch size. Data and model factories for
``ironloop train`` (``data.name=tests.outside_models:chars`` and so on)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from ironloop.data.lm import ContiguousStreams, PackedSequences

TEXT = "".join(f"{a} {b} sat on the {c}.\n" for a in ("the cat", "a dog", "my fox", "one owl")
               for b in ("quietly", "once", "twice") for c in ("mat", "log", "hill", "roof"))


def text_tokens(root: str | None = None) -> tuple[torch.Tensor, int]:
    """Character ids of ROOT/input.txt (else TEXT), and the vocabulary size."""
    path = Path(root or "") / "input.txt"
    text = path.read_text() if root and path.is_file() else TEXT
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(ch) for ch in text], dtype=torch.long)
    return ids, len(vocab)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, block_size: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        mask = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT's interface: ``forward(idx, targets=None) -> (logits, loss)``; without targets
    only the last position's logits ``(B, 1, V)`` and no loss (its inference-time path)."""

    def __init__(self, vocab_size: int, block_size: int = 16, dim: int = 32, heads: int = 2,
                 layers: int = 1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, block_size) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss


class LastLogits(GPT):
    """A GPT whose forward takes no targets and returns last-position logits only: the LM step
    cannot compute a per-token loss from it (the error the preflight must stop on)."""

    def forward(self, idx: torch.Tensor):  # type: ignore[override]
        return super().forward(idx)[0]


def gpt(vocab_size: int, block_size: int = 16, dim: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size, block_size, dim)


def last_logits(vocab_size: int, block_size: int = 16) -> LastLogits:
    torch.manual_seed(0)
    return LastLogits(vocab_size, block_size)


def chars(root: str | None = None, block_size: int = 16) -> dict:
    """nanoGPT's shakespeare_char on a small text: packed blocks, 90/10 split."""
    ids, vocab = text_tokens(root)
    cut = int(len(ids) * 0.9)
    return {"train": PackedSequences(ids[:cut], block_size),
            "val": PackedSequences(ids[cut:], block_size), "vocab_size": vocab}


def word_lm(root: str | None = None, streams: int = 4, bptt: int = 7, val_streams: int = 10,
            val_batch: int | None = None) -> dict:
    """word_language_model's data: training streams, and validation streams built for their
    own batch size, as a DataLoader (``eval_batch_size``; ``val_batch`` to get it wrong)."""
    ids, vocab = text_tokens(root)
    cut = int(len(ids) * 0.7)
    val = ContiguousStreams(ids[cut:], val_streams, bptt)
    return {"train": ContiguousStreams(ids[:cut], streams, bptt),
            "val": DataLoader(val, batch_size=val_batch or val_streams), "vocab_size": vocab}


class Ragged(torch.utils.data.Dataset):
    """Sequences of two lengths: the default collate cannot stack a batch that mixes them."""

    def __init__(self, blocks: PackedSequences):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int):
        x, y = self.blocks[i]
        cut = len(x) - (i % 2)  # every other sample one token shorter
        return x[:cut], y[:cut]


def ragged_val(root: str | None = None, block_size: int = 16) -> dict:
    """nanoGPT's data with a validation split the evaluation cannot batch."""
    data = chars(root, block_size)
    return {**data, "val": Ragged(data["val"])}
