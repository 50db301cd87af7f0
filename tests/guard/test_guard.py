"""The guard in fit(): integration, the CLI's exit code and the lagged verdict (its pure
decisions: test_decide.py; two gloo ranks and SIGKILL + --resume: tests/e2e/test_guard_ranks.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

import ironloop
from ironloop.cli import main
from ironloop.data.loader import EpochSampler, TensorData
from ironloop.engine import loop
from ironloop.engine.train_module import TrainModule
from ironloop.guard.decide import GuardPolicy
from ironloop.guard.reporter import GuardStop
from ironloop.state.io import load_verified
from ironloop.tools.report import summarize
from tests.conftest import REPO, blobs, cfg, tiny_mlp


def split(n: int = 256):
    """Train and validation sets of the same blobs (blobs' seed picks the centres)."""
    data = blobs(n=n + 64)
    return TensorData(data.x[:n], data.y[:n]), TensorData(data.x[n:], data.y[n:])


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- fit() integration -----------------------------------------------------------------------

def test_nan_at_step_is_skipped_logged_and_costs_one_window(tmp_path):
    result = ironloop.fit(tiny_mlp(), *split(),
                          cfg(tmp_path, fault__nan_at_step=3, train__epochs=3, optim__lr=1e-2),
                          overwrite=True)
    run_dir = tmp_path / "run"
    (line,) = rows(run_dir / "guard.jsonl")
    assert (line["step"], line["reason"], line["epoch"]) == (3, "nonfinite_loss", 1)
    sampler = EpochSampler(256, 32, seed=0, shuffle=True)
    assert line["samples"] == sampler.permutation()[64:96].tolist()  # the third window
    assert line["nonfinite_grads"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert line["inputs_nonfinite"] is False
    r = result.results
    assert (r["bad_steps"], r["rollbacks"], r["skipped_samples"]) == (1, 0, 0)
    assert r["steps"] == 3 * 8 - 1 and r["best_val_acc"] > 0.9
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 24))  # step 3 is logged once
    assert all(math.isfinite(m["loss"]) for m in metrics)  # the NaN stayed out of the means
    epochs = rows(run_dir / "epochs.jsonl")
    assert all(e["bad_steps"] == 1 for e in epochs)
    state = load_verified(run_dir / "checkpoints" / "last.pt")
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {23.0} and state["guard"]["bad_steps"] == 1


def test_a_bad_step_changes_no_parameter_optimizer_state_or_schedule(tmp_path, monkeypatch):
    seen = []
    step, after = TrainModule.optimizer_step, loop.after_step
    runs = []

    def snap(run):
        s = run.module
        return ({k: v.clone() for k, v in s.raw_model.state_dict().items()},
                json.dumps(str(s.optimizer.state_dict())), s.scheduler.last_epoch,
                run.progress.step, run.meter.steps)

    def spy_step(self, progress, meter, world, *closure):
        seen.append((snap(runs[0]), runs[0].guard.totals()["bad_steps"]))
        step(self, progress, meter, world, *closure)

    def spy_after(run, bar):
        after(run, bar)  # log.every_steps=1: every step settles here
        before, bad = seen.pop()
        if run.guard.totals()["bad_steps"] > bad:  # this attempt was bad: nothing may have changed
            now = snap(run)
            assert all(torch.equal(before[0][k], now[0][k]) for k in before[0])
            assert before[1:] == now[1:]
            seen.append(run.progress.step)

    def spy_epoch(run):
        runs[:] = [run]
        return train_epoch(run)

    train_epoch = loop.train_epoch
    monkeypatch.setattr(TrainModule, "optimizer_step", spy_step)
    monkeypatch.setattr(loop, "after_step", spy_after)
    monkeypatch.setattr(loop, "train_epoch", spy_epoch)
    ironloop.fit(tiny_mlp(), blobs(n=256), None,
                 cfg(tmp_path, fault__nan_at_step=[2, 5], schedule__name="cosine",
                     train__epochs=1), overwrite=True)
    assert seen == [1, 4]  # the two poisoned attempts, each skipped before counting


