"""The loop's contract: order of operations, exact accumulation, eval mode, early stopping,
scheduler cadence, precision and label checks.

Then the loop's exact outputs, in process on a tiny model: what each step hands on_step_end,
the cadence of metrics.jsonl and evals.jsonl, the end of a max_steps run, a preemption's
events line, and the error a missing early_stop.metric gives."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader

import ironloop
from ironloop.callbacks import Callback
from ironloop.data.loader import EpochSampler, TensorData
from ironloop.engine import evaluate as evaluate_module, loop
from ironloop.engine.preempt import Preempted
from ironloop.errors import ConfigError, DataError
from ironloop.outputs.readers import read_jsonl
from tests.conftest import blobs, cfg, tiny_mlp


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- order of operations ------------------------------------------------------------------

def test_order_of_operations_with_fp16_scaler_and_accumulation(tmp_path, monkeypatch):
    calls: list[str] = []

    def spy(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            calls.append(label)
            return original(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    spy(torch.optim.Optimizer, "zero_grad", "zero_grad")
    spy(torch.optim.AdamW, "step", "step")
    spy(torch.amp.GradScaler, "unscale_", "unscale")
    spy(torch.amp.GradScaler, "update", "scaler_update")
    spy(nn.utils, "clip_grads_with_norm_", "clip")  # after the guard saw the norm
    spy(lr_scheduler.OneCycleLR, "step", "scheduler")

    model = tiny_mlp()
    model.register_forward_hook(lambda *a: calls.append("forward"))
    for p in model.parameters():
        p.register_hook(lambda g: calls.append("backward") or g)

    def loss_fn(out, y):
        calls.append("loss")
        assert torch.is_autocast_enabled("cpu"), "the loss must be computed under autocast"
        return nn.functional.cross_entropy(out.float(), y)

    calls.clear()
    ironloop.fit(model, blobs(n=96), None, cfg(tmp_path, train__epochs=1, train__batch_size=16,
                                               train__accumulation_steps=3,
                                               train__precision="fp16",
                                               schedule__name="onecycle"), loss_fn=loss_fn)
    # collapse the per-parameter backward hooks into one "backward" per micro-batch
    seq = [c for i, c in enumerate(calls) if not (c == "backward" and calls[i - 1] == "backward")]
    seq = seq[seq.index("zero_grad"):]  # OneCycleLR's constructor steps once; skip set-up
    micro = ["forward", "loss", "backward"]
    window = ["zero_grad", *micro * 3, "unscale", "clip", "step", "scaler_update", "scheduler"]
    assert seq == window * 2  # 96 samples / (16 x 3) = 2 optimizer steps


# --- exact accumulation: ironloop against a hand-written loop -------------------------------

def _optimizer(name: str):
    """One torch optimizer, built the same way for fit() (as a factory) and the hand loop."""
    def make(params):
        params = list(params)
        if name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    return make


def _hand_loop(data, optim: str, epochs: int, window: int, micro: int | None = None) -> dict:
    """Plain torch, no ironloop arithmetic: windows of ``window`` samples in EpochSampler's
    order (the order is ironloop's contract; the sums are what is checked), cross-entropy,
    clip at 1.0, step. ``micro`` splits each window into micro-batches weighted 1/N, the
    classic accumulation bug that gets a ragged last window wrong."""
    model = tiny_mlp()
    opt = _optimizer(optim)(model.parameters())
    for epoch in range(epochs):
        sampler = EpochSampler(len(data), 1, seed=0, shuffle=True)
        sampler.set_epoch(epoch)
        order = sampler.permutation()
        for start in range(0, len(data), window):
            idx = order[start:start + window]
            opt.zero_grad()
            if micro is None:  # one forward over the whole window: its exact mean gradient
                nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
            else:
                for part in idx.split(micro):
                    loss = nn.functional.cross_entropy(model(data.x[part]), data.y[part])
                    (loss / (window // micro)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model.state_dict()


def _ironloop_accumulated(tmp_path, optim: str) -> dict:
    model = tiny_mlp()
    ironloop.fit(model, blobs(n=200), None,
                 cfg(tmp_path, train__epochs=3, train__batch_size=16,
                     train__accumulation_steps=4),
                 optimizer=_optimizer(optim))
    return model.state_dict()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_accumulation_matches_a_hand_written_big_batch_loop_including_ragged_window(tmp_path,
                                                                                    optim):
    # 200 samples: windows of 64 end with a ragged window of 8 samples in every epoch.
    mine = _ironloop_accumulated(tmp_path, optim)
    big = _hand_loop(blobs(n=200), optim, epochs=3, window=64)
    start = tiny_mlp().state_dict()
    assert any(not torch.allclose(big[k], start[k], atol=1e-2) for k in big)  # it trained
    for k in big:
        torch.testing.assert_close(mine[k], big[k], rtol=1e-5, atol=1e-6)


def test_accumulation_is_not_the_naive_one_over_n_weighting(tmp_path):
    """The check above is sensitive: 1/N weighting of the ragged window lands elsewhere."""
    mine = _ironloop_accumulated(tmp_path, "sgd")
    naive = _hand_loop(blobs(n=200), "sgd", epochs=3, window=64, micro=16)
    assert max(float((mine[k] - naive[k]).abs().max()) for k in mine) > 1e-4


def test_optimizer_steps_per_epoch_count_windows(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(n=200), None,
                 cfg(tmp_path, train__batch_size=16, train__accumulation_steps=4))
    epochs = read(tmp_path / "run" / "epochs.jsonl")
    assert [e["step"] for e in epochs] == [4, 8]  # ceil(200 / 64) = 4 per epoch


def test_gradients_sync_over_ranks_only_on_each_windows_last_micro_batch(tmp_path, monkeypatch):
    # DDP/FSDP: every micro-batch but a window's last skips the all-reduce (no_sync); the
    # last one, the ragged window's too, syncs the window's accumulated gradients.
    from ironloop.parallel import data_parallel

    syncs: list = []
    original = data_parallel.micro_sync

    def recorded(model, last):
        syncs.append(last)
        return original(model, last)

    monkeypatch.setattr(data_parallel, "micro_sync", recorded)
    # 80 samples in micro-batches of 16, windows of 2: [16, 16], [16, 16], [16] (ragged)
    ironloop.fit(tiny_mlp(), blobs(n=80), None,
                 cfg(tmp_path, train__epochs=1, train__batch_size=16,
                     train__accumulation_steps=2))
    assert syncs == [False, True, False, True, True]


# --- validation ---------------------------------------------------------------------------

def test_validation_runs_in_eval_mode_and_matches_a_hand_computed_loss(tmp_path):
    model = tiny_mlp(dropout=0.5)
    seen_modes = []

    def step(m, batch):
        seen_modes.append(m.training)
        out = m(batch[0])
        return nn.functional.cross_entropy(out, batch[1]), {}

    val = blobs(n=64, seed=1)
    ironloop.fit(model, blobs(n=64), val, cfg(tmp_path, train__epochs=1), step_fn=step)
    assert model.training, "a model handed over in train mode comes back in train mode"
    assert seen_modes == [True, True, False, False]  # 2 training batches, then 2 val batches
    logged = read(tmp_path / "run" / "epochs.jsonl")[0]["val_loss"]
    with torch.no_grad():
        model.eval()
        by_hand = float(nn.functional.cross_entropy(model(val.x), val.y))
        model.train()
        torch.manual_seed(0)
        with_dropout = float(nn.functional.cross_entropy(model(val.x), val.y))
    assert logged == pytest.approx(by_hand, rel=1e-5)
    assert abs(with_dropout - by_hand) > 1e-3  # train mode would have logged another loss


def _mode_recorder(seen: list):
    """A step that records (model.training, evaluation?) for every call."""
    def step(m, batch):
        seen.append((m.training, torch.is_inference_mode_enabled()))
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}
    return step


def test_a_model_handed_over_in_eval_mode_trains_in_train_mode_and_comes_back_in_eval_mode(
        tmp_path):
    model = tiny_mlp(dropout=0.5).eval()
    seen = []
    res = ironloop.fit(model, blobs(n=64), blobs(n=32, seed=1), cfg(tmp_path, train__epochs=2),
                       step_fn=_mode_recorder(seen))
    training = [mode for mode, evaluating in seen if not evaluating]
    evaluating = [mode for mode, evaluating in seen if evaluating]
    assert training == [True] * 4 and evaluating == [False] * 2  # 2 epochs of 2 + 1 batches
    assert res.model is model
    assert not any(m.training for m in model.modules()), "handed over in eval, returned in eval"


def test_the_mode_comes_back_when_a_training_step_raises(tmp_path):
    model = tiny_mlp(dropout=0.5).eval()
    calls = []

    def step(m, batch):
        calls.append(m.training)
        if len(calls) == 2:
            raise RuntimeError("the user's step failed")
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}

    with pytest.raises(RuntimeError, match="the user's step failed"):
        ironloop.fit(model, blobs(n=64), None, cfg(tmp_path), step_fn=step)
    assert calls == [True, True]
    assert not any(m.training for m in model.modules()), "the finally gives eval mode back"


def test_evaluation_gives_the_mode_back_when_its_step_raises(tmp_path, monkeypatch):
    """evaluate() itself restores the mode it found (train, mid-run) in a finally; the
    run's own finally would hide that, so its mode is read as the exception leaves it."""
    modes_at_exit = []
    real = evaluate_module.evaluate

    def watched(run, dataset, *split):
        try:
            return real(run, dataset, *split)
        finally:
            modes_at_exit.append([m.training for m in run.module.raw_model.modules()])

    monkeypatch.setattr(evaluate_module, "evaluate", watched)

    def step(m, batch):
        if not m.training:
            raise ValueError("evaluation failed")
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}

    model = tiny_mlp(dropout=0.5)
    with pytest.raises(ValueError, match="evaluation failed"):
        ironloop.fit(model, blobs(n=64), blobs(n=32, seed=1), cfg(tmp_path), step_fn=step)
    assert len(modes_at_exit) == 1 and all(modes_at_exit[0])
    assert model.training


