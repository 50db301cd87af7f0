"""A tiny character-level GPT trained with ``ironloop.fit``: a language model, end to end.

It shows everything a language model needs from ironloop, and nothing is patched:
a ``data(root, ...)`` factory that also returns the vocabulary size and context length, a model
factory that receives them, a ``step`` function (next-token cross-entropy, weighted by its
tokens: ``tokens_per_s`` and ``val_ppl`` are logged),
a sampling callback, step-based evaluation (``eval.every_steps`` on a fixed ``eval.max_batches``
subset), warmup + cosine, and AdamW with betas (0.9, 0.95).

Characters are bytes (a vocabulary of 256), so any text file works with no vocabulary file.

From Python (run from the repository root)::

    python -m examples.char_gpt path/to/dir_with_input_txt --steps 2000

From the CLI, with the same factories named in ``configs/char_gpt.yaml``::

    ironloop train configs/char_gpt.yaml data.root=path/to/dir_with_input_txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import ironloop
from ironloop.callbacks import Callback

VOCAB = 256  # bytes


# --- data ----------------------------------------------------------------------------------

class Windows(Dataset):
    """Every window of ``block_size`` bytes, paired with the same window shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, len(self.tokens) - self.block_size)

    def __getitem__(self, i: int):
        chunk = self.tokens[i:i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def data(root: str, file: str = "input.txt", block_size: int = 64,
         val_fraction: float = 0.1) -> dict:
    """train and val from ``root/file``: the first 90% of the text trains, the last 10%
    validates (a contiguous split, so no validation window overlaps a training one). The other
    keys are metadata: the model factory receives ``vocab_size`` and ``block_size`` from here,
    so the context length is set once, in data.kwargs."""
    path = Path(root) / file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: put a text file there, or set data.root / data.kwargs")
    tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - val_fraction))
    return {"train": Windows(tokens[:cut], block_size), "val": Windows(tokens[cut:], block_size),
            "vocab_size": VOCAB, "block_size": block_size}


# --- model ---------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3, heads, c/heads) -> three (b, heads, t, c/heads) tensors
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(dim), SelfAttention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CharGPT(nn.Module):
    def __init__(self, block_size: int, layers: int, heads: int, dim: int,
                 vocab_size: int = VOCAB):
        super().__init__()
        self.block_size = block_size
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(block_size, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(batch, time) byte ids -> (batch, time, 256) next-byte logits."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(self.embed(idx) + self.position(pos))))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, length: int, generator: torch.Generator,
                 temperature: float = 1.0) -> torch.Tensor:
        """Append ``length`` sampled bytes to the (1, t) ``prompt``."""
        idx = prompt
        for _ in range(length):
            logits = self(idx[:, -self.block_size:])[:, -1] / temperature
            probs = logits.float().softmax(-1).cpu()  # sampled on the host: one sync per byte
            nxt = torch.multinomial(probs, 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt(vocab_size: int = VOCAB, block_size: int = 64, layers: int = 4, heads: int = 4,
        dim: int = 128) -> CharGPT:
    """The model factory: ``vocab_size`` and ``block_size`` come from the data factory (it
    takes neither input_shape nor num_classes, and need not)."""
    return CharGPT(block_size, layers, heads, dim, vocab_size)


def step(model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
    """Mean next-byte cross-entropy over every position of every window."""
    x, y = batch
    logits = model(x)
    # The third value is the loss's weight, its tokens: ironloop logs tokens_per_s.
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), {}, y.numel()


# --- a sampling callback -------------------------------------------------------------------

class Sample(Callback):
    """After every evaluation, sample some text and log it to scalars.jsonl.

    It draws from its own generator, seeded by the step, so sampling never moves the training
    RNG: a resumed run trains exactly as an uninterrupted one.
    """

    def __init__(self, prompt: str = "\n", length: int = 80, seed: int = 0):
        self.prompt, self.length, self.seed = prompt.encode(), length, seed
        self.samples: list[str] = []

    def on_eval_end(self, run, metrics: dict) -> None:
        if not run.world.is_main:
            return
        model = run.model  # the user's module, not the DDP wrapper
        was_training = model.training
        model.eval()
        prompt = torch.tensor([list(self.prompt)], device=run.device)
        gen = torch.Generator().manual_seed(self.seed + metrics["step"])
        out = model.generate(prompt, self.length, gen)[0, len(self.prompt):]
        model.train(was_training)
        text = bytes(out.tolist()).decode("utf-8", errors="replace")  # host copy
        self.samples.append(text)
        run.log_scalars({"sample": text})
        print(f"step {metrics['step']}  val_loss {metrics['val_loss']:.3f}  sample: {text!r}")


# --- training from Python ------------------------------------------------------------------

def config(run_dir: str, steps: int) -> dict:
    return {
        "run.dir": run_dir, "train.epochs": 1, "train.max_steps": steps,
        "train.batch_size": 32, "log.every_steps": 10, "log.progress": "auto",
        "eval.every_steps": max(1, steps // 8), "eval.max_batches": 20,
        "optim.name": "adamw", "optim.lr": 1e-3, "optim.weight_decay": 0.1,
        "optim.betas": [0.9, 0.95],  # nanoGPT's: a shorter memory for the second moment
        "schedule.name": "warmup_cosine", "schedule.warmup_steps": max(1, steps // 20),
        "schedule.eta_min": 1e-4, "clip.max_norm": 1.0,
    }


def train(root: str, run_dir: str, steps: int = 2000, block_size: int = 64,
          model_kwargs: dict | None = None, overrides: dict | None = None,
          resume: bool = False) -> ironloop.FitResult:
    splits = data(root, block_size=block_size)
    train_set, val_set = splits["train"], splits["val"]
    model = gpt(block_size=block_size, **(model_kwargs or {}))
    return ironloop.fit(model, train_set, val_set, {**config(run_dir, steps), **(overrides or {})},
                        step_fn=step, callbacks=[Sample()], resume=resume)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", help="directory holding input.txt")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--run-dir", default="runs/char_gpt_py")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    result = train(args.root, args.run_dir, args.steps, resume=args.resume)
    print(f"done: {result.results['steps']} steps, outputs in {result.run_dir}")


if __name__ == "__main__":
    main()