def test_fp16_with_a_nan_at_a_step_skips_it_and_finishes(tmp_path):
    """The skip path must undo GradScaler's unscale_ of the bad window: without that, the next
    window's unscale_ raises "unscale_() has already been called" and the run dies."""
    result = ironloop.fit(tiny_mlp(), *split(), cfg(tmp_path, train__epochs=1,
                                                    train__precision="fp16",
                                                    fault__nan_at_step=3), overwrite=True)
    run_dir = tmp_path / "run"
    (line,) = rows(run_dir / "guard.jsonl")
    assert (line["step"], line["reason"]) == (3, "nonfinite_loss")
    assert result.results["precision"] == "fp16"
    assert result.results["steps"] == 8 - 1 and result.results["bad_steps"] == 1
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 8))
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert sum(m["skipped"] for m in metrics) == 0  # the guard's skip, not GradScaler's
    scaler = load_verified(run_dir / "checkpoints" / "last.pt")["scaler"]
    assert scaler["scale"] == 2.0 ** 16  # a NaN loss says nothing about fp16 range: unchanged


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_inf_gradients_are_gradscalers_skip_under_fp16_and_a_guard_event_otherwise(
        tmp_path, precision):
    model = tiny_mlp()
    calls = []
    # The 3rd backward through the last layer overflows, as fp16 gradients do; the loss is fine.
    model[2].weight.register_hook(lambda g: g * math.inf if len(calls.append(1) or calls) == 3
                                  else g)
    result = ironloop.fit(model, *split(), cfg(tmp_path, train__epochs=1,
                                               train__precision=precision), overwrite=True)
    guard_lines = rows(tmp_path / "run" / "guard.jsonl")
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    if precision == "fp16":
        assert guard_lines == [] and result.results["bad_steps"] == 0
        assert sum(m["skipped"] for m in metrics) == 1 and len(metrics) == 8
    else:
        assert [(x["step"], x["reason"]) for x in guard_lines] == [(3, "nonfinite_grad")]
        assert guard_lines[0]["nonfinite_grads"] == ["2.weight"]
        assert result.results["bad_steps"] == 1 and len(metrics) == 7


def test_a_resume_drops_the_guard_lines_past_its_checkpoint_so_none_is_written_twice(tmp_path):
    # Each guard.jsonl line is numbered ("n"); the checkpoint holds the count, and a resume
    # keeps the lines up to it: the redone bad step at 5 is written once, as it was.
    conf = cfg(tmp_path, train__epochs=1, checkpoint__every_steps=3, checkpoint__keep_last=10,
               fault__nan_at_step=[2, 5])
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    ironloop.fit(tiny_mlp(), blobs(), None, conf,
                 resume=str(tmp_path / "run" / "checkpoints" / "step-00000003.pt"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "guard.jsonl").read_text().splitlines()]
    assert [(r.get("n"), r["step"]) for r in rows] == [(1, 2), (2, 5)]


def test_fault_crash_at_step_exits_the_process_with_status_1_right_after_that_step(
        monkeypatch):
    from ironloop.config import FaultConfig
    from ironloop.guard import faults

    def exit_now(status):  # os._exit would end pytest too: the status is what a lab reads
        raise SystemExit(status)

    monkeypatch.setattr(faults.os, "_exit", exit_now)
    knob = faults.Faults(FaultConfig(crash_at_step=3))
    knob.at_step(2)  # not yet
    with pytest.raises(SystemExit) as info:
        knob.at_step(3)
    assert info.value.code == 1


def test_fault_nan_sample_on_a_map_style_dataset_poisons_that_samples_input_only():
    from torch.utils.data import TensorDataset

    from ironloop.guard.faults import poison_sample

    x, y = torch.arange(12, dtype=torch.int64).reshape(4, 3), torch.arange(4)
    for data, inputs in [(TensorDataset(x, y), lambda s: s[0]), (x, lambda s: s)]:
        poisoned = poison_sample(data, 2)  # not ironloop's TensorData: wrapped, read per sample
        assert len(poisoned) == 4 and torch.isnan(inputs(poisoned[2])).all()
        assert inputs(poisoned[2]).shape == (3,)  # the input's own shape, not the target's
        assert all(torch.equal(inputs(poisoned[i]), inputs(data[i])) for i in (0, 1, 3))
        if isinstance(data, TensorDataset):
            assert int(poisoned[2][1]) == 2  # the target is left alone