def test_early_stopping_restores_best_weights(tmp_path):
    train, val = blobs(n=128), blobs(n=64, seed=1)
    val = type(val)(val.x, (val.y + 1) % 3)  # val disagrees with train: val loss worsens
    model = tiny_mlp()
    res = ironloop.fit(model, train, val, cfg(tmp_path, train__epochs=20, early_stop__patience=2,
                                              checkpoint__keep_last=0, optim__lr=0.01))
    epochs = read(tmp_path / "run" / "epochs.jsonl")
    assert res.results["stopped_early"] and res.results["restored_best"]
    assert len(epochs) < 20
    best_epoch = min(epochs, key=lambda e: e["val_loss"])["epoch"]
    assert res.results["best_epoch"] == best_epoch
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)["model"]
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, best[k])
    assert any(not torch.equal(best[k], last[k]) for k in best)
    from safetensors.torch import load_file

    final = load_file(tmp_path / "run" / "final.safetensors")
    assert all(torch.equal(final[k], best[k]) for k in best)


# --- scheduler cadence --------------------------------------------------------------------

def test_onecycle_rises_then_falls_once_per_optimizer_step(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(n=200), None,
                 cfg(tmp_path, train__epochs=4, train__batch_size=16,
                     train__accumulation_steps=2, schedule__name="onecycle",
                     schedule__max_lr=0.01))
    rows = read(tmp_path / "run" / "metrics.jsonl")
    lrs = [r["lr"] for r in rows]
    steps = len(rows)
    assert steps == 4 * 7  # ceil(200 / 32) = 7 optimizer steps per epoch
    # every line is stamped with its wall-clock time (run-files.md), in order
    assert all(isinstance(r["time"], float) for r in rows)
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)
    peak = lrs.index(max(lrs))
    assert 0 < peak < steps - 1
    assert all(a <= b for a, b in itertools.pairwise(lrs[:peak + 1]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[peak:]))
    # the LR logged for step k is exactly the one torch's OneCycleLR gives step k
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    ref = lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=steps, pct_start=0.3)
    expected = []
    for _ in range(steps):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_plateau_steps_once_per_epoch_with_the_monitored_metric(tmp_path, monkeypatch):
    got = []
    original = lr_scheduler.ReduceLROnPlateau.step

    def spy(self, metrics, *a, **k):
        got.append(metrics)
        return original(self, metrics, *a, **k)

    monkeypatch.setattr(lr_scheduler.ReduceLROnPlateau, "step", spy)
    ironloop.fit(tiny_mlp(), blobs(n=128), blobs(n=64, seed=1),
                 cfg(tmp_path, train__epochs=4, early_stop__metric="val_acc",
                     schedule__name="plateau"))
    epochs = read(tmp_path / "run" / "epochs.jsonl")
    assert got == [e["val_acc"] for e in epochs]


