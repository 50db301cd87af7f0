"""A language model end to end, from a text file to perplexity, with nothing downloaded.

- a byte-level BPE tokenizer trained here on the local text (Hugging Face ``tokenizers``),
  saved beside it as ``tokenizer.json`` and reused by every later run, resumes included;
- the token stream packed into blocks of ``seq_len + 1`` (``ironloop.data.lm.PackedSequences``);
- a small GPT-2 built from a config (Hugging Face ``transformers``, no pretrained weights);
- the data factory returns ``vocab_size`` and ``seq_len``, which the model factory receives;
- ``train.step_fn=lm``: next-token cross-entropy per token, so ``val_ppl`` and ``tokens_per_s``
  are logged.

Run from the repository root (``pip install tokenizers transformers``)::

    ironloop train configs/bpe_gpt2.yaml data.root=DATA_DIR         # DATA_DIR/input.txt
    # kill -9 it at any point, then the same command with --resume: the same bits
"""

from __future__ import annotations

from pathlib import Path

import torch


def tokenizer(text_file: Path, vocab_size: int):
    """The BPE tokenizer of ``text_file``: trained once, then read back from tokenizer.json (so
    a resumed run encodes the text exactly as the run it continues)."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    saved = text_file.with_name("tokenizer.json")
    if saved.is_file():
        return Tokenizer.from_file(str(saved))
    tok = ByteLevelBPETokenizer()
    tok.train([str(text_file)], vocab_size=vocab_size, min_frequency=2,
              special_tokens=["<|endoftext|>"], show_progress=False)
    tmp = saved.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(saved)  # atomic: a run killed mid-save leaves no half-written tokenizer
    return Tokenizer.from_file(str(saved))


def data(root: str, file: str = "input.txt", vocab_size: int = 512, seq_len: int = 64,
         val_fraction: float = 0.1) -> dict:
    """Packed train and val blocks, and what the model factory needs to know."""
    from ironloop.data.lm import PackedSequences

    path = Path(root) / file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: put a text file there, or set data.root / data.kwargs")
    tok = tokenizer(path, vocab_size)
    ids = torch.tensor(tok.encode(path.read_text(encoding="utf-8")).ids, dtype=torch.long)
    cut = int(len(ids) * (1 - val_fraction))
    return {"train": PackedSequences(ids[:cut], seq_len),
            "val": PackedSequences(ids[cut:], seq_len),
            "vocab_size": tok.get_vocab_size(), "seq_len": seq_len,
            "eos_token_id": tok.token_to_id("<|endoftext|>")}


def model(vocab_size: int, seq_len: int, layers: int = 2, heads: int = 2, dim: int = 64,
          eos_token_id: int | None = None):
    """A GPT-2 from a config, sized by the data factory's vocab_size and seq_len.

    Its begin and end token is this tokenizer's ``<|endoftext|>`` (the data factory's
    ``eos_token_id``), as GPT-2's is its own: GPT2Config's default, 50256, is GPT-2's
    vocabulary, outside this one (transformers warns of it on every build)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=dim, n_layer=layers,
                        n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    return GPT2LMHeadModel(config)