@pytest.mark.parametrize("rollback_to", ["checkpoint", "memory"])
def test_nan_sample_is_left_out_alone_and_keeps_the_lr(tmp_path, rollback_to, capsys):
    """The bad step's inputs explain it: only that sample joins the skip list, the LR is not
    backed off (a rollback for the order's sake, not one of max_rollbacks=0's)."""
    order = EpochSampler(256, 32, seed=0, shuffle=True).permutation().tolist()
    bad = order[32 * 4 + 5]  # in the fifth window: the newest checkpoint is step 4
    result = ironloop.fit(tiny_mlp(), *split(),
                          cfg(tmp_path, fault__nan_sample=bad, guard__max_bad_steps=3,
                              guard__max_rollbacks=0, checkpoint__every_steps=2,
                              train__epochs=3, guard__rollback_to=rollback_to,
                              optim__lr=1e-2), overwrite=True)
    run_dir = tmp_path / "run"
    bad_line, rollback = rows(run_dir / "guard.jsonl")  # one bad step: never read again
    assert bad_line["step"] == 5 and bad_line["inputs_nonfinite"] is True
    assert bad_line["nonfinite_input_samples"] == [bad]
    assert (rollback["event"], rollback["from_step"], rollback["to_step"]) == ("rollback", 5, 4)
    assert rollback["source"] == {"checkpoint": "checkpoints/last.pt",
                                  "memory": "memory snapshot"}[rollback_to]
    assert rollback["cause"] == "nonfinite_inputs" and rollback["lr_factor"] == 1.0
    assert rollback["epoch"] == 1  # 1-based, as every log's epoch: step 4 ends in the first
    assert all(isinstance(row["time"], float) for row in (bad_line, rollback))  # wall time
    assert rollback["samples_added"] == [bad] and rollback["skipped_samples"] == 1
    assert [bad_line["n"], rollback["n"]] == [1, 2]  # numbered as written: a resume cuts at n
    state = load_verified(run_dir / "checkpoints" / "last.pt")
    assert state["guard"]["skip"] == [bad] and state["guard"]["lr_factor"] == 1.0
    assert (result.results["rollbacks"], result.results["skipped_samples"]) == (1, 1)
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))  # one timeline
    assert {m["lr"] for m in metrics} == {1e-2}  # the constant LR, not backed off
    assert result.results["steps"] == 3 * 8  # 255 samples left: 8 windows, the last short
    assert f"to leave out sample(s) [{bad}]" in capsys.readouterr().out
    summary = summarize(run_dir)  # what `ironloop report` shows
    assert "| bad steps | 1 |" in summary and "| skipped samples | 1 |" in summary


def rolled_back_in_epoch_2(tmp_path):
    """Bad steps 11 and 12 (first attempts only) roll back to the checkpoint of step 10."""
    return ironloop.fit(tiny_mlp(), *split(),
                        cfg(tmp_path, fault__nan_at_step=[11, 12], guard__max_bad_steps=2,
                            guard__max_rollbacks=1, checkpoint__every_steps=2,
                            train__epochs=3), overwrite=True)


def test_a_rollback_in_a_later_epoch_keeps_the_finished_epochs_lines(tmp_path):
    result = rolled_back_in_epoch_2(tmp_path)
    rollback = rows(tmp_path / "run" / "guard.jsonl")[-1]
    assert (rollback["event"], rollback["to_step"], rollback["epoch"]) == ("rollback", 10, 2)
    assert [e["epoch"] for e in rows(tmp_path / "run" / "epochs.jsonl")] == [1, 2, 3]
    assert result.results["steps"] == 8 + 6 + 6  # 64 samples skipped from the rollback on


def test_a_transient_fault_spent_before_a_rollback_to_its_step_does_not_fire_again(tmp_path):
    # the rollback goes back to step 10, where the faults at 11 and 12 had not yet fired:
    # their attempts were spent, so the run goes on clean instead of stopping the guard
    result = rolled_back_in_epoch_2(tmp_path)
    assert (result.results["bad_steps"], result.results["rollbacks"]) == (2, 1)
    assert [r["event"] for r in rows(tmp_path / "run" / "guard.jsonl")] == \
        ["bad_step", "bad_step", "rollback"]

