"""examples/tbptt_lstm.py: ironloop's stateful, token-weighted TBPTT equals the plain torch loop
written beside it, bit for bit; and a kill -9 mid-epoch resumes to the same bits."""

from __future__ import annotations

import math
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ironloop
from ironloop.outputs.readers import read_jsonl
from tests.conftest import REPO, logged_step, piped_stderr, wait_running

CORPUS = "".join(f"{a} {b} sat on the {c}.\n" for a in ("the cat", "a dog", "my fox")
                 for b in ("quietly", "once") for c in ("mat", "log", "hill"))


def tokens(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()


def test_ironloop_equals_the_plain_torch_loop(tmp_path):
    from examples import tbptt_lstm as ex

    (tmp_path / "input.txt").write_text(CORPUS)
    streams, bptt, epochs = 4, 7, 2  # 7 does not divide the streams: a short last chunk
    splits = ex.data(str(tmp_path), streams=streams, bptt=bptt)
    torch.manual_seed(0)
    ours = ex.model(splits["vocab_size"], dim=16, hidden=24)
    plain = ex.model(splits["vocab_size"], dim=16, hidden=24)
    plain.load_state_dict(ours.state_dict())

    result = ironloop.fit(ours, splits["train"], splits["val"], {
        "run.dir": str(tmp_path / "run"), "run.device": "cpu",  # where the plain loop runs
        "train.epochs": epochs, "train.batch_size": streams,
        "data.shuffle": False, "optim.name": "sgd", "optim.lr": 0.5, "optim.momentum": 0.0,
        "optim.weight_decay": 0.0, "clip.max_norm": 0.25, "log.progress": "off",
        "log.every_steps": 1, "eval.perplexity": True}, step_fn=ex.step, overwrite=True)

    cut = int(len(tokens(CORPUS)) * 0.9)
    ppl = ex.plain_loop(plain, tokens(CORPUS)[:cut], tokens(CORPUS)[cut:], streams, bptt,
                        lr=0.5, epochs=epochs, clip=0.25)
    for (name, a), b in zip(ours.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [round(e["val_ppl"], 6) for e in evals] == pytest.approx(ppl, rel=1e-6)
    assert all(math.isclose(e["val_ppl"], math.exp(e["val_loss"]), rel_tol=1e-9) for e in evals)
    assert result.results["steps"] == epochs * len(splits["train"]) // streams


def _cli(run_dir, corpus_dir, *extra):
    return [sys.executable, "-m", "ironloop", "train", "configs/tbptt_lstm.yaml",
            f"data.root={corpus_dir}", f"run.dir={run_dir}", "data.kwargs={streams: 4, bptt: 8}",
            "model.kwargs={dim: 16, hidden: 24}", "train.epochs=2", "train.batch_size=4",
            "checkpoint.every_steps=2", "log.every_steps=1", "log.progress=off",
            "doctor.preflight=false", *extra]


@pytest.mark.slow
def test_kill_mid_epoch_resumes_with_the_same_hidden_state(tmp_path):
    (tmp_path / "input.txt").write_text(CORPUS)
    whole = subprocess.run(_cli(tmp_path / "whole", tmp_path), cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cli(run_dir, tmp_path), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    # Kill inside the first epoch, past a mid-epoch checkpoint that carries the hidden state.
    wait_running(proc, lambda: logged_step(run_dir) >= 9, "step 9",  # epoch 1 has 15 steps
                 piped_stderr(proc))
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    resumed = subprocess.run(_cli(run_dir, tmp_path, "--resume"), cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    a = load_file(tmp_path / "whole" / "final.safetensors")
    b = load_file(run_dir / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals_a = read_jsonl(tmp_path / "whole" / "evals.jsonl")
    evals_b = read_jsonl(run_dir / "evals.jsonl")
    assert [e["val_loss"] for e in evals_a] == [e["val_loss"] for e in evals_b]
