"""Step-based runs: a max_steps run that ends inside an epoch evaluates its final weights once,
as any evaluation (evals.jsonl, on_eval_end, the validation part of the time split, a printed
line), and `ironloop report` draws its validation curve from evals.jsonl."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

import ironloop
from ironloop.callbacks import Callback
from ironloop.outputs.readers import read_jsonl
from ironloop.tools.report import render_report, summarize
from tests.conftest import blobs, tiny_mlp


class Evals(Callback):
    def __init__(self):
        self.steps = []

    def on_eval_end(self, run, metrics):
        self.steps.append(metrics["step"])


def test_the_final_evaluation_of_a_max_steps_run_runs_once_and_counts(tmp_path, capsys):
    val_batches = []

    def step(model, batch):
        if not model.training:
            val_batches.append(len(batch[0]))  # every evaluation forward, counted
        x, y = batch
        return F.cross_entropy(model(x), y), {}

    seen = Evals()
    val = blobs(48, seed=1)
    # 10 steps per epoch: max_steps ends it mid-epoch
    result = ironloop.fit(tiny_mlp(), blobs(320), val, {
        "run.dir": str(tmp_path / "run"), "train.epochs": 5, "train.max_steps": 7,
        "train.batch_size": 32, "log.progress": "off", "eval.every_steps": 3,
        "log.every_steps": 1}, step_fn=step, callbacks=[seen], overwrite=True)
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [e["step"] for e in evals] == [3, 6, 7] and seen.steps == [3, 6, 7]
    assert sum(val_batches) == 3 * len(val)  # three evaluations, none run twice
    assert result.results["stopped_mid_epoch"]["val_loss"] == evals[-1]["val_loss"]
    assert result.results["time_split"]["validation"] > 0
    assert "final evaluation at step 7/7 (epoch 1): val_loss " in capsys.readouterr().out

    paths = render_report(tmp_path / "run")
    assert (tmp_path / "run" / "report" / "validation.png") in paths
    summary = summarize(tmp_path / "run")
    assert "| evaluations | 3 |" in summary
    assert "| epochs | 0 complete; ended inside epoch 1 |" in summary
    seconds = float(summary.split("| total seconds | ")[1].split(" |")[0])
    res = result.results  # no epoch line: the open epoch's training plus its final evaluation
    # (results' seconds and the time split's validation are two clocks: compare each to its own)
    assert res["seconds"] > res["train_seconds"] > 0
    assert abs(seconds - res["seconds"]) <= 0.05 + 1e-9  # .1f in the table


def test_an_evaluated_last_step_is_not_evaluated_again(tmp_path):
    seen = Evals()
    ironloop.fit(tiny_mlp(), blobs(320), blobs(48, seed=1), {
        "run.dir": str(tmp_path / "run"), "train.max_steps": 6, "train.batch_size": 32,
        "log.progress": "off", "eval.every_steps": 3}, callbacks=[seen], overwrite=True)
    assert seen.steps == [3, 6]
    assert math.isfinite(read_jsonl(tmp_path / "run" / "evals.jsonl")[-1]["val_loss"])
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt",
                      weights_only=True)["progress"]["step"] == 6
