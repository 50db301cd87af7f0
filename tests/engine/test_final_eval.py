"""The final weights are evaluated when eval.every_steps does not land on the run's last step
(issue 57, item 9): evals.jsonl ends at the last step and results.json's figures come from it."""

from __future__ import annotations

import json

import ironloop
from ironloop.outputs.readers import read_jsonl
from tests.conftest import blobs, cfg, tiny_mlp


def test_a_run_ending_at_an_epoch_boundary_evaluates_its_final_weights(tmp_path, capsys):
    # 7 steps an epoch, 2 epochs = 14 steps; every 4 steps evaluates at 4, 8 and 12 only
    res = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                       cfg(tmp_path, train__epochs=2, eval__every_steps=4,
                           early_stop__metric="val_acc", early_stop__mode="max"))
    run = tmp_path / "run"
    evals = read_jsonl(run / "evals.jsonl")
    assert [e["step"] for e in evals] == [4, 8, 12, 14]
    final = evals[-1]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 14
    assert results["final_val_acc"] == final["val_acc"]
    assert results["monitor"]["val_acc"] == max(e["val_acc"] for e in evals)
    assert read_jsonl(run / "epochs.jsonl")[-1]["val_loss"] == final["val_loss"]
    assert res.results["final_val_acc"] == final["val_acc"]
    assert "final evaluation at step 14/14" in capsys.readouterr().out


def test_a_run_whose_last_step_was_evaluated_is_not_evaluated_twice(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                 cfg(tmp_path, train__epochs=2, eval__every_steps=7))
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "evals.jsonl")] == [7, 14]


def test_only_the_last_epoch_end_adds_an_evaluation(tmp_path):
    # 3 epochs of 7 steps, every 5: 5, 10, 15, 20, then the final weights at 21 only
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                 cfg(tmp_path, train__epochs=3, eval__every_steps=5))
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "evals.jsonl")] == [5, 10, 15, 20, 21]
