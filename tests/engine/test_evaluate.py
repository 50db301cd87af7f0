"""Step-based evaluation: eval.every_steps, eval.max_batches, and what follows evaluations
(best tracking, early stopping, plateau, best.pt); the progress bar respects max_steps."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

import ironloop
from ironloop.data.loader import TensorData
from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import load_verified
from tests.conftest import blobs, cfg, plateau_recorder, tiny_mlp


def test_every_steps_evaluates_on_the_step_path_and_plateau_follows(tmp_path):
    calls = []

    Plateau = plateau_recorder(calls)

    # 7 steps an epoch, 2 epochs: evaluations at steps 3, 6, 9, 12 and the final weights at 14
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                 cfg(tmp_path, train__epochs=2, eval__every_steps=3),
                 scheduler=lambda o: Plateau(o))
    run = tmp_path / "run"
    evals = read_jsonl(run / "evals.jsonl")
    assert [e["step"] for e in evals] == [3, 6, 9, 12, 14]
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
    assert len(val.seen) == 4 * n  # evaluations at steps 2, 4, 6 and the final weights at 7
    # fixed, and not just a prefix
    assert firsts[0] == firsts[1] == firsts[2] == firsts[3] != list(range(n))
    # the in-memory path caps too, and reports a loss over its subset
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=100, seed=1), {**cfg(
        tmp_path, train__epochs=1, eval__max_batches=1), "run.dir": str(tmp_path / "b")})
    assert read_jsonl(tmp_path / "b" / "evals.jsonl")[0]["val_loss"] > 0


def test_progress_bar_total_respects_max_steps(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(), None,
                 cfg(tmp_path, train__epochs=3, train__max_steps=3, log__progress="on"))
    err = capsys.readouterr().err
    assert "0/3 " in err and "/7" not in err  # an epoch is 7 steps; the run is 3


def test_a_ragged_last_validation_batch_weighs_by_its_samples_not_as_a_batch(tmp_path):
    """70 samples in batches of 32: 32, 32, 6. val_loss and val_acc are the means over the 70
    samples, computed here by hand; a mean of the three batch means would weigh the 6 as 32."""
    import torch

    model, val = tiny_mlp(), blobs(n=70, seed=1)
    ironloop.fit(model, blobs(n=64), val, cfg(tmp_path, train__epochs=1))
    logged = read_jsonl(tmp_path / "run" / "epochs.jsonl")[0]
    with torch.no_grad():
        out = model(val.x)
        loss = float(torch.nn.functional.cross_entropy(out, val.y))
        acc = float((out.argmax(1) == val.y).float().mean())
        means = [float(torch.nn.functional.cross_entropy(out[i:i + 32], val.y[i:i + 32]))
                 for i in (0, 32, 64)]
    assert abs(sum(means) / 3 - loss) > 1e-3  # the test can tell the two apart
    assert logged["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert logged["val_acc"] == pytest.approx(acc, rel=1e-6)


def test_a_ragged_validation_set_of_per_token_losses_is_the_mean_over_its_tokens(tmp_path):
    """A step that returns (mean over its valid tokens, metrics, tokens): val_loss is the mean
    over every valid token of the split (-100 pads vary per sample), not over batches."""
    import torch

    def tokens(n: int, seed: int) -> TensorData:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 4, 8, generator=g)
        y = torch.randint(0, 3, (n, 4), generator=g)
        y[torch.arange(4)[None, :] > torch.arange(n)[:, None] % 4] = -100  # 1 to 4 tokens
        return TensorData(x, y)

    def step(m, batch):
        x, y = batch
        logits = m(x).reshape(-1, 3)
        loss = torch.nn.functional.cross_entropy(logits, y.reshape(-1), ignore_index=-100)
        return loss, {}, (y != -100).sum()

    model, val = tiny_mlp(), tokens(70, seed=1)
    ironloop.fit(model, tokens(64, seed=0), val, cfg(tmp_path, train__epochs=1), step_fn=step)
    logged = read_jsonl(tmp_path / "run" / "epochs.jsonl")[0]["val_loss"]
    with torch.no_grad():
        logits = model(val.x).reshape(-1, 3)
        by_hand = float(torch.nn.functional.cross_entropy(logits, val.y.reshape(-1),
                                                          ignore_index=-100))
    assert logged == pytest.approx(by_hand, rel=1e-5)


def test_the_test_split_is_printed_and_measured_on_the_best_weights_when_a_best_exists(
        tmp_path, capsys):
    """Issue 44: the test result was never printed, and it measured the last weights unless
    early_stop.patience > 0 (word_language_model tests its best). Monitoring val_loss with
    mode=max makes the first, worst epoch the best, so best and last weights differ."""
    import torch
    import torch.nn.functional as F

    from ironloop.engine.tokens import perplexity

    test = blobs(n=48, seed=2)
    result = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                          cfg(tmp_path, train__epochs=3, early_stop__mode="max",
                              eval__perplexity=True), test_data=test)
    best = tiny_mlp()
    best.load_state_dict(load_verified(tmp_path / "run/checkpoints/best.pt")["model"])
    with torch.no_grad():
        on_best = F.cross_entropy(best(test.x), test.y).item()
        on_last = F.cross_entropy(result.model(test.x), test.y).item()
    r = result.results
    assert r["test_weights"] == "best" and r["test_loss"] == pytest.approx(on_best, rel=1e-5)
    assert abs(on_best - on_last) > 1e-3  # the last weights would give another figure
    assert r["test_ppl"] == pytest.approx(perplexity(r["test_loss"]))
    out = capsys.readouterr().out
    assert "test (best weights): test_loss " in out and " test_ppl " in out


def test_a_step_that_raises_while_evaluating_says_so_in_a_note(tmp_path):
    import torch.nn.functional as F

    def step(model, batch):
        if not model.training:
            raise RuntimeError("no evaluation here")
        return F.cross_entropy(model(batch[0]), batch[1]), {}

    with pytest.raises(RuntimeError, match="^no evaluation here") as e:
        ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                     cfg(tmp_path, train__epochs=1, doctor__preflight=False), step_fn=step)
    assert e.value.__notes__ == ["ironloop: raised in evaluation at step 2, epoch 1; batch: a "
                                 "tuple (Tensor[32, 8] float32, Tensor[32] int64)"]


def test_a_rank_that_owes_forwards_runs_them_on_one_sample_on_the_device(monkeypatch):
    """Under FSDP2 (each forward a collective) a rank with fewer evaluation batches runs
    discarded forwards until every rank has run as many: here the count is given."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from ironloop.data.source import EvalBatching
    from ironloop.engine import evaluate
    from ironloop.parallel import data_parallel

    seen = []
    asked = []

    def owed(model, world, n, batch_size, done):
        asked.append((n, batch_size, done))
        return 2

    monkeypatch.setattr(data_parallel, "extra_forwards", owed)
    module = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext,
                             step_fn=lambda model, batch: seen.append(batch))
    run = SimpleNamespace(module=module, world=None)
    data = blobs(5)
    evaluate._pad_forwards(run, data, 1, EvalBatching(4, None, None), torch.nn.Identity())
    assert asked == [(5, 4, 1)]
    assert len(seen) == 2
    for batch in seen:
        assert torch.equal(batch[0], data.x[:1]) and torch.equal(batch[1], data.y[:1])