def test_plateau_without_validation_data_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="plateau.*val_fraction"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path, schedule__name="plateau"))


def test_warmup_cosine_warms_up_then_decays(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(n=320), None,
                 cfg(tmp_path, train__epochs=2, schedule__name="warmup_cosine",
                     schedule__warmup_steps=5, optim__lr=0.01))
    lrs = [r["lr"] for r in read(tmp_path / "run" / "metrics.jsonl")]
    # step k (1-based) uses the LR set after k-1 scheduler steps: the peak is step 6
    assert lrs[0] == pytest.approx(0.01 * 0.01) and lrs[5] == pytest.approx(0.01)
    assert all(a < b for a, b in itertools.pairwise(lrs[:6]))
    assert all(a > b for a, b in itertools.pairwise(lrs[5:])) and lrs[-1] < 0.01 * 0.05


# --- clipping -----------------------------------------------------------------------------

def test_clipped_counts_reach_the_log(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path, clip__max_norm=1e-3))
    rows = read(tmp_path / "run" / "metrics.jsonl")
    assert all(r["clipped"] == 1 and r["grad_norm"] > 1e-3 for r in rows)


# --- precision ----------------------------------------------------------------------------

def test_bf16_on_cpu_autocasts_without_a_scaler(tmp_path):
    dtypes = []

    def step(m, batch):
        out = m(batch[0])
        dtypes.append(out.dtype)
        return nn.functional.cross_entropy(out.float(), batch[1]), {}

    res = ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path, train__precision="bf16"),
                       step_fn=step)
    assert set(dtypes) == {torch.bfloat16}
    assert res.results["precision"] == "bf16"
    epochs = read(tmp_path / "run" / "epochs.jsonl")
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]


