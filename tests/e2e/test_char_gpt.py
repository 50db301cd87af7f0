"""The char-level GPT example, from Python and from the CLI, on a corpus the test writes."""

from __future__ import annotations

import math

import pytest

from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import load_verified
from tests.conftest import REPO

CORPUS = "".join(f"the {a} fox jumps over the {b} dog.\n"
                 for a in ("quick", "brown", "lazy", "red") for b in ("big", "small", "old")) * 40


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "input.txt").write_text(CORPUS)
    return tmp_path


def test_char_gpt_trains_from_python(corpus, tmp_path):
    from examples.char_gpt import train

    run_dir = tmp_path / "py"
    res = train(str(corpus), str(run_dir), steps=40, block_size=32,
                model_kwargs={"layers": 1, "heads": 2, "dim": 32},
                overrides={"optim.lr": 3e-3, "log.progress": "off", "log.every_steps": 1,
                           "eval.max_batches": 2})
    assert res.results["steps"] == 40
    evals = read_jsonl(run_dir / "evals.jsonl")
    assert [e["step"] for e in evals] == [5 * i for i in range(1, 9)]  # eval.every_steps
    assert evals[-1]["val_loss"] < math.log(256) - 2  # well below a uniform guess over bytes
    samples = read_jsonl(run_dir / "scalars.jsonl")
    assert len(samples) == 8 and all(len(s["sample"]) > 0 for s in samples)
    groups = load_verified(run_dir / "checkpoints" / "last.pt")["optimizer"]["param_groups"]
    assert all(tuple(g["betas"]) == (0.9, 0.95) for g in groups)
    lrs = [r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert max(lrs) > lrs[0] and lrs[-1] < max(lrs)  # warmup, then cosine decay


def test_char_gpt_config_trains_from_the_cli(corpus, tmp_path, monkeypatch):
    # In-process: the CLI's own entry point, run from the repo root as the config says
    # (a subprocess would add seconds of imports; tests/test_cli.py covers real processes).
    from ironloop.cli import main

    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "cli"
    code = main(["train", "configs/char_gpt.yaml", f"data.root={corpus}", f"run.dir={run_dir}",
                 "data.kwargs={block_size: 32}",
                 "model.kwargs={layers: 1, heads: 2, dim: 32}",  # block_size: from the data
                 "train.max_steps=30", "eval.every_steps=10", "eval.max_batches=2",
                 "optim.lr=3e-3", "schedule.warmup_steps=3", "log.progress=off"])
    assert code == 0
    evals = read_jsonl(run_dir / "evals.jsonl")
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    assert all(r["tokens_per_s"] > 0 for r in read_jsonl(run_dir / "metrics.jsonl"))
    groups = load_verified(run_dir / "checkpoints" / "last.pt")["optimizer"]["param_groups"]
    assert all(tuple(g["betas"]) == (0.9, 0.95) for g in groups)
