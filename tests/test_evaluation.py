"""Step-based evaluation: eval.every_steps, eval.max_batches, and what follows evaluations
(best tracking, early stopping, plateau, best.pt); the progress bar respects max_steps."""

from __future__ import annotations

from torch.utils.data import Dataset

import ironloop
from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import load_verified
from tests.conftest import blobs, cfg, plateau_recorder, tiny_mlp


def test_every_steps_evaluates_on_the_step_path_and_plateau_follows(tmp_path):
    calls = []

    Plateau = plateau_recorder(calls)

    # 7 steps an epoch, 2 epochs: evaluations at steps 3, 6, 9, 12
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                 cfg(tmp_path, train__epochs=2, eval__every_steps=3),
                 scheduler=lambda o: Plateau(o))
    run = tmp_path / "run"
    evals = read_jsonl(run / "evals.jsonl")
    assert [e["step"] for e in evals] == [3, 6, 9, 12]
    assert calls == [e["val_loss"] for e in evals]
    epochs = read_jsonl(run / "epochs.jsonl")
    ref = tmp_path / "ref"
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), {**cfg(tmp_path, train__epochs=1),
                 "run.dir": str(ref)})
    assert epochs[0].keys() == read_jsonl(ref / "epochs.jsonl")[0].keys()  # same fields
    assert epochs[0]["val_loss"] == evals[1]["val_loss"]  # the latest evaluation (step 6)
    assert [e["step"] for e in read_jsonl(ref / "evals.jsonl")] == [7]  # 0 = at epoch ends


def test_early_stopping_and_best_pt_follow_evaluations(tmp_path):
    # mode=max on a loss with a huge min_delta: only the first evaluation improves, so the run
    # stops after `patience` more EVALUATIONS, mid-epoch, not after epochs.
    conf = cfg(tmp_path, train__epochs=5, eval__every_steps=2, early_stop__patience=2,
               early_stop__mode="max", early_stop__min_delta=1e9)
    res = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), conf)
    assert res.results["stopped_early"] and res.results["steps"] == 6
    best = load_verified(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["progress"]["step"] == 2


class Recording(Dataset):
    """A map-style val set (not TensorData) that records which samples an evaluation reads."""

    def __init__(self, data):
        self.data, self.seen = data, []

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.seen.append(i)
        return self.data[i]


def test_max_batches_evaluates_the_same_fixed_subset_every_time(tmp_path):
    val = Recording(blobs(n=100, seed=1))
    ironloop.fit(tiny_mlp(), blobs(), val,
                 cfg(tmp_path, train__epochs=1, eval__every_steps=2, eval__max_batches=1))
    n = 32  # one batch of train.batch_size
    firsts = [sorted(val.seen[i:i + n]) for i in range(0, len(val.seen), n)]
    assert len(val.seen) == 3 * n  # evaluations at steps 2, 4, 6
    assert firsts[0] == firsts[1] == firsts[2] != list(range(n))  # fixed, and not just a prefix
    # the in-memory path caps too, and reports a loss over its subset
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=100, seed=1), {**cfg(
        tmp_path, train__epochs=1, eval__max_batches=1), "run.dir": str(tmp_path / "b")})
    assert read_jsonl(tmp_path / "b" / "evals.jsonl")[0]["val_loss"] > 0


def test_progress_bar_total_respects_max_steps(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(), None,
                 cfg(tmp_path, train__epochs=3, train__max_steps=3, log__progress="on"))
    err = capsys.readouterr().err
    assert "0/3 " in err and "/7" not in err  # an epoch is 7 steps; the run is 3