def test_auto_precision_is_fp32_on_cpu(tmp_path):
    res = ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path, train__precision="auto"))
    assert res.results["precision"] == "fp32"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_mixed_precision_trains(tmp_path, precision):
    # Validation from the same blobs (another seed draws other centres: chance accuracy), and
    # an LR that learns them in 48 steps (at 1e-3 the CPU's fp32 reaches 42%, as CUDA's did).
    data = blobs(n=640)
    train, val = TensorData(data.x[:512], data.y[:512]), TensorData(data.x[512:], data.y[512:])
    res = ironloop.fit(tiny_mlp(), train, val,
                       cfg(tmp_path, run__device="cuda", train__precision=precision,
                           train__epochs=3, optim__lr=0.01))
    assert res.results["precision"] == precision
    assert res.results["best_val_acc"] > 0.8
    assert next(res.model.parameters()).device.type == "cuda"


# --- labels -------------------------------------------------------------------------------

def test_labels_outside_range_are_a_clear_error(tmp_path):
    data = blobs()
    bad = type(data)(data.x, data.y.clone())
    bad.y[7] = 3  # the model has 3 outputs: labels must be in [0, 3)
    with pytest.raises(DataError, match=r"\[0, 3\)"):
        ironloop.fit(tiny_mlp(), bad, None, cfg(tmp_path))


def test_labels_checked_per_batch_for_plain_datasets(tmp_path):
    data = blobs()
    items = [(data.x[i], int(data.y[i]) if i != 50 else -1) for i in range(len(data))]

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return items[i][0], torch.tensor(items[i][1])

    with pytest.raises(DataError, match="found a batch with labels"):
        ironloop.fit(tiny_mlp(), Plain(), None, cfg(tmp_path))


def test_labels_of_a_plain_validation_dataset_are_checked_per_batch_too(tmp_path):
    data = blobs(n=64)

    class Plain(torch.utils.data.Dataset):
        def __init__(self, bad: int | None):
            self.bad = bad

        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return data.x[i], torch.tensor(5 if i == self.bad else int(data.y[i]))

    with pytest.raises(DataError, match=r"labels must be class indices in \[0, 3\), found a "
                                        r"batch with labels in \[0, 5\]"):
        ironloop.fit(tiny_mlp(), Plain(None), Plain(40), cfg(tmp_path, train__epochs=1))


@pytest.mark.parametrize("plain", [False, True], ids=["tensors", "plain-dataset"])
def test_the_passed_dataloaders_batch_size_is_used(tmp_path, plain):
    # 100 samples at the loader's 10: 10 steps an epoch; train.batch_size=32 would give 4, and
    # the default 64 would give 2.
    data = blobs(n=100)
    if plain:  # a Dataset ironloop cannot slice: batches come from the loader's collate_fn
        data = [(data.x[i], data.y[i]) for i in range(len(data))]
    loader = torch.utils.data.DataLoader(data, batch_size=10, shuffle=True)
    sizes = []

    def step(m, batch):
        sizes.append(len(batch[1]))
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}

    res = ironloop.fit(tiny_mlp(), loader, None, cfg(tmp_path, train__epochs=1), step_fn=step)
    assert res.results["steps"] == 10
    assert sizes == [10] * 10