# -- evaluation on its own RNG stream (issue 59, item 8) --------------------------------------

def _noisy_step(model, batch):
    """A diffusion-like step: the loss depends on noise drawn from the global generator, in
    training and in evaluation alike."""
    x, y = batch
    noise = torch.randn_like(x)
    loss = torch.nn.functional.cross_entropy(model(x + noise), y)
    return loss, {}


def test_adding_val_data_leaves_a_random_drawing_steps_trajectory_unchanged(tmp_path):
    # Evaluation used to draw its noise (and its loader's base seed) from the global stream,
    # so the steps after it drew other noise: the weights moved once val_data was given.
    trained = []
    for name, val in (("plain", None), ("val", blobs(n=64, seed=1))):
        model = tiny_mlp()
        ironloop.fit(model, blobs(), val, cfg(tmp_path / name, train__epochs=3,
                                              eval__every_steps=2), step_fn=_noisy_step)
        trained.append(model.state_dict())
    for key, value in trained[0].items():
        assert torch.equal(value, trained[1][key]), key
    assert len(read_jsonl(tmp_path / "val/run/evals.jsonl")) > 3


def test_every_evaluation_of_a_split_draws_the_same_noise(tmp_path):
    # lr 0: the weights never move, so evaluations that drew the same noise score the same
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1),
                 cfg(tmp_path, train__epochs=3, eval__every_steps=2), step_fn=_noisy_step,
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    losses = [e["val_loss"] for e in read_jsonl(tmp_path / "run/evals.jsonl")]
    assert len(losses) > 3 and len(set(losses)) == 1, losses
