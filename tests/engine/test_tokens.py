"""Per-token losses (engine/tokens.py, the built-in LM step): ragged accumulation windows of
padded sequences train exactly as a loop that sums per-token losses over each window and divides
by its valid tokens; evaluation is the mean per token; val_ppl, tokens_per_s and mfu are logged."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ironloop
from ironloop.data.loader import TensorData
from ironloop.engine.step_fns import IGNORE_INDEX, lm_step
from ironloop.outputs.readers import read_jsonl

V, T = 10, 8


def padded(n: int, seed: int) -> TensorData:
    """Sequences of random length 1..T (the rest is padding, target -100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n, T), generator=g)
    y = (x + 1) % V
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    y[torch.arange(T)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return TensorData(x, y)


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, 16), nn.Linear(16, V)

    def forward(self, idx):
        return self.head(torch.tanh(self.embed(idx)))


def token_sum(model, x, y) -> tuple[torch.Tensor, int]:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum"), int((y != IGNORE_INDEX).sum())


def reference(model, data: TensorData, batch: int, accum: int, epochs: int, lr: float):
    """SGD where each step's loss is the sum of per-token losses over its window divided by
    the window's valid tokens (dataset order; the last window of an epoch is ragged)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(data), batch * accum):
            opt.zero_grad()
            total, count = 0.0, 0
            for s in range(start, min(start + batch * accum, len(data)), batch):
                loss, n = token_sum(model, data.x[s:s + batch], data.y[s:s + batch])
                total, count = total + loss, count + n
            (total / count).backward()
            opt.step()


def test_ragged_windows_of_padded_sequences_weigh_every_token_equally(tmp_path, capsys):
    train, val = padded(22, 0), padded(13, 1)  # 22 = 8 + 8 + 6: a ragged last window
    ours, ref = Bigram(), Bigram()
    result = ironloop.fit(ours, train, val, {
        "run.dir": str(tmp_path / "run"), "run.device": "cpu",  # where the reference runs
        "train.epochs": 3, "train.batch_size": 4,
        "train.accumulation_steps": 2, "train.step_fn": "lm", "data.shuffle": False,
        "optim.name": "sgd", "optim.lr": 0.5, "optim.momentum": 0.0,
        "optim.weight_decay": 0.0, "clip.max_norm": 0.0, "log.every_steps": 1,
        "log.progress": "off", "profile.peak_tflops": 1.0}, overwrite=True)
    reference(ref, train, batch=4, accum=2, epochs=3, lr=0.5)
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

    with torch.no_grad():
        total, count = token_sum(ours, val.x, val.y)  # the mean per token over the whole split
    val_loss = float(total) / count
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert evals[-1]["val_loss"] == pytest.approx(val_loss, rel=1e-6)
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(val_loss), rel=1e-6)  # lm: on
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows)
    n_params = sum(p.numel() for p in ours.parameters())
    assert rows[0]["mfu"] == pytest.approx(6 * n_params * rows[0]["tokens_per_s"] / 1e12)
    assert result.results["tokens"] == 3 * int((train.y != IGNORE_INDEX).sum())
    epochs = read_jsonl(tmp_path / "run" / "epochs.jsonl")
    assert epochs[0]["tokens_per_s"] > 0
    # the time table at the end gives the run's training throughput
    per_s = result.results["tokens_per_s"]
    assert per_s == pytest.approx(result.results["tokens"] / result.results["train_seconds"])
    assert f"  tokens/s (training, every process): {per_s:,.0f}\n" in capsys.readouterr().out


def test_a_mean_of_batch_means_would_differ():
    """The test above can fail: weighting each micro-batch by its samples gives other weights."""
    data = padded(8, 0)
    a, b = Bigram(), Bigram()
    (sum(token_sum(a, data.x[i:i + 4], data.y[i:i + 4])[0] for i in (0, 4))
     / int((data.y != IGNORE_INDEX).sum())).backward()
    means = [token_sum(b, data.x[i:i + 4], data.y[i:i + 4]) for i in (0, 4)]
    (sum(loss / n for loss, n in means) / 2).backward()
    assert not torch.allclose(a.head.weight.grad, b.head.weight.grad, rtol=1e-4)


def test_lm_step_weights_by_valid_tokens_and_survives_an_all_padding_batch():
    model = Bigram()
    x = torch.randint(0, V, (2, T))
    y = torch.full((2, T), IGNORE_INDEX)
    loss, _, weight = lm_step(model, (x, y))
    assert int(weight) == 0 and float(loss.detach()) == 0.0  # not NaN
    y[0, :3] = 1
    loss, _, weight = lm_step(model, (x, y))
    assert int(weight) == 3
    assert float(loss.detach()) == pytest.approx(float(token_sum(model, x, y)[0].detach()) / 3,
                                                 rel=1e-6)


def test_perplexity_for_a_user_step_is_opt_in(tmp_path):
    def step(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100), {}

    base = {"run.dir": str(tmp_path / "a"), "train.epochs": 1, "train.batch_size": 8,
            "log.progress": "off"}
    ironloop.fit(Bigram(), padded(16, 0), padded(8, 1), base, step_fn=step, overwrite=True)
    assert "val_ppl" not in read_jsonl(tmp_path / "a" / "evals.jsonl")[0]
    ironloop.fit(Bigram(), padded(16, 0), padded(8, 1),
                 {**base, "run.dir": str(tmp_path / "b"), "eval.perplexity": True},
                 step_fn=step, overwrite=True)
    row = read_jsonl(tmp_path / "b" / "evals.jsonl")[0]
    assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]))


TOKENS_PKG = '''
import torch
from torch import nn
from ironloop.data.loader import TensorData

V, T = 10, 8

def data(root):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (46, T), generator=g)
    y = (x + 1) % V
    lengths = torch.randint(1, T + 1, (46,), generator=g)
    y[torch.arange(T)[None, :] >= lengths[:, None]] = -100
    return TensorData(x[:38], y[:38]), TensorData(x[38:], y[38:])

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 16), nn.Tanh(), nn.Linear(16, V))
'''


@pytest.mark.slow
def test_two_ranks_weigh_tokens_as_one_process(tmp_path, monkeypatch):
    """Each rank's micro-batches hold different numbers of valid tokens: only the token count
    all-reduced over ranks gives one process's per-token gradient (38 = 4 windows of 8 + 6)."""
    from safetensors.torch import load_file

    from tests.e2e.test_distributed import train

    (tmp_path / "tokens_pkg.py").write_text(TOKENS_PKG)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    common = ["data.name=tokens_pkg:data", "model.name=tokens_pkg:model", "train.step_fn=lm",
              "train.epochs=2", "train.accumulation_steps=2", "optim.name=sgd", "optim.lr=0.5",
              "optim.momentum=0.0", "optim.weight_decay=0.0", "clip.max_norm=0.0",
              "doctor.preflight=false", "early_stop.metric=val_loss"]
    one = train(tmp_path / "one", *common, "train.batch_size=4")
    two = train(tmp_path / "two", *common, "train.batch_size=2", ranks=2)
    a, b = load_file(one / "final.safetensors"), load_file(two / "final.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    va = read_jsonl(one / "evals.jsonl")[-1]["val_loss"]
    vb = read_jsonl(two / "evals.jsonl")[-1]["val_loss"]
    assert va == pytest.approx(vb, rel=1e-6)


class OwnLoss(Bigram):
    """nanoGPT's shape: ``forward(idx, targets)`` returns (logits, loss), ignoring target -1."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def test_lm_step_weights_an_own_loss_model_by_its_targets_that_count_token_id_0_included():
    x = torch.randint(0, V, (2, T))
    y = torch.zeros(2, T, dtype=torch.long)  # token id 0 is a real token: it counts
    y[0, :3] = 1
    y[1, 5:] = -1  # nanoGPT's ignore index: it does not
    loss, _, weight = lm_step(OwnLoss(), (x, y))
    assert int(weight) == 2 * T - 3
    assert loss.ndim == 0


def test_a_windows_gradients_are_divided_by_its_summed_loss_weights():
    from ironloop.engine.tokens import WindowWeight, perplexity
    from ironloop.parallel.world import World

    one = World(rank=0, size=1)
    p, frozen = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([8.0, -4.0])
    window = WindowWeight()
    window.normalise([p], one)  # no weight yet: nothing to do
    assert p.grad.tolist() == [8.0, -4.0]
    window.add(torch.tensor(3.0))
    window.add(torch.tensor(5.0))
    window.normalise([frozen, p], one)  # a parameter without a gradient is passed over
    assert p.grad.tolist() == [1.0, -0.5] and window.total is None
    window.add(torch.tensor(0.0))  # an all-padding window: divided by at least 1
    window.normalise([p], one)
    assert p.grad.tolist() == [1.0, -0.5]
    window.add(torch.tensor(2.0))
    window.normalise([frozen], one)  # no gradient anywhere: the weights are still read
    assert window.total is None
    assert perplexity(0.0) == 1.0 and perplexity(709.0) == float("inf")
    assert perplexity(708.0) == math.exp(708.0)


def test_under_ddp_a_windows_gradients_are_scaled_by_the_world_over_every_ranks_weights(
        monkeypatch):
    """DDP averages the gradients over ranks, so each rank multiplies by world / W, W the
    window's weight summed over every rank (the all-reduce: here a stand-in for a second
    rank that had 24 units of its own)."""
    from ironloop.engine import tokens
    from ironloop.parallel.world import World

    reduced = []

    def other_rank_adds_24(total, world):
        reduced.append((total.item(), total.dtype, world.size))
        return total + 24

    monkeypatch.setattr(tokens, "all_reduce_sum", other_rank_adds_24)
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([8.0, -4.0])
    window = tokens.WindowWeight()
    window.add(torch.tensor(8.0))
    window.normalise([p], World(rank=1, size=2))
    assert reduced == [(8.0, torch.float64, 2)]  # summed in float64 on a CPU
    assert p.grad.tolist() == [0.5, -0.25]  # x 2 / (8 + 24)