def test_too_many_rollbacks_exit_3_with_the_message_and_loadable_checkpoints(tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    # guard.max_rollbacks=0: the first trigger, step 8's injected NaN, stops the run
    code = main(["train", "configs/digits.yaml", "model.name=mlp", "train.epochs=1",
                 "log.progress=off", "checkpoint.every_steps=5", "fault.nan_at_step=8",
                 "guard.max_bad_steps=1", "guard.max_rollbacks=0", f"run.dir={run_dir}"])
    assert code == 3
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert msg.startswith("ironloop: error: the guard stopped the run at step")
    for hint in ("nonfinite_loss", "guard.jsonl", "intact"):
        assert hint in msg
    assert f"every checkpoint in {run_dir / 'checkpoints'} is intact" in msg  # where they are
    lines = rows(run_dir / "guard.jsonl")
    assert [(x["event"], x["step"]) for x in lines] == [("bad_step", 8), ("stop", 8)]
    stop = lines[-1]
    assert (stop["rollbacks"], stop["bad_steps"]) == (0, 1)  # the record says how it ended
    assert stop["message"] == msg.removeprefix("ironloop: error: ")  # the same words
    assert "; recent bad steps: step 8 (nonfinite_loss). " in msg
    files = sorted((run_dir / "checkpoints").glob("*.pt"))
    assert files, "the run wrote checkpoints before it stopped"
    for f in files:
        assert load_verified(f)["progress"]["step"] < stop["step"]


def test_a_stop_for_an_injected_nan_names_the_fault_knob_not_the_learning_rate(tmp_path):
    with pytest.raises(GuardStop) as e:
        ironloop.fit(tiny_mlp(), *split(),
                     cfg(tmp_path, fault__nan_at_step=3, guard__max_bad_steps=1,
                         guard__max_rollbacks=0), overwrite=True)
    msg = str(e.value)
    assert "The bad steps were injected by fault.nan_at_step (a test knob): drop it" in msg
    assert "optim.lr" not in msg  # the model did nothing wrong: no LR to lower
    (bad, _) = rows(tmp_path / "run" / "guard.jsonl")
    assert bad["injected_at_step"] == 3


def test_a_stop_for_bad_input_data_names_its_samples_and_the_data_fix_not_the_lr(tmp_path):
    train, val = split()
    x = train.x.clone()
    x[:240] = float("nan")  # 16 good samples left: less than one batch of 32
    with pytest.raises(GuardStop) as e:
        ironloop.fit(tiny_mlp(), TensorData(x, train.y), val, cfg(tmp_path), overwrite=True)
    msg = str(e.value)
    assert "fewer than one batch is left" in msg
    lines = rows(tmp_path / "run" / "guard.jsonl")
    found = sorted(i for r in lines if r["event"] == "bad_step"
                   for i in r["nonfinite_input_samples"])
    assert found and max(found) < 240  # only NaN samples were left out
    shown = ", ".join(map(str, found[:10]))
    assert f"Fix or filter training sample(s) [{shown}, ... {len(found)} in all], whose " \
           f"inputs are NaN or inf" in msg
    assert "optim.lr" not in msg


# --- the lagged verdict (issue 20) -------------------------------------------------------------

def poisoned_calls(calls: set[int], detached: bool = False):
    """A step whose n-th training call (1-based) returns a NaN loss, whatever the step count:
    unlike fault.nan_at_step it does not make every step a settle point. ``detached`` adds the
    NaN as a term with no graph, so the gradients stay finite."""
    count = [0]

    def step(model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if model.training:
            count[0] += 1
            if count[0] in calls:
                loss = loss + torch.tensor(float("nan")) if detached else loss * float("nan")
        return loss, {}

    return step


@pytest.mark.parametrize("schedule,max_bad", [("constant", 3), ("cosine", 3), ("constant", 2)])
def test_verdicts_settled_at_log_steps_match_verdicts_settled_every_step(tmp_path, schedule,
                                                                          max_bad):
    """Bad steps found 1 step late (log every step) or up to 4 steps late (log every 5): the
    same events with the same step numbers, the same step count and schedule position, and with
    a constant LR the same weights bit for bit (a schedule runs ahead between a bad step and its
    settle, by design: engine/settle.py)."""
    results = {}
    for every in (1, 5):
        out = tmp_path / str(every)
        result = ironloop.fit(tiny_mlp(), blobs(n=256), None,
                              cfg(out, log__every_steps=every, train__epochs=2, optim__lr=1e-2,
                                  schedule__name=schedule, guard__max_bad_steps=max_bad,
                                  checkpoint__every_steps=2),
                              step_fn=poisoned_calls({3, 7, 8}), overwrite=True)
        events = [(x["step"], x.get("reason"), x.get("consecutive", x.get("to_step")))
                  for x in rows(out / "run" / "guard.jsonl")]
        state = load_verified(out / "run" / "checkpoints" / "last.pt")
        results[every] = (result, events, state)
    (r1, e1, s1), (r5, e5, s5) = results[1], results[5]
    bad = [(3, "nonfinite_loss", 1), (6, "nonfinite_loss", 1), (6, "nonfinite_loss", 2)]
    if max_bad == 2:  # the second bad step in a row rolls back to the checkpoint at step 4
        bad.append((6, None, 4))
    assert e1 == e5 == bad
    assert r1.results["steps"] == r5.results["steps"] == (16 - 3 if max_bad == 3 else 14 - 3)
    assert s1["progress"] == s5["progress"] and s1["guard"] == s5["guard"]
    if schedule == "cosine":
        assert s1["scheduler"]["last_epoch"] == s5["scheduler"]["last_epoch"] == 13
    else:
        assert all(torch.equal(s1["model"][k], s5["model"][k]) for k in s1["model"])
        assert s1["meter"]["samples"] == s5["meter"]["samples"]


def test_a_bad_step_settled_after_good_ones_is_reported_with_its_own_step_number(tmp_path):
    """Log every 5 steps and no checkpoint: steps 1-5 settle together at step 5, and the bad
    4th call, after 3 good steps, is step 4 in guard.jsonl (the steps before it count up)."""
    ironloop.fit(tiny_mlp(), blobs(n=256), None,
                 cfg(tmp_path, log__every_steps=5, train__epochs=1, checkpoint__enabled=False),
                 step_fn=poisoned_calls({4}), overwrite=True)
    assert [(x["event"], x["step"]) for x in rows(tmp_path / "run" / "guard.jsonl")] == \
        [("bad_step", 4)]


def test_device_spike_verdict_agrees_with_the_pure_guard_and_round_trips():
    """verdict.py computes the spike test on the device; its decisions and its statistics match
    the pure GuardPolicy's, step by step, on a noisy series with spikes and NaNs."""
    from types import SimpleNamespace

    from ironloop.guard.verdict import StepJudge

    world = SimpleNamespace(distributed=False)
    pure = GuardPolicy(max_bad_steps=100, spike_factor=4, spike_window=6, spike_warmup=3)
    device = StepJudge(torch.device("cpu"), torch.float64, 4, 6, 3)
    rng = random.Random(1)
    zero = torch.zeros((), dtype=torch.float64)
    for i in range(60):
        loss, norm = 1 + 0.1 * rng.random(), 2 + 0.1 * rng.random()
        if i % 11 == 10:
            loss *= 5
        if i % 17 == 16:
            norm = math.nan
        ok = device.verdict(torch.tensor(loss, dtype=torch.float64), zero,
                          torch.tensor(norm), 1, None, world)
        assert bool(ok) == (pure.observe(i, loss, norm) is None), i
    stats = device.state_dict()
    assert stats["good"] == pure.good
    assert stats["losses"] == pytest.approx(pure.losses, rel=1e-6)
    again = StepJudge(torch.device("cpu"), torch.float64, 4, 6, 3)
    again.load_state_dict(stats)
    assert again.state_dict() == stats


def test_an_fp16_overflow_on_two_devices_at_once_still_skips_the_fused_step():
    # GradScaler keeps one overflow flag per device; torch's fused kernels skip a step only when
    # found_inf is exactly 1, so the merged flag must not read 2.
    from ironloop.guard.verdict import masked_step

    class TwoDeviceScaler:  # the GradScaler parts masked_step uses, for a model on 2 GPUs
        _scale, _growth_tracker = torch.tensor(1024.0), torch.tensor(0)

        def _found_inf_per_device(self, optimizer):
            return {"cuda:0": torch.tensor(1.0), "cuda:1": torch.tensor(1.0)}

        def update(self):
            pass

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    masked_step(opt, TwoDeviceScaler(), torch.tensor(True), torch.tensor(0.0))
    assert torch.equal(p.detach(), torch.ones(3))


def test_a_loaded_verdict_keeps_its_spike_statistics_on_the_guards_device():
    # "meta" stands in for CUDA: a counter left on the CPU could not index the device's ring.
    from ironloop.guard.verdict import StepJudge

    verdict = StepJudge(torch.device("meta"), torch.float64, 4, 6, 3)
    verdict.load_state_dict({"losses": [1.0, 1.1], "norms": [2.0, 2.1], "good": 5})
    assert {t.device.type for t in (verdict.ring, verdict.filled, verdict.good)} == {"meta"}


def test_the_guards_state_round_trips_its_device_spike_statistics_and_none_loads_fresh(
        tmp_path):
    from types import SimpleNamespace

    from ironloop.config import Config
    from ironloop.guard.reporter import GuardReporter
    from ironloop.guard.verdict import device_verdicts

    conf = Config().with_overrides(["guard.spike_factor=4", "guard.spike_window=6",
                                    "guard.spike_warmup=0"]).guard

    def reporter() -> GuardReporter:
        verdicts = device_verdicts(conf, torch.device("cpu"), torch.float64)
        return GuardReporter(conf, tmp_path, verdicts, False, 1, "")

    fresh, judged = reporter().state_dict(), reporter()
    zero, world = torch.zeros((), dtype=torch.float64), SimpleNamespace(distributed=False)
    for loss in (1.0, 1.1, 0.9, 1.05):
        judged.verdicts.judge.verdict(torch.tensor(loss, dtype=torch.float64), zero,
                                    torch.tensor(2.0), 1, None, world)
    state = judged.state_dict()
    assert state["losses"] == pytest.approx([1.0, 1.1, 0.9, 1.05]) and state["good"] == 4
    resumed = reporter()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    resumed.load_state_dict(None)  # a checkpoint without guard state
    assert resumed.state_dict() == fresh

def _verdict_and_guard(factor: float, window: int, warmup: int):
    from types import SimpleNamespace

    from ironloop.guard.verdict import StepJudge

    world = SimpleNamespace(distributed=False)
    device = StepJudge(torch.device("cpu"), torch.float64, factor, window, warmup)
    zero = torch.zeros((), dtype=torch.float64)

    def judge(loss: float, norm: float) -> bool:
        ok = device.verdict(torch.tensor(loss, dtype=torch.float64), zero,
                          torch.tensor(norm, dtype=torch.float64), 1, None, world)
        return bool(ok)  # host read: a test

    return GuardPolicy(max_bad_steps=100, spike_factor=factor, spike_window=window,
                 spike_warmup=warmup), device, judge


def test_a_flat_history_floors_sigma_at_one_percent_of_the_median_on_both_guards():
    """With a constant loss the MAD is 0: only the floor (1% of the median) keeps a rise of
    a fraction of a percent from being called a spike, on the device and in the reference."""
    pure, _, judge = _verdict_and_guard(factor=3, window=5, warmup=0)
    for i in range(5):
        assert judge(2.0, 1.0) and pure.observe(i, 2.0, 1.0) is None
    # 2.0 + 3 x 1% x 2.0 = 2.06: 2.04 is noise (a 0.1% floor would call it a spike: 2.006)
    assert judge(2.04, 1.0) and pure.observe(5, 2.04, 1.0) is None
    assert judge(2.0, 1.02) and pure.observe(6, 2.0, 1.02) is None  # norms: 1.03
    assert not judge(2.1, 1.0) and pure.observe(7, 2.1, 1.0) == "spike"
    assert not judge(2.0, 1.05) and pure.observe(8, 2.0, 1.05) == "spike"


def test_the_device_verdict_keeps_the_reference_window_at_every_step_around_warm_up():
    """Compared after every step from 1 to warm-up + window + 2: the same good-step count,
    the same window (the first ``spike_warmup`` good steps left out), the same decisions."""
    warmup, window = 4, 3
    pure, device, judge = _verdict_and_guard(factor=5, window=window, warmup=warmup)
    for i in range(warmup + window + 3):
        loss, norm = 1 + 0.01 * i, 2 - 0.01 * i  # every step's values told apart
        assert judge(loss, norm) == (pure.observe(i, loss, norm) is None), i
        state = device.state_dict()
        assert state["good"] == pure.good == i + 1
        assert state["losses"] == pytest.approx(pure.losses, abs=1e-12), i
        assert state["norms"] == pytest.approx(pure.norms, abs=1e-12), i
        assert len(pure.losses) == min(max(i + 1 - warmup, 0), window)


def test_a_nonfinite_loss_with_finite_gradients_is_skipped_and_reported(tmp_path):
    """A detached non-finite term (a logged auxiliary, a NaN constant) leaves every gradient
    finite: the verdict must still read the loss, skip the step and keep the NaN out of the
    logged means."""
    result = ironloop.fit(tiny_mlp(), *split(), cfg(tmp_path, train__epochs=1),
                          step_fn=poisoned_calls({3}, detached=True), overwrite=True)
    run_dir = tmp_path / "run"
    (line,) = rows(run_dir / "guard.jsonl")
    assert (line["step"], line["reason"]) == (3, "nonfinite_loss")
    assert line["nonfinite_grads"] == []
    assert result.results["bad_steps"] == 1 and result.results["steps"] == 7
    assert all(math.isfinite(m["loss"]) for m in rows(run_dir / "metrics.jsonl"))
    state = load_verified(run_dir / "checkpoints" / "last.pt")
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {7.0}


def test_the_spike_threshold_is_median_plus_factor_robust_sigmas_and_equal_is_no_spike():
    """History 1..5: median 3, MAD 1, sigma 1.4826 (the normal's MAD scale): factor 1 puts the
    threshold at 4.4826; a value exactly at a threshold is not above it."""
    for factor, below, above in ((1, 4.48, 4.49), (3, 3 + 3 * 1.4826, 7.46)):
        for loss, verdict in ((below, None), (above, "spike")):
            pure, _, judge = _verdict_and_guard(factor=factor, window=5, warmup=0)
            for i, v in enumerate([1.0, 2.0, 3.0, 4.0, 5.0]):
                assert judge(v, 1.0) and pure.observe(i, v, 1.0) is None
            assert judge(loss, 1.0) == (verdict is None), (factor, loss)
            assert pure.observe(5, loss, 1.0) == verdict, (factor, loss)


def test_a_state_dict_is_a_snapshot_that_later_steps_do_not_change():
    """The memory rollback keeps a state_dict while training goes on: a bad step after it
    must not reach into it."""
    g = GuardPolicy(max_bad_steps=5)
    g.observe(1, math.nan, 1.0, lambda: [1, 2])
    saved = g.state_dict()
    g.observe(2, math.nan, 1.0, lambda: [3, 4])
    assert saved["pending"] == [[1, 2]] and saved["consecutive"] == 1


def test_a_bad_verdict_read_before_the_optimizer_step_makes_the_loop_settle_at_once():
    from ironloop.config import GuardConfig
    from ironloop.guard.verdict import device_verdicts

    verdicts = device_verdicts(GuardConfig(), torch.device("cpu"), torch.float32)
    assert verdicts.allows(torch.tensor(True)) and not verdicts.eager
    assert not verdicts.allows(torch.tensor(False))
    assert verdicts.eager  # the bad step is settled (reverted, reported) before the next


def test_the_fused_optimizers_found_inf_flag_is_float32_whatever_the_default_dtype():
    # torch's fused kernels read found_inf as float32: a float64 default must not change it
    from ironloop.guard.verdict import StepJudge

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        judge = StepJudge(torch.device("cpu"), torch.float64)
        flags = judge.found_inf(torch.tensor([True, False]))
    finally:
        torch.set_default_dtype(before)
    assert flags.dtype == torch.float32 and flags.tolist() == [0.0, 1.0]


def test_a_rollback_keeps_the_spike_statistics_the_guard_had_learnt(tmp_path):
    """The run's state comes back from the checkpoint, the guard's own knowledge does not: the
    device's good-step count and spike window carry on across the rollback."""
    result = ironloop.fit(tiny_mlp(), *split(),
                          cfg(tmp_path, fault__nan_at_step=[5], guard__max_bad_steps=1,
                              guard__spike_factor=1000, guard__spike_window=3,
                              guard__spike_warmup=0, checkpoint__every_steps=2,
                              train__epochs=1), overwrite=True)
    assert (result.results["rollbacks"], result.results["steps"]) == (1, 7)
    guard = load_verified(tmp_path / "run" / "checkpoints" / "last.pt")["guard"]
    # steps 1-4, then 5-7 after the rollback to step 4: 7 good steps in all (3 after it alone)
    assert guard["good"] == 7 and len(guard["losses"]) == len(guard["norms"]) == 3


def test_a_sharded_models_rollback_before_any_checkpoint_stops_at_that_step_and_says_why(
        tmp_path, monkeypatch):
    # FSDP2 keeps no in-memory snapshot: with no checkpoint yet there is nothing to roll back
    # to (e2e/test_guard_fsdp.py rolls back to a .dcp on two real ranks). The checkpointer
    # says whether the model is sharded, for the guard too.
    from ironloop.guard import reporter
    from ironloop.state import checkpointer

    monkeypatch.setattr(checkpointer, "is_fsdp", lambda model: True)
    with pytest.raises(reporter.GuardStop, match=r"^the guard stopped the run at step 3: no "
                                                 r"checkpoint to roll back to \(under "
                                                 r"dist.strategy=fsdp the guard rolls back only "
                                                 r"to checkpoints"):
        ironloop.fit(tiny_mlp(), *split(), cfg(tmp_path, fault__nan_at_step=[3],
                                               guard__max_bad_steps=1, train__epochs=1),
                     overwrite=True)
    assert [(r["event"], r["step"]) for r in rows(tmp_path / "run" / "guard.jsonl")] == \
        [("bad_step", 3), ("stop", 3)]


def test_fault_nan_sample_zero_poisons_the_first_sample():
    from torch.utils.data import TensorDataset

    from ironloop.guard.faults import poison_sample

    poisoned = poison_sample(TensorDataset(torch.ones(3, 2), torch.arange(3)), 0)
    assert torch.isnan(poisoned[0][0]).all() and not torch.isnan(poisoned[1][0]).any()


def test_under_ddp_a_bad_steps_reported_loss_is_its_window_loss_summed_over_the_ranks(
        tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from ironloop.config import Config
    from ironloop.guard import reporter as rep
    from ironloop.guard.verdict import Pending, device_verdicts

    conf = Config().guard
    guard = rep.GuardReporter(conf, tmp_path, device_verdicts(conf, torch.device("cpu"),
                                                              torch.float64), False, 1, "")
    # two ranks, the other one with the same window loss: the all-reduce doubles it
    monkeypatch.setattr(rep, "all_reduce_sum", lambda t, world: t * 2)
    f64 = torch.float64
    d = guard.verdicts
    d.pending = [Pending(torch.tensor(False), torch.tensor(10.0, dtype=f64),
                         torch.tensor(4.0, dtype=f64), torch.tensor(3.0))]
    d.offsets, d.samples = [0, 8], [0, 4]
    meter = SimpleNamespace(loss_sum=torch.zeros((), dtype=f64), forget=lambda n, k: None)
    data = SimpleNamespace(global_batch=8, indices=lambda a, b: list(range(a, b)),
                           nonfinite_inputs=lambda s: [])
    world = SimpleNamespace(distributed=True, is_main=True)
    guard._settle_bad([0], meter, SimpleNamespace(step=1, epoch=0, offset=8), data,
                      torch.nn.Linear(1, 1), world, None)
    assert capsys.readouterr().out == (  # loss (6 + 6) / 8 samples
        "warning: guard: step 1 skipped (spike: loss 1.5, grad_norm 3.0); 1 bad in a row, "
        "8 samples listed in guard.jsonl\n")
