"""A Hugging Face GPT-2 (random init, small GPT2Config): transformers.Trainer against ironloop
on the same tokens, one evaluator for both.

Data: wikitext-2's valid.txt (the snapshot has no train.txt), char-level, in blocks of BLOCK
tokens (PackedSequences' cut); the last 10% of blocks are validation. Size: 2 layers, 2 heads,
n_embd 64, BLOCK 64, batch 16, STEPS steps of AdamW (lr 1e-3, no weight decay, clip 1.0,
constant LR), seed 0.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from benchmarks.outside import common

STEPS, BLOCK, BATCH = 150, 64, 16
TEXT = common.OUTSIDE / "word_language_model" / "data" / "wikitext-2" / "valid.txt"


class Blocks(Dataset):
    """{"input_ids", "labels"} blocks: a causal LM shifts the labels itself."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def splits() -> tuple[Blocks, Blocks, int]:
    text = TEXT.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text])
    blocks = ids[:len(ids) // BLOCK * BLOCK].view(-1, BLOCK)
    cut = int(0.9 * len(blocks))
    return Blocks(blocks[:cut]), Blocks(blocks[cut:]), len(chars)


def gpt2(vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=BLOCK, n_embd=64,
                                      n_layer=2, n_head=2))


def reference_user(model, train, out_dir, callbacks=()):
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
        logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=list(callbacks))
    trainer.train()
    return trainer.model


def ironloop_user(model, train, val, run_dir, resume=False, callbacks=()):
    import ironloop
    return ironloop.fit(model, train, val, {
        "run.dir": str(run_dir), "run.threads": 1, "train.max_steps": STEPS,
        "train.batch_size": BATCH, "train.step_fn": "lm", "optim.name": "adamw",
        "optim.lr": 1e-3, "optim.weight_decay": 0.0, "clip.max_norm": 1.0,
        "log.progress": "off", "checkpoint.every_steps": 50}, resume=resume,
        callbacks=list(callbacks))


def val_loss(model, val: Blocks) -> str:
    """One evaluator for both sides: the mean next-token loss over the validation blocks."""
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=val.blocks[i:i + 64], labels=val.blocks[i:i + 64]).loss
                  for i in range(0, len(val.blocks), 64)]
    return f"val loss {torch.stack(losses).mean().item():.4f}"


def trainer_clock():
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ms, self.last = [], None

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.last is not None:
                self.ms.append(1000 * (now - self.last))
            self.last = now

    return Clock()


def main() -> None:
    common.one_thread()
    train, val, vocab = splits()
    child = common.child_args()
    if child:
        ironloop_user(gpt2(vocab), train, val, child[0], resume=child[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        ref_clock = trainer_clock()
        ref = reference_user(gpt2(vocab), train, Path(tmp) / "hf", [ref_clock])
        clock = common.StepClock()
        ours = ironloop_user(gpt2(vocab), train, val, Path(tmp) / "straight", callbacks=[clock])
        resume = common.kill_and_resume("benchmarks.outside.hf_gpt2", Path(tmp) / "killed",
                                        100, Path(tmp) / "straight" / "final.safetensors")
    common.print_row("Hugging Face GPT-2 (Trainer)", {
        "ref_metric": val_loss(ref, val), "ours_metric": val_loss(ours.model, val),
        "ref_ms": common.median(ref_clock.ms), "ours_ms": common.median(clock.ms),
        "ref_lines": common.lines_of(reference_user), "ours_lines": common.lines_of(
            ironloop_user), "resume": resume})


if __name__ == "__main__":
    main()