def test_tensorboard_events_are_written(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path, log__tensorboard=True))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "metrics/loss" in tags and "epochs/val_acc" in tags
    assert [e.step for e in acc.Scalars("epochs/val_acc")] == [7, 14]


def test_a_branch_unused_after_its_first_step_is_not_moved_by_adamw_again(tmp_path):
    """zero_grad(set_to_none=True): a parameter with no gradient in a window has grad None,
    so AdamW leaves it alone. A zeroed gradient would still move it (momentum, weight decay)."""
    calls = [0]

    def step(m, batch):
        x, y = batch
        out = m["trunk"](x)
        calls[0] += 1
        if calls[0] == 1:  # the branch takes part in the first step only
            out = out + m["branch"](x)
        return nn.functional.cross_entropy(out, y), {}

    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({"trunk": nn.Linear(8, 3), "branch": nn.Linear(8, 3)})

    def trained(steps: int) -> nn.Module:
        calls[0] = 0
        m = model()
        ironloop.fit(m, blobs(n=128), None,
                     cfg(tmp_path / str(steps), train__epochs=1, train__batch_size=16,
                         train__max_steps=steps, optim__name="adamw",
                         optim__weight_decay=0.1), step_fn=step)
        return m

    first, fourth, untrained = trained(1), trained(4), model()
    for k, v in first["branch"].state_dict().items():
        assert not torch.equal(v, untrained["branch"].state_dict()[k])  # step 1 moved it
        assert torch.equal(fourth["branch"].state_dict()[k], v), k  # steps 2-4 did not
    assert not torch.equal(first["trunk"].weight, fourth["trunk"].weight)


def _micro_run(world: int, accum: int, weight):
    """The parts of a run micro_step touches: a step returning loss 3 (and ``weight``); the
    backward records what it was given."""
    import contextlib
    from types import SimpleNamespace

    backward: list = []
    module = SimpleNamespace(
        model=nn.Linear(2, 2), autocast=contextlib.nullcontext,
        forward=lambda model, batch, kind, progress: (torch.tensor(3.0), {}, weight),
        backward=backward.append)
    run = SimpleNamespace(
        module=module, world=SimpleNamespace(size=world), progress=None,
        cfg=ironloop.Config().with_overrides({"train.accumulation_steps": accum}),
        outputs=SimpleNamespace(timer=SimpleNamespace(mark=lambda part: None)),
        meter=SimpleNamespace(add_micro=lambda loss, n, w: None))
    return run, backward


@pytest.mark.parametrize("world, n_micro, window, scale", [
    (1, 4, 4, 1.0), (1, 3, 12, 0.25), (2, 4, 4, 2.0), (2, 4, 8, 1.0), (4, 2, 16, 0.5)])
def test_a_micro_batch_s_loss_is_scaled_by_its_samples_times_ranks_over_the_window(
        world, n_micro, window, scale):
    """DDP averages gradients over ranks: a rank's share of a window of ``window`` samples is
    n_micro * world / window, whatever it comes to (2.0 included)."""
    from ironloop.engine.loop import micro_step
    from ironloop.engine.tokens import WindowWeight

    run, backward = _micro_run(world, 1, None)
    weights = WindowWeight()
    loss = micro_step(run, None, n_micro, window, True, weights)
    assert float(loss) == 3.0 and [float(b) for b in backward] == [3.0 * scale]
    assert weights.total is None  # a step without weights adds none


def test_a_weighted_micro_batch_gives_its_sum_and_adds_its_weight_to_the_window():
    from ironloop.engine.loop import micro_step
    from ironloop.engine.tokens import WindowWeight

    weights = WindowWeight()
    for world, accum in ((1, 2), (2, 1)):
        run, backward = _micro_run(world, accum, torch.tensor(5))
        micro_step(run, None, 4, 8, False, weights)
        assert [float(b) for b in backward] == [15.0]  # loss x weight, divided later
    assert int(weights.total) == 10
    run, backward = _micro_run(1, 1, torch.tensor(5))  # one micro-batch, one rank: the mean
    micro_step(run, None, 4, 4, True, weights)
    assert [float(b) for b in backward] == [3.0] and int(weights.total) == 10


