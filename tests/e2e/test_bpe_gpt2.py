"""examples/bpe_gpt2.py end to end from the CLI: a BPE tokenizer trained on local text, packed
sequences, a transformers GPT-2 from a config, val_ppl and tokens_per_s, evaluation every N
steps, then a kill -9 and a resume that ends with the same bits as an uninterrupted run."""

from __future__ import annotations

import math
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ironloop.outputs.readers import read_jsonl
from tests.conftest import REPO, logged_step, piped_stderr, wait_running

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

TEXT = "".join(f"{w} {v} the {o} near the {p}.\n" for w in ("A fox", "The dog", "My cat", "One owl")
               for v in ("watched", "chased", "found") for o in ("ball", "stick", "bird")
               for p in ("river", "barn")) * 2


def command(run_dir, root, *extra):
    return [sys.executable, "-m", "ironloop", "train", "configs/bpe_gpt2.yaml",
            f"data.root={root}", f"run.dir={run_dir}", "data.kwargs={vocab_size: 300, seq_len: 16}",
            "model.kwargs={layers: 1, heads: 2, dim: 32}", "train.epochs=50", "train.max_steps=60",
            "train.batch_size=8", "eval.every_steps=20", "checkpoint.every_steps=10",
            "log.every_steps=1", "log.progress=off", "schedule.warmup_steps=5", *extra]


def test_the_gpt2_begins_and_ends_with_this_tokenizers_token_and_transformers_says_nothing(
        tmp_path):
    """GPT2Config's default bos/eos id, 50256, is outside a 300-token vocabulary: transformers
    logged 'bos_token_id must be None or an integer within the vocabulary' on every run."""
    import logging

    from examples import bpe_gpt2

    (tmp_path / "input.txt").write_text(TEXT)
    data = bpe_gpt2.data(str(tmp_path), vocab_size=300, seq_len=16)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model = bpe_gpt2.model(data["vocab_size"], data["seq_len"], layers=1, heads=2, dim=32,
                               eos_token_id=data["eos_token_id"])
    finally:
        logger.removeHandler(handler)
    end = bpe_gpt2.tokenizer(tmp_path / "input.txt", 300).token_to_id("<|endoftext|>")
    assert model.config.bos_token_id == model.config.eos_token_id == end
    assert 0 <= end < data["vocab_size"]
    assert not [m for m in said if "token_id" in m], said


@pytest.mark.slow
def test_bpe_gpt2_trains_from_the_cli_and_resumes_exactly_after_kill_9(tmp_path):
    (tmp_path / "input.txt").write_text(TEXT)
    whole = subprocess.run(command(tmp_path / "whole", tmp_path), cwd=REPO, capture_output=True,
                           text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    assert (tmp_path / "tokenizer.json").is_file()  # trained here, reused by the next runs
    evals = read_jsonl(tmp_path / "whole" / "evals.jsonl")
    assert [e["step"] for e in evals] == [20, 40, 60]
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert all(r["tokens_per_s"] > 0 for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl"))
    assert "tokens/s (training" in whole.stdout

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(command(run_dir, tmp_path), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_running(proc, lambda: logged_step(run_dir) >= 25, "step 25", piped_stderr(proc))
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    resumed = subprocess.run(command(run_dir, tmp_path, "--resume"), cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    a = load_file(tmp_path / "whole" / "final.safetensors")
    b = load_file(run_dir / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [e["val_loss"] for e in read_jsonl(run_dir / "evals.jsonl")] == \
        [e["val_loss"] for e in evals]
