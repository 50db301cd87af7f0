"""nanoGPT (karpathy/nanoGPT): its train.py, run unmodified on its published CPU recipe
(README: --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
--batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0), against ironloop.fit on its
unmodified model.py, one evaluator for both.

Data: Tiny Shakespeare cannot be downloaded here, so the text is wikitext-2's valid.txt
(~1.1 MB), char-level as data/shakespeare_char/prepare.py encodes it (first 90% train). Size:
STEPS iterations (the recipe: 2000), warmup 10, lr decay over STEPS, one thread each.
"""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.outside import common

STEPS, BLOCK = 200, 64
NANOGPT = common.OUTSIDE / "nanoGPT"
TEXT = common.OUTSIDE / "word_language_model" / "data" / "wikitext-2" / "valid.txt"
RECIPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
          f"--block_size={BLOCK}", "--batch_size=12", "--n_layer=4", "--n_head=4",
          "--n_embd=128", "--dropout=0.0"]
sys.path.insert(0, str(NANOGPT))
from model import GPT, GPTConfig  # noqa: E402  # the public model, unmodified


def encoded() -> tuple[np.ndarray, np.ndarray, int]:
    """prepare.py's encoding: sorted chars, first 90% train, uint16."""
    text = TEXT.read_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(chars)


def reference(tmp: Path) -> tuple[GPT, list[float]]:
    """train.py as published, in a copy of the checkout with the data prepared beside it."""
    work = tmp / "nanoGPT"
    shutil.copytree(NANOGPT, work, ignore=shutil.ignore_patterns("assets", "*.ipynb"))
    train, val, vocab = encoded()
    data = work / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    train.tofile(data / "train.bin")
    val.tofile(data / "val.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab}))
    r = subprocess.run([sys.executable, "train.py", "config/train_shakespeare_char.py", *RECIPE,
                        f"--max_iters={STEPS}", f"--lr_decay_iters={STEPS}",
                        "--warmup_iters=10", f"--eval_interval={STEPS}",
                        "--always_save_checkpoint=True", f"--out_dir={tmp / 'out'}"],
                       cwd=work, capture_output=True, text=True, check=True,
                       env={"OMP_NUM_THREADS": "1", "PATH": ""})
    ms = [float(m) for m in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", r.stdout)]
    ckpt = torch.load(tmp / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model, ms[2:]  # iter 0 and 1: the first step, and the one after the evaluation


class Windows(Dataset):
    """Every BLOCK-token window and its next-token targets (nanoGPT samples them at random)."""

    def __init__(self, ids: np.ndarray):
        self.ids = torch.from_numpy(ids.astype(np.int64))

    def __len__(self):
        return len(self.ids) - BLOCK

    def __getitem__(self, i):
        return self.ids[i:i + BLOCK], self.ids[i + 1:i + 1 + BLOCK]


def ironloop_user(train, val, vocab, run_dir, resume=False, callbacks=()):
    import ironloop
    torch.manual_seed(1337)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=vocab, n_layer=4, n_head=4,
                          n_embd=128, dropout=0.0, bias=False))
    return ironloop.fit(model, Windows(train), Windows(val), {
        "run.dir": str(run_dir), "run.threads": 1, "train.max_steps": STEPS,
        "train.batch_size": 12, "train.step_fn": "lm", "optim.name": "adamw",
        "optim.lr": 1e-3, "optim.betas": [0.9, 0.99], "optim.weight_decay": 0.1,
        "schedule.name": "warmup_cosine", "schedule.warmup_steps": 10,
        "schedule.eta_min": 1e-4, "clip.max_norm": 1.0, "eval.max_batches": 20,
        "log.progress": "off", "checkpoint.every_steps": 50}, resume=resume,
        callbacks=list(callbacks))


def val_loss(model: GPT, val: np.ndarray) -> str:
    """One evaluator for both: the mean loss over 240 windows spread evenly over val."""
    windows = Windows(val)
    starts = np.linspace(0, len(windows) - 1, 240).astype(int)
    model.eval()
    with torch.no_grad():
        losses = []
        for chunk in np.array_split(starts, 10):
            x, y = zip(*(windows[int(i)] for i in chunk))
            losses.append(model(torch.stack(x), torch.stack(y))[1])
    return f"val loss {torch.stack(losses).mean().item():.4f}"


def main() -> None:
    common.one_thread()
    train, val, vocab = encoded()
    child = common.child_args()
    if child:
        ironloop_user(train, val, vocab, child[0], resume=child[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        ref, ref_ms = reference(Path(tmp))
        clock = common.StepClock()
        ours = ironloop_user(train, val, vocab, Path(tmp) / "straight", callbacks=[clock])
        resume = common.kill_and_resume("benchmarks.outside.nanogpt", Path(tmp) / "killed",
                                        100, Path(tmp) / "straight" / "final.safetensors")
    common.print_row("nanoGPT (char, CPU recipe)", {
        "ref_metric": val_loss(ref, val), "ours_metric": val_loss(ours.model, val),
        "ref_ms": common.median(ref_ms), "ours_ms": common.median(clock.ms),
        "ref_lines": common.file_lines(NANOGPT / "train.py"),
        "ours_lines": common.lines_of(Windows, ironloop_user), "resume": resume})


if __name__ == "__main__":
    main()