class Rows(Callback):
    """Records what each hook gets."""

    def __init__(self):
        self.steps: list[dict] = []
        self.saves: list[dict] = []

    def on_step_end(self, run, metrics: dict) -> None:
        self.steps.append(dict(metrics))

    def on_checkpoint(self, run, metrics: dict) -> None:
        self.saves.append(dict(metrics))


def test_a_step_that_does_not_log_hands_on_step_end_only_its_step_and_1_based_epoch(tmp_path):
    rows = Rows()
    # 64 samples in batches of 16: 4 steps an epoch, 2 epochs; a log line every 3rd step
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__batch_size=16, log__every_steps=3), callbacks=[rows])
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in logged] == [(3, 1), (6, 2)]
    quiet = [r for r in rows.steps if r["step"] % 3]
    assert quiet == [{"step": 1, "epoch": 1}, {"step": 2, "epoch": 1},
                     {"step": 4, "epoch": 1}, {"step": 5, "epoch": 2},
                     {"step": 7, "epoch": 2}, {"step": 8, "epoch": 2}]
    # a log step hands on_step_end the metrics.jsonl line itself
    assert [r for r in rows.steps if r["step"] % 3 == 0] == logged


def test_a_log_line_holds_the_step_s_loss_lr_and_time(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__epochs=1, train__batch_size=32, optim__lr=0.02))
    first, second = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert (first["step"], first["epoch"], second["step"], second["epoch"]) == (1, 1, 2, 1)
    assert first["lr"] == second["lr"] == 0.02  # the default schedule is constant
    assert first["loss"] > 0 and isinstance(first["time"], float)
    assert first["time"] <= second["time"]


def test_a_max_steps_run_without_validation_saves_where_it_stopped(tmp_path):
    rows = Rows()
    ironloop.fit(tiny_mlp(), blobs(200), None, cfg(tmp_path, train__max_steps=3),
                 callbacks=[rows])
    assert [s["step"] for s in rows.saves] == [3]


def test_a_max_steps_run_that_just_saved_at_its_last_step_saves_it_once(tmp_path):
    rows = Rows()
    ironloop.fit(tiny_mlp(), blobs(200), None,
                 cfg(tmp_path, train__max_steps=4, checkpoint__every_steps=2), callbacks=[rows])
    assert [s["step"] for s in rows.saves] == [2, 4]


def test_a_max_steps_run_evaluates_its_final_weights_once_and_says_so(tmp_path, capsys):
    rows = Rows()
    ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1), cfg(tmp_path, train__max_steps=3),
                 callbacks=[rows])
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [(e["step"], e["epoch"]) for e in evals] == [(3, 1)]
    assert "final evaluation at step 3/3 (epoch 1): val_loss" in capsys.readouterr().out
    assert [s["step"] for s in rows.saves] == [3]


def test_a_max_steps_run_evaluated_at_its_last_step_is_not_evaluated_again(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(200), blobs(64, seed=1),
                 cfg(tmp_path, train__max_steps=4, eval__every_steps=2))
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert [e["step"] for e in evals] == [2, 4]
    out = capsys.readouterr().out
    assert "eval at step 4/4 (epoch 1)" in out and "final evaluation" not in out


def test_a_monitored_metric_a_user_s_step_does_not_report_names_the_ones_it_does(tmp_path):
    def step(m, batch):  # a user's step: its metric names are known at its first evaluation
        loss = nn.functional.cross_entropy(m(batch[0]), batch[1])
        return loss, {"top1": loss.detach() * 0}

    with pytest.raises(ConfigError) as e:
        ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                     cfg(tmp_path, train__epochs=1, early_stop__metric="val_f1"), step_fn=step)
    assert str(e.value) == ("early_stop.metric='val_f1': this run reports val_loss, val_top1; "
                            "monitor one of those")


# --- a preemption, on a stand-in run ---------------------------------------------------------

def _preempting_run(enabled: bool, manager, saved_by_cadence: bool):
    """A run at step 5 of epoch index 1 that a signal stopped: what loop._preempted reads."""
    written, saves = [], []
    run = SimpleNamespace(
        hooks=SimpleNamespace(preempt=SimpleNamespace(
            saving=lambda: None,
            stopped=lambda step, saved: Preempted("SIGTERM", step, saved))),
        progress=SimpleNamespace(step=5, epoch=1),
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(enabled=enabled)),
        settle=lambda: False,
        cadence=SimpleNamespace(saves=lambda step: saved_by_cadence),
        save=saves.append,
        outputs=SimpleNamespace(checkpoints=manager,
                                write=lambda name, row: written.append((name, row))))
    return run, written, saves


class Manager:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


def test_a_preempted_step_is_saved_waited_for_and_recorded_in_events(monkeypatch):
    monkeypatch.setattr(loop.time, "time", lambda: 1234.5)
    manager = Manager()
    run, written, saves = _preempting_run(True, manager, saved_by_cadence=False)
    with pytest.raises(Preempted):
        loop._preempted(run)
    assert saves == [False] and manager.waited == 1
    assert written == [("events", {"event": "preempted", "signal": "SIGTERM", "step": 5,
                                   "epoch": 2, "saved": True, "time": 1234.5})]


def test_a_rank_without_a_checkpoint_manager_is_preempted_without_waiting_on_one():
    # under DDP only rank 0 writes checkpoints: the others have no manager
    run, written, saves = _preempting_run(True, None, saved_by_cadence=True)
    with pytest.raises(Preempted):
        loop._preempted(run)
    assert saves == [] and written[0][1]["saved"] is True


def test_a_run_without_checkpoints_is_preempted_unsaved():
    run, written, saves = _preempting_run(False, None, saved_by_cadence=False)
    with pytest.raises(Preempted):
        loop._preempted(run)
    assert saves == [] and written[0][1]["saved"] is False


# --- validation sets ---------------------------------------------------------------------

def _eval_batch_sizes(seen: list):
    """A step that records the size of every batch it evaluates."""
    def step(m, batch):
        if not m.training:
            seen.append(len(batch[1]))
        return nn.functional.cross_entropy(m(batch[0]), batch[1]), {}
    return step


def test_a_validation_dataloader_keeps_its_own_batch_size_in_every_evaluation(tmp_path):
    seen: list[int] = []
    val = DataLoader(blobs(25, seed=1), batch_size=10)
    ironloop.fit(tiny_mlp(), blobs(64), val, cfg(tmp_path, train__epochs=1),
                 step_fn=_eval_batch_sizes(seen))
    assert seen == [10, 10, 5]  # not train.batch_size's 32


def test_named_validation_sets_are_each_batched_as_given(tmp_path):
    seen: list[int] = []
    val = {"a": DataLoader(blobs(25, seed=1), batch_size=10), "b": blobs(40, seed=2)}
    ironloop.fit(tiny_mlp(), blobs(64), val, cfg(tmp_path, train__epochs=1),
                 step_fn=_eval_batch_sizes(seen))
    assert seen == [10, 10, 5, 32, 8]
    row = read_jsonl(tmp_path / "run" / "evals.jsonl")[0]
    assert [k for k in row if k.startswith("val_")] == ["val_a_loss", "val_b_loss"]


def test_an_epoch_line_carries_the_guard_s_totals_once_a_step_was_bad(tmp_path):
    # 64 samples in batches of 16: steps 1-4 are epoch 1, 5-8 epoch 2; step 6's loss is NaN
    ironloop.fit(tiny_mlp(), blobs(64), None,
                 cfg(tmp_path, train__batch_size=16, fault__nan_at_step=[6]))
    first, second = read_jsonl(tmp_path / "run" / "epochs.jsonl")
    assert "bad_steps" not in first  # no news yet
    assert (second["bad_steps"], second["rollbacks"]) == (1, 0)


def test_a_patience_of_1_stops_at_the_first_worse_evaluation_and_restores_the_best(tmp_path):
    train, val = blobs(128), blobs(64, seed=1)
    val = type(val)(val.x, (val.y + 1) % 3)  # val disagrees with train: val loss worsens
    model = tiny_mlp()
    result = ironloop.fit(model, train, val, cfg(tmp_path, train__epochs=20, optim__lr=0.01,
                                                 early_stop__patience=1))
    epochs = read_jsonl(tmp_path / "run" / "epochs.jsonl")
    assert result.results["stopped_early"] and result.results["restored_best"]
    assert epochs[-1]["val_loss"] > epochs[-2]["val_loss"]  # one worse evaluation ended it
    best = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)["model"]
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())
