"""tools.lab.run in process, without training: each function fed a hand-made lab (its logs, notes
and checkpoints written by the test) and checked to the exact sentence, number or call it
produces. The real lab (tests/e2e/test_lab.py) runs its steps as processes, slowly; these tests
reach the same code fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ironloop.config import DataConfig
from ironloop.errors import UserError
from ironloop.tools.lab import clock as lab_clock, run
from ironloop.tools.lab.clock import Clock


def write(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture
def cpu_bf16(monkeypatch):
    """A machine with no CUDA whose CPU runs bf16 natively (fp16 is emulated): the plan's and the
    sentences' machine-dependent parts fixed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)


# -- run.py: the plan -----------------------------------------------------------------------------

@pytest.mark.parametrize("cuda, bf16, expected", [(False, False, "bf16"), (True, True, "bf16"),
                                                  (True, False, "fp16")])
def test_amp_uses_bf16_unless_a_gpu_lacks_it(monkeypatch, cuda, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert run.amp_precision() == expected


@pytest.mark.parametrize("cuda, native_bf16, emulated", [
    (False, True, {"fp16"}), (False, False, {"fp16", "bf16"}), (True, False, set())])
def test_a_cpu_emulates_fp16_and_bf16_without_native_instructions(monkeypatch, cuda, native_bf16,
                                                                  emulated):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    assert {p for p in ("fp32", "bf16", "fp16") if run.emulated(p)} == emulated


BASE = {"data.name": "digits", "model.name": "small_cnn", "model.kwargs": {}, "train.epochs": 5,
        "train.batch_size": 64, "optim.name": "adamw", "optim.lr": 1e-3,
        "schedule.name": "constant", "clip.max_norm": 0.0, "checkpoint.enabled": False,
        "early_stop.metric": "val_acc", "log.every_steps": 1, "log.progress": "off",
        "doctor.preflight": False}


def test_each_step_adds_one_thing_to_the_one_before(cpu_bf16):
    v = run.steps_plan("digits")
    assert [x.name for x in v] == ["1-baseline", "2-onecycle", "3-clip", "4-accum", "5-amp",
                                   "6-checkpoint", "7-crash-resume", "8-decay-all", "9-fp16"]
    assert v[0].overrides == {**BASE, "doctor.preflight": True}
    two = {**BASE, "schedule.name": "onecycle", "schedule.max_lr": 3e-3}
    assert v[1].overrides == two
    three = {**two, "clip.max_norm": 1.0}
    assert v[2].overrides == three
    four = {**three, "train.batch_size": 32, "train.accumulation_steps": 4}
    assert v[3].overrides == four
    five = {**four, "train.precision": "bf16"}
    assert v[4].overrides == five
    six = {**five, "checkpoint.enabled": True, "checkpoint.every_steps": 100}
    assert v[5].overrides == six and v[6].overrides == six
    assert v[7].overrides == {**six, "optim.decay_bias_and_norm": True}
    assert v[8].overrides == {**six, "train.precision": "fp16", "train.max_steps": 4}
    assert [x.title for x in v] == [
        "Baseline: AdamW, lr 1e-3, 5 epochs", "Scheduler: OneCycleLR, max_lr 3e-3",
        "Clipping at 1.0, pre-clip norm logged every step", "Accumulation: physical batch 32 x 4",
        "AMP: bf16 autocast", "Checkpointing: last every 100 steps, best on val acc",
        "Crash in epoch 3, then --resume", "Stretch: weight decay on biases and norms too",
        "Stretch: fp16 instead of bf16, 4 steps (emulated here)"]
    # each variant its own dict: changing one changes no other
    v[5].overrides["x"] = 1
    assert "x" not in v[6].overrides and "x" not in v[4].overrides
    assert all(x.run_dir == Path() and x.notes == {} for x in v)


def test_fashion_mnist_gets_the_narrow_cnn_and_other_data_its_own_model(cpu_bf16):
    assert run.steps_plan("fashion-mnist")[0].overrides["model.kwargs"] == {"channels": [4, 8]}
    assert run.steps_plan("mnist1d")[0].overrides["model.name"] == "cnn1d"
    assert run.steps_plan("synthetic")[0].overrides["model.name"] == "mlp"
    assert run.steps_plan("something-else")[0].overrides["model.name"] == "mlp"


def test_a_cpu_emulating_bf16_keeps_fp32_after_step_5(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    v = run.steps_plan("digits")
    assert v[4].overrides["train.precision"] == "bf16" and v[4].title == "AMP: bf16 autocast"
    for x in v[5:7]:
        assert x.overrides["train.precision"] == "fp32"
        assert x.title.endswith(" (fp32: this CPU emulates bf16)")
    assert v[7].overrides["train.precision"] == "fp32"
    assert v[7].title == "Stretch: weight decay on biases and norms too"
    assert v[8].overrides["train.precision"] == "fp16" and v[8].overrides["train.max_steps"] == 4


def test_on_a_gpu_without_bf16_the_stretch_runs_whole_bf16_epochs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    v = run.steps_plan("digits")
    assert v[4].overrides["train.precision"] == "fp16" and v[5].title.endswith("best on val acc")
    assert v[8].name == "9-bf16" and v[8].title == "Stretch: bf16 instead of fp16"
    assert v[8].overrides["train.precision"] == "bf16" and "train.max_steps" not in v[8].overrides


def test_a_steps_config_points_at_its_run_directory_and_the_data_root(tmp_path):
    cfg = run._cfg({"train.epochs": 3}, tmp_path / "run", "/some/data")
    assert cfg.run.dir == str(tmp_path / "run") and cfg.data.root == "/some/data"
    assert cfg.train.epochs == 3


def test_steps_per_epoch_counts_the_ragged_last_window(tmp_path):
    # digits: 1,438 training samples
    for batch, accum, expected in ((32, 4, 12), (64, 1, 23), (719, 2, 1), (1438, 1, 1)):
        cfg = run._cfg({"data.name": "digits", "train.batch_size": batch,
                        "train.accumulation_steps": accum}, tmp_path, "data")
        assert run.steps_per_epoch(cfg) == expected


# -- run.py: the hand-made lab --------------------------------------------------------------------

def fake_lab(tmp_path: Path) -> list[run.Variant]:
    """The nine variants with their logs: every variant 4 logged steps, 2 epochs of 2 steps;
    step 2's LR rises then falls; step 6 wrote its checkpoints; step 7 crashed after step 3 and
    resumed from step 2."""
    variants = run.steps_plan("digits")
    for i, v in enumerate(variants):
        v.run_dir = tmp_path / v.name
        lrs = [1e-4, 3e-3, 1e-3, 1e-5] if v.name == "2-onecycle" else [1e-3] * 4
        norms = [0.5, 3.0, 1.0, 2.0]
        write(v.run_dir / "metrics.jsonl",
              [{"step": s, "epoch": 1 + (s > 2), "lr": lrs[s - 1], "loss": 2.0 / s + i / 10,
                "grad_norm": norms[s - 1], "samples_per_s": 1000.0 * s, "time": float(s)}
               for s in range(1, 5)])
        write(v.run_dir / "epochs.jsonl",
              [{"epoch": e, "step": 2 * e, "seconds": 1.0 + e / 2 + i / 4,
                "samples_per_s": 1000.0 + 100 * i, "val_acc": 0.8 + e / 100}
               for e in (1, 2)])
        (v.run_dir / "results.json").write_text(json.dumps({"final_val_acc": 0.82, "steps": 4}))
    by = {v.name: v for v in variants}
    by["3-clip"].notes = {"clip": run.judge.clip_stats(by["3-clip"].metrics(), 1.0)}
    by["4-accum"].notes = {"expected_steps": 4, "full_window_diff": 2e-7,
                           "ragged_window_diff": 3e-6}
    from ironloop.state.io import save_atomic

    ckpts = by["6-checkpoint"].run_dir / "checkpoints"
    ckpts.mkdir()

    save_atomic({"model": {}, "optimizer": {}, "scheduler": {}, "scaler": None,
                 "progress": {"step": 4}, "rng": {}}, ckpts / "last.pt")
    save_atomic({"model": {}}, ckpts / "best.pt")
    (ckpts / "notes.txt").write_text("not a checkpoint")
    crash = by["7-crash-resume"]
    crash.notes = {"crash_step": 3, "resumed_from": 2, "bit_identical": True,
                   "steps_per_epoch": 2}
    write(crash.run_dir / "events.jsonl", [{"event": "start", "step": 0, "time": 0.0},
                                           {"event": "resume", "step": 1, "time": 2.5},
                                           {"event": "resume", "step": 2, "time": 3.0},
                                           {"event": "end", "step": 4, "time": 9.0}])
    return variants


def test_a_summary_row_reads_the_epochs_and_the_clipped_share(tmp_path):
    v = run.Variant("3-clip", "t", {"clip.max_norm": 1.0}, tmp_path)
    write(tmp_path / "epochs.jsonl", [
        {"step": 10, "seconds": 2.0, "samples_per_s": 100.0, "val_acc": 0.8},
        {"step": 20, "seconds": 4.0, "samples_per_s": 300.0, "val_acc": 0.85},
        {"step": 30, "seconds": 3.0, "samples_per_s": 200.0, "val_acc": 0.9}])
    write(tmp_path / "metrics.jsonl", [{"grad_norm": n} for n in (0.5, 2.0, 1.0, 3.0)])
    assert run.summary_row(v) == {"variant": "3-clip", "final val acc": 0.9, "s/epoch": 3.0,
                                  "s/epoch spread": (2.0, 4.0), "samples/s": 200.0,
                                  "optimizer steps": 30, "clipped": 0.5}
    v.overrides["clip.max_norm"] = 0.0  # clipping off: no share, even from logged counts
    write(tmp_path / "metrics.jsonl", [{"grad_norm": 2.0, "clipped": 1, "steps": 1}])
    assert run.summary_row(v)["clipped"] is None


def test_a_summary_row_without_an_epoch_gives_the_speed_after_the_warm_up_step(tmp_path):
    v = run.Variant("9-fp16", "t", {"clip.max_norm": 0.0}, tmp_path)
    (tmp_path / "epochs.jsonl").write_text("")
    write(tmp_path / "metrics.jsonl", [{"samples_per_s": s} for s in (10.0, 100.0, 300.0, 200.0)])
    (tmp_path / "results.json").write_text(json.dumps({"final_val_acc": 0.5, "steps": 4}))
    assert run.summary_row(v) == {"variant": "9-fp16", "final val acc": 0.5, "s/epoch": None,
                                  "s/epoch spread": None, "samples/s": 200.0,
                                  "optimizer steps": 4, "clipped": None}
    write(tmp_path / "metrics.jsonl", [{"samples_per_s": 7.0}])  # one step: it is all there is
    (tmp_path / "results.json").write_text(json.dumps({"steps": 1}))
    row = run.summary_row(v)
    assert row["samples/s"] == 7.0 and row["final val acc"] is None and row["optimizer steps"] == 1


def rows_for(variants: list[run.Variant]) -> list[dict]:
    """The summary rows findings() reads, chosen by hand."""
    acc = {"1-baseline": 0.9, "2-onecycle": 0.925, "3-clip": 0.93, "4-accum": 0.91, "5-amp": 0.915,
           "6-checkpoint": 0.92, "7-crash-resume": 0.92, "8-decay-all": 0.9125, "9-fp16": 0.5}
    speed = {"4-accum": 2000.0, "5-amp": 3000.0, "6-checkpoint": 2500.0, "9-fp16": 500.0}
    secs = {"4-accum": 1.25, "5-amp": 1.5, "6-checkpoint": 1.75}
    return [{"variant": v.name, "final val acc": acc[v.name], "samples/s": speed.get(v.name, 1.0),
             "s/epoch": secs.get(v.name, 9.0), "optimizer steps": 60 if v.name == "4-accum" else 4,
             "clipped": 0.25 if v.name == "3-clip" else None} for v in variants]


def test_every_finding_is_worded_from_what_the_runs_logged(tmp_path, cpu_bf16):
    variants = fake_lab(tmp_path)
    by = {v.name: v for v in variants}
    write(by["1-baseline"].run_dir / "epochs.jsonl", [{"seconds": 2.0}, {"seconds": 2.5}])
    by["4-accum"].notes["expected_steps"] = 61
    (by["9-fp16"].run_dir / "epochs.jsonl").write_text("")  # stopped inside its first epoch
    said = run.findings(variants, rows_for(variants), "2 cores")
    assert said == {
        "1-baseline": "val acc 90.00% after 5 epochs; epochs took 2.00, 2.50 s.",
        "2-onecycle": "the LR rose from 1.0e-04 to 3.0e-03 at step 2 of 4, then fell to 1.0e-05 "
                      "(lr.png); val acc 92.50% (+2.50%).",
        "3-clip": "25.0% of optimizer steps were clipped; median pre-clip norm 1.50, max 3.00 "
                  "(grad_norm_hist.png).",
        "4-accum": "60 optimizer steps for 61 expected (one per window of 4, ragged last window "
                   "included); one step of 32 x 4 against one batch of 128 differs by 2.0e-07, "
                   "and a ragged window of 32+32+32+4 against one batch of 100 by 3.0e-06: the "
                   "loss is scaled by sample counts, not by 1/4.",
        "5-amp": "throughput 3,000 samples/s vs 2,000 in fp32 (x1.50, 2 cores); val acc 91.50%. "
                 "On CPU, bf16 autocast often costs more in casts than it saves.",
        "6-checkpoint": "wrote best.pt, last.pt; median 1.75 s/epoch vs 1.50 without checkpoints "
                        "(step 5; 2 cores).",
        "7-crash-resume": "os._exit(1) right after step 3 (epoch 3), resumed from step 2; final "
                          "weights bit-identical to step 6's uninterrupted run "
                          "(resume_curve.png).",
        "8-decay-all": "val acc 91.25% vs 92.00% for step 6.",
        "9-fp16": "500 samples/s vs 2,500 for step 6 (x0.20, 2 cores); 4 steps only: a CPU "
                  "emulates fp16 autocast, and a whole run would take minutes to show the same "
                  "(on CUDA this step runs all 5 epochs).",
    }


def test_the_findings_flag_an_unscaled_loss_different_weights_and_compare_like_precisions(
        tmp_path, cpu_bf16, monkeypatch):
    variants = fake_lab(tmp_path)
    by = {v.name: v for v in variants}
    # the 1e-5 limit is strict, and the larger of the two differences counts
    by["4-accum"].notes.update(full_window_diff=1e-5, ragged_window_diff=1e-9)
    by["7-crash-resume"].notes["bit_identical"] = False
    by["6-checkpoint"].overrides["train.precision"] = "fp32"  # this CPU emulated step 5's bf16
    write(by["9-fp16"].run_dir / "epochs.jsonl", [{"val_acc": 0.7}, {"val_acc": 0.75}])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said = run.findings(variants, rows_for(variants), "8 cores")
    assert said["4-accum"].endswith("by 1.0e-09: THE LOSS IS NOT SCALED CORRECTLY.")
    assert said["5-amp"] == ("throughput 3,000 samples/s vs 2,000 in fp32 (x1.50, 8 cores); val "
                             "acc 91.50%.")
    assert said["6-checkpoint"] == ("wrote best.pt, last.pt; median 1.75 s/epoch vs 1.25 without "
                                    "checkpoints (step 4; 8 cores).")
    assert "final weights DIFFERENT to step 6's" in said["7-crash-resume"]
    assert said["9-fp16"] == ("500 samples/s vs 2,500 for step 6 (x0.20, 8 cores); val acc 50.00% "
                              "after 2 epoch(s).")
    by["4-accum"].notes.update(full_window_diff=1e-9, ragged_window_diff=2e-5)
    assert run.findings(variants, rows_for(variants), "8 cores")["4-accum"].endswith(
        "NOT SCALED CORRECTLY.")


def test_values_are_formatted_by_kind_and_a_missing_one_is_n_a():
    assert run._fmt(None, "pct") == "n/a"
    assert run._fmt(0.12345, "pct") == "12.35%"
    assert run._fmt(1.005, "s") == "1.00" and run._fmt(2.5, "s") == "2.50"
    assert run._fmt(12345.6, "int") == "12,346"
    assert run._fmt(0, "int") == "0"


def test_a_markdown_table_has_a_rule_and_escapes_pipes():
    assert run._md_table(["a", "b"], [["1", "x|y"], ["2", "3"]]) == [
        "| a | b |", "|---|---|", "| 1 | x/y |", "| 2 | 3 |"]


def test_the_summary_table_shows_a_stopped_variant_and_clipping_off():
    rows = [{"variant": "3-clip", "final val acc": 0.9, "s/epoch": 3.0,
             "s/epoch spread": (2.0, 4.5), "samples/s": 1234.4, "optimizer steps": 30,
             "clipped": 0.25},
            {"variant": "9-fp16", "final val acc": None, "s/epoch": None,
             "s/epoch spread": None, "samples/s": 99.5, "optimizer steps": 4, "clipped": None},
            {"variant": "3b", "final val acc": 0.5, "s/epoch": 1.0, "s/epoch spread": (1.0, 1.0),
             "samples/s": 1.0, "optimizer steps": 1, "clipped": 0.0}]
    header, table = run._summary_table(rows)
    assert header == ["variant", "final val acc", "s/epoch (min-max)", "samples/s",
                      "optimizer steps", "clipped fraction"]
    assert table == [["3-clip", "90.00%", "3.00 (2.00-4.50)", "1,234", "30", "25.00%"],
                     ["9-fp16", "n/a", "n/a (stopped mid-epoch)", "100", "4", "off"],
                     ["3b", "50.00%", "1.00 (1.00-1.00)", "1", "1", "0.00%"]]


def test_variants_whose_losses_coincide_are_named_once_each_group(tmp_path, cpu_bf16):
    variants = fake_lab(tmp_path)
    assert run._same_losses(variants) == ""  # every variant's loss differs (i / 10)
    for top, group in ((1.0, ("4-accum", "6-checkpoint", "7-crash-resume")),
                       (3.0, ("8-decay-all", "9-fp16"))):
        for name in group:
            write(tmp_path / name / "metrics.jsonl", [{"step": s, "loss": top / s}
                                                      for s in range(1, 5)])
    assert run._same_losses(variants) == (
        " The training losses of 4-accum, 6-checkpoint, 7-crash-resume coincide at every step: "
        "loss_curves.png draws them once. The training losses of 8-decay-all, 9-fp16 coincide at "
        "every step: loss_curves.png draws them once.")


def test_a_variant_without_an_epoch_coincides_on_step_6s_epoch_scale(tmp_path, cpu_bf16):
    variants = fake_lab(tmp_path)  # step 6 (variants[5]) logs 2 steps per epoch
    write(tmp_path / "7-crash-resume" / "epochs.jsonl", [{"step": 4}])  # 4 per epoch here
    (tmp_path / "9-fp16" / "epochs.jsonl").write_text("")
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 5)]
    for name in ("6-checkpoint", "9-fp16"):
        write(tmp_path / name / "metrics.jsonl", rows)
    assert run._same_losses(variants) == (
        " The training losses of 6-checkpoint, 9-fp16 coincide at every step: loss_curves.png "
        "draws them once.")


def test_same_weights_means_the_same_tensors_under_the_same_names(tmp_path):
    from safetensors.torch import save_file

    def final(name, tensors):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "final.safetensors")
        return tmp_path / name

    w = {"a": torch.ones(3), "b": torch.zeros(2)}
    a = final("a", w)
    assert run._same_weights(a, final("same", {k: t.clone() for k, t in w.items()}))
    assert not run._same_weights(a, final("changed", {**w, "b": torch.tensor([0.0, 1e-7])}))
    assert not run._same_weights(a, final("more", {**w, "c": torch.ones(1)}))


def test_draw_hands_each_plot_its_variants_logs(tmp_path, monkeypatch, cpu_bf16):
    variants = fake_lab(tmp_path)
    by = {v.name: v for v in variants}
    calls = {}

    def stub(name):
        def plot(*args, **kwargs):
            calls[name] = (args, kwargs)
            return Path(name)
        return plot

    for name in ("plot_lr", "plot_grad_norm_hist", "plot_resume_curve", "plot_loss_curves"):
        monkeypatch.setattr(run, name, stub(name))
    got = run.draw(variants, tmp_path / "out")
    assert got == {"lr.png": Path("plot_lr"), "grad_norm_hist.png": Path("plot_grad_norm_hist"),
                   "resume_curve.png": Path("plot_resume_curve"),
                   "loss_curves.png": Path("plot_loss_curves")}
    assert calls["plot_lr"] == (({"1-baseline (constant)": by["1-baseline"].metrics(),
                                  "2-onecycle": by["2-onecycle"].metrics()},
                                 tmp_path / "out" / "lr.png"), {})
    assert calls["plot_grad_norm_hist"] == ((by["3-clip"].metrics(), 1.0,
                                             tmp_path / "out" / "grad_norm_hist.png"), {})
    crash = by["7-crash-resume"]
    resumes = [{"event": "resume", "step": 1, "time": 2.5},
               {"event": "resume", "step": 2, "time": 3.0}]
    assert calls["plot_resume_curve"] == ((crash.metrics(), crash.epochs(),
                                           tmp_path / "out" / "resume_curve.png", resumes, 3), {})
    (curves, path), kwargs = calls["plot_loss_curves"]
    assert path == tmp_path / "out" / "loss_curves.png"
    assert kwargs == {"x": "epochs", "xlabel": "epochs of data seen",
                      "title": "Training loss, every lab variant"}
    assert list(curves) == [v.name for v in variants]
    assert [m["epochs"] for m in curves["1-baseline"]] == [0.5, 1.0, 1.5, 2.0]  # 2 steps/epoch


# -- run.py: the steps that train, their training stubbed -----------------------------------------

def fake_training(log: list):
    """A train_config that records each config and logs a run whose pre-clip norms are 2.0 in
    steady state (clipped at 1.0) and 0.5 under a higher threshold."""
    def train_config(cfg):
        log.append(cfg)
        out = Path(cfg.run.dir)
        clip = cfg.clip.max_norm
        write(out / "metrics.jsonl", [{"step": s, "epoch": 1 + (s > 2), "lr": 1e-3,
                                       "grad_norm": 2.0 if clip <= 1.0 else 0.5}
                                      for s in range(1, 41)])
        # three epochs: the comparison's accuracy is its last epoch's (seed 8's
        # clip_comparison_49 read the second)
        write(out / "epochs.jsonl", [{"epoch": 1, "val_acc": 0.5}, {"epoch": 2, "val_acc": 0.6},
                                     {"epoch": 3, "val_acc": 0.75}])
    return train_config


def test_clipping_that_fails_in_steady_state_is_rerun_at_the_suggested_threshold(
        tmp_path, monkeypatch, capsys, cpu_bf16):
    v = run.steps_plan("digits")[2]
    v.run_dir = tmp_path / v.name
    write(v.run_dir / "metrics.jsonl", [{"step": s, "epoch": 1 + (s > 2), "lr": 1e-3,
                                         "grad_norm": 1.23 if s % 2 else 0.5}
                                        for s in range(1, 41)])
    trained = []
    monkeypatch.setattr(run, "train_config", fake_training(trained))
    (c,) = run.clip_comparison(v, tmp_path, "/data")
    assert v.notes["clip"] == run.judge.clip_stats(v.metrics(), 1.0)
    assert (c.name, c.title, c.run_dir) == ("3b-clip-p95", "Comparison: step 3 with clipping at "
                                            "1.3", tmp_path / "3b-clip-p95")
    assert c.overrides == {**v.overrides, "clip.max_norm": 1.3}
    (cfg,) = trained
    assert (cfg.clip.max_norm, cfg.run.dir, cfg.data.root) == (1.3, str(c.run_dir), "/data")
    assert v.notes["compare"] == {**run.judge.clip_stats(c.metrics(), 1.3), "acc": 0.75}
    assert v.notes["compare"]["steady"] == 0.0
    assert capsys.readouterr().out == ("[lab] 3b-clip-p95: Comparison: step 3 with clipping at "
                                       "1.3\n")


@pytest.mark.parametrize("clipped, rerun", [(1, False), (2, True)])
def test_clipping_is_rerun_only_from_5_percent_of_steady_steps(tmp_path, monkeypatch, clipped,
                                                               rerun, cpu_bf16):
    v = run.steps_plan("digits")[2]
    v.run_dir = tmp_path / v.name
    # 2 first-epoch steps, 40 steady ones: 2 of 40 clipped is exactly 5%
    write(v.run_dir / "metrics.jsonl", [{"step": s, "epoch": 1 + (s > 2), "lr": 1e-3,
                                         "grad_norm": 2.0 if s > 42 - clipped else 0.5}
                                        for s in range(1, 43)])
    trained = []
    monkeypatch.setattr(run, "train_config", fake_training(trained))
    got = run.clip_comparison(v, tmp_path, "data")
    assert v.notes["clip"]["steady"] == clipped / 40
    assert (len(got), len(trained), "compare" in v.notes) == ((1, 1, True) if rerun
                                                              else (0, 0, False))


def stub_processes(monkeypatch, v, codes=(1, 0), stderr="boom"):
    started = []

    def process(argv, **kwargs):
        started.append((argv, kwargs))
        if "--resume" in argv:
            write(v.run_dir / "events.jsonl", [{"event": "resume", "step": 12},
                                               {"event": "other", "step": 99},
                                               {"event": "resume", "step": 24},
                                               {"event": "end", "step": 60}])
        return subprocess.CompletedProcess(argv, codes[len(started) - 1], "", stderr)

    monkeypatch.setattr(run.subprocess, "run", process)
    return started


def test_step_7_writes_its_config_and_runs_the_cli_twice(tmp_path, monkeypatch, cpu_bf16):
    v = run.steps_plan("digits")[6]
    v.run_dir = tmp_path / v.name
    started = stub_processes(monkeypatch, v)
    run.crash_and_resume(v, tmp_path, "/data")
    path = tmp_path / "7-crash-resume.yaml"
    cfg = run._cfg(v.overrides, v.run_dir, "/data")
    assert yaml.safe_load(path.read_text()) == cfg.to_dict()
    assert list(yaml.safe_load(path.read_text())) == list(cfg.to_dict())  # in the config's order
    cmd = [sys.executable, "-m", "ironloop", "train", str(path)]
    # digits: 1,438 samples in windows of 128: 12 per epoch, crash half way through epoch 3
    assert v.notes == {"crash_step": 30, "steps_per_epoch": 12, "resumed_from": 24}
    assert started == [([*cmd, "fault.crash_at_step=30"], {"capture_output": True, "text": True}),
                       ([*cmd, "--resume"], {"capture_output": True, "text": True})]


@pytest.mark.parametrize("codes, message", [
    ((0, 0), "the crash run should exit 1, got 0: "),
    ((2, 0), "the crash run should exit 1, got 2: "),
    ((1, 1), "the resumed run failed: ")])
def test_step_7_fails_loudly_when_a_process_does_not_do_its_part(tmp_path, monkeypatch, codes,
                                                                 message, cpu_bf16):
    v = run.steps_plan("digits")[6]
    v.run_dir = tmp_path / v.name
    stderr = "x" * 10 + "y" * 2000
    stub_processes(monkeypatch, v, codes, stderr)
    with pytest.raises(RuntimeError) as e:
        run.crash_and_resume(v, tmp_path, "data")
    assert str(e.value) == message + "y" * 2000


def test_the_lab_is_judged_with_the_reference_and_step_7s_checkpoint_arithmetic(tmp_path,
                                                                              cpu_bf16):
    """verdicts(): step 7 must resume from the later of its last epoch end and its last periodic
    checkpoint before the crash, and its first own step is the first logged after the resume
    event; the reference scripts are judged when they ran."""
    variants = fake_lab(tmp_path)
    by = {v.name: v for v in variants}
    crash = by["7-crash-resume"]
    crash.notes.update(crash_step=25, steps_per_epoch=10, resumed_from=20)
    by["6-checkpoint"].overrides["checkpoint.every_steps"] = 8  # 24 > 20: the periodic one
    # the last resume counts; the first line logged at or after it is the resumed process's
    write(crash.run_dir / "events.jsonl", [{"event": "resume", "step": 20, "time": 10.0},
                                           {"event": "other", "step": 0, "time": 200.0},
                                           {"event": "resume", "step": 24, "time": 100.0}])
    write(crash.run_dir / "metrics.jsonl",
          [{"step": s, "time": float(s)} for s in range(1, 26)]
          + [{"step": s, "time": 75.0 + s} for s in range(25, 30)])
    rows = rows_for(variants)
    judged, drop = run.verdicts(variants, rows, {"plain": {"val_acc": 0.92},
                                                 "accel": {"val_acc": 0.921}, "diff_lines": 12})
    assert [v.step for v in judged][-2:] == ["7-crash-resume", "reference"]
    resume = judged[-2]
    assert resume.figure.startswith("crashed after step 25, last checkpoint step 24, resumed "
                                    "from 20, first step after the resume 25;")
    assert judged[-1] == run.judge.reference({"val_acc": 0.92}, {"val_acc": 0.921}, 0.92, 12)
    assert judged[-1].passed
    lrs = [m["lr"] for m in by["3-clip"].metrics()]
    assert drop == run.judge.accumulation_drop(0.93, 0.91, lrs, lrs, 64, 128)
    assert judged[3] == run.judge.accumulation(60, by["4-accum"].notes)
    assert judged[4] == run.judge.amp(2000.0, 3000.0, 0.91, 0.915, "bf16", "cpu", None)
    assert judged[2] == run.judge.clipping(by["3-clip"].notes["clip"], 0.93, 0.925, None)
    assert judged[0] == run.judge.baseline(0.9, 10)
    # the epoch ends win when they are later
    by["6-checkpoint"].overrides["checkpoint.every_steps"] = 100
    crash.notes["resumed_from"] = 20
    judged, _ = run.verdicts(variants, rows, None)
    assert judged[-1].step == "7-crash-resume"
    assert "last checkpoint step 20, resumed from 20, first step after the resume 25" \
        in judged[-1].figure


def test_amp_is_judged_on_the_device_with_step_6s_scaler_and_clipping_with_its_rerun(
        tmp_path, monkeypatch, cpu_bf16):
    from ironloop.state.io import save_atomic

    variants = fake_lab(tmp_path)
    by = {v.name: v for v in variants}
    save_atomic({"model": {}, "optimizer": {}, "scheduler": {}, "scaler": {"scale": 2.0},
                 "progress": {"step": 4}, "rng": {}},
                by["6-checkpoint"].run_dir / "checkpoints" / "last.pt")
    compare = {"max_norm": 2.5, "steady": 0.01, "whole": 0.02, "acc": 0.93}
    by["3-clip"].notes["compare"] = compare
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    judged, _ = run.verdicts(variants, rows_for(variants), None)
    assert judged[4] == run.judge.amp(2000.0, 3000.0, 0.91, 0.915, "bf16", "cuda",
                                      {"scale": 2.0})
    assert judged[2] == run.judge.clipping(by["3-clip"].notes["clip"], 0.93, 0.925, compare)


def test_the_reports_hold_every_table_finding_and_plot(tmp_path, monkeypatch, cpu_bf16):
    variants = fake_lab(tmp_path)
    comparison = run.Variant("3b-clip-p95", "Comparison: step 3 with clipping at 2.5",
                             {**variants[2].overrides, "clip.max_norm": 2.5},
                             tmp_path / "3b-clip-p95")
    write(comparison.run_dir / "metrics.jsonl", [{"step": 1, "loss": 1.0, "grad_norm": 0.5,
                                                  "samples_per_s": 10.0}])
    write(comparison.run_dir / "epochs.jsonl", [{"step": 1, "seconds": 1.0, "samples_per_s": 10.0,
                                                 "val_acc": 0.875}])
    (tmp_path / "lr.png").write_bytes(b"PNG1")
    (tmp_path / "loss_curves.png").write_bytes(b"PNG2")
    plots = {"lr.png": tmp_path / "lr.png", "loss_curves.png": tmp_path / "loss_curves.png"}
    monkeypatch.setattr(lab_clock, "load", lambda: 1.0)
    monkeypatch.setattr(lab_clock.os, "cpu_count", lambda: 2)
    clock = Clock()
    clock.rows = [("1-baseline", 3.0, 2.5)]
    reference = {"plain": {"val_acc": 0.81}, "accel": None, "diff": "-a\n+b", "diff_lines": 2}
    said = {}
    real_findings = run.findings
    monkeypatch.setattr(run, "findings", lambda *a: said.update(real_findings(*a)) or said)
    got = run.write_reports(variants, [comparison], tmp_path, plots, "digits", reference, clock)
    assert got == tmp_path / "report.md"
    md = got.read_text().splitlines()
    under = "2 cores, load average 1.0-1.0 while it ran"
    intro = (f"Dataset `digits`, device cpu, torch {torch.__version__}. Each step keeps "
             f"everything before it and adds one thing; same seed and data throughout. Timings "
             f"were measured on {under}: on a shared machine they compare only within this "
             f"report.")
    assert md[:4] == ["# ironloop lab: digits", "", intro, ""]
    rows = [run.summary_row(v) for v in variants]
    header, table = run._summary_table([*rows[:3], run.summary_row(comparison), *rows[3:]])
    assert md[4:4 + 12] == run._md_table(header, table)
    assert table[3][0] == "3b-clip-p95" and len(table) == 10
    judged, drop = run.verdicts(variants, rows, reference)
    judged[4].figure += f" (speed measured on {under})"
    at = md.index("## Each step against the spec's criterion")
    assert md[at - 1:at + 2] == ["", "## Each step against the spec's criterion", ""]
    vtable = run._md_table(["step", "the spec's criterion", "result", "figure"],
                           [[v.step, v.criterion, v.result, v.figure] for v in judged])
    assert md[at + 2:at + 2 + len(vtable)] == vtable
    at += 2 + len(vtable)
    assert md[at:at + 5] == ["", f"**Step 4's accuracy:** {drop}", "", "## What each step showed",
                             ""]
    shown = [*variants[:3], comparison, *variants[3:]]
    said["3b-clip-p95"] = ("step 3 rerun with max_norm 2.5: val acc 87.50% (step 3: 82.00%).")
    assert md[at + 5:at + 15] == [f"- **{v.name}** ({v.title}): {said[v.name]}" for v in shown]
    at += 15
    ref = (f"`examples/production_loop.py` and `examples/production_loop_accelerate.py`, run with "
           f"step 6's config, initial weights and data order. {judged[-1].figure}. The line diff "
           f"(2 lines added or removed):")
    timing = (f"Wall and CPU seconds of each part of this lab ({under}). CPU seconds include "
              f"step 7's crash and resume processes.")
    assert md[at:] == [
        "", "## The hand-written script and its Accelerate version", "", ref, "", "```diff", "-a",
        "+b", "```", "", "## Where the lab's time went", "", timing, "",
        "| part | wall s | CPU s |", "|---|---|---|", "| 1-baseline | 3.0 | 2.5 |",
        "| total | 3.0 | 2.5 |", "",
        "Plots.", "", "![lr.png](lr.png)", "![loss_curves.png](loss_curves.png)"]
    page = (tmp_path / "report.html").read_text()
    from ironloop.tools.html import Page

    expected = Page("ironloop lab: digits").p(intro).table(header, table)
    expected.h2("Each step against the spec's criterion").table(
        ["step", "the spec's criterion", "result", "figure"],
        [[v.step, v.criterion, v.result, v.figure] for v in judged], "l", classed=2)
    expected.p(drop, bold="Step 4's accuracy:").h2("What each step showed")
    expected.items([(v.name, f"({v.title}): {said[v.name]}") for v in shown])
    expected.h2("The hand-written script and its Accelerate version").p(ref).pre("-a\n+b")
    expected.h2("Where the lab's time went").p(timing).table(*clock.table())
    expected.h2("Plots").p("Every variant's training loss differs.")
    expected.image(plots["lr.png"]).image(plots["loss_curves.png"])
    assert page == expected.render()


def test_the_reports_without_a_reference_say_which_losses_coincide(tmp_path, monkeypatch,
                                                                   cpu_bf16):
    variants = fake_lab(tmp_path)
    for name in ("6-checkpoint", "7-crash-resume"):
        write(tmp_path / name / "metrics.jsonl", [{"step": s, "loss": 1.0 / s, "lr": 1e-3,
                                                   "grad_norm": 0.5, "time": float(s),
                                                   "samples_per_s": 5.0} for s in range(1, 5)])
    run.write_reports(variants, [], tmp_path, {}, "digits", None, Clock())
    md = (tmp_path / "report.md").read_text()
    assert "hand-written script" not in md and "```diff" not in md
    same = (" The training losses of 6-checkpoint, 7-crash-resume coincide at every step: "
            "loss_curves.png draws them once.")
    assert md.endswith(f"\n\nPlots.{same}\n\n")
    page = (tmp_path / "report.html").read_text()
    assert f"<h2>Plots</h2><p>{same.strip()}</p></body>" in page
    assert "hand-written script" not in page and "<pre>" not in page


# -- run.py: run_lab, every step stubbed ----------------------------------------------------------

def test_run_lab_runs_every_step_in_order_then_the_checks_and_the_report(tmp_path, monkeypatch,
                                                                       capsys, cpu_bf16):
    out = tmp_path / "lab"
    log = []
    monkeypatch.setattr(run, "train_config",
                        lambda cfg: log.append(("train", Path(cfg.run.dir).name, cfg.data.root)))
    monkeypatch.setattr(run, "crash_and_resume",
                        lambda v, o, root: log.append(("crash", v.run_dir, o, root)))

    def clip(v, o, root):
        log.append(("clip", v.name, o, root))
        return ["extra"]

    monkeypatch.setattr(run, "clip_comparison", clip)

    def accumulation(v, o, root):
        log.append(("accum", v.name, o, root))
        return {"expected_steps": 7}

    monkeypatch.setattr(run, "accumulation_check", accumulation)
    monkeypatch.setattr(run, "_same_weights", lambda a, b: (a.name, b.name))
    monkeypatch.setattr(run.lab_reference, "available", lambda: True)

    def references(cfg, where):
        log.append(("reference", cfg.run.dir, cfg.train.accumulation_steps, where))
        return {"the": "reference"}

    monkeypatch.setattr(run.lab_reference, "run_references", references)
    monkeypatch.setattr(run, "draw", lambda variants, o: log.append(("draw", o)) or {"p": 1})

    def reports(variants, extras, o, plots, data, reference, clock):
        log.append(("report", [v.run_dir for v in variants], extras, o, plots, data, reference,
                    [r[0] for r in clock.rows]))
        assert variants[3].notes == {"expected_steps": 7}
        assert variants[6].notes == {"bit_identical": ("6-checkpoint", "7-crash-resume")}
        return o / "report.md"

    monkeypatch.setattr(run, "write_reports", reports)
    assert run.run_lab("digits", out, root="/data") == out / "report.md"
    names = [v.name for v in run.steps_plan("digits")]
    assert log == [("train", "1-baseline", "/data"), ("train", "2-onecycle", "/data"),
                   ("train", "3-clip", "/data"), ("clip", "3-clip", out, "/data"),
                   ("train", "4-accum", "/data"), ("train", "5-amp", "/data"),
                   ("train", "6-checkpoint", "/data"),
                   ("crash", out / "7-crash-resume", out, "/data"),
                   ("train", "8-decay-all", "/data"), ("train", "9-fp16", "/data"),
                   ("accum", "4-accum", out, "/data"),
                   ("reference", str(out / "reference"), 4, out / "reference"),
                   ("draw", out),
                   ("report", [out / n for n in names], ["extra"], out, {"p": 1}, "digits",
                    {"the": "reference"},
                    [*names[:3], "3b-clip-p95 (if clipping fails)", *names[3:],
                     "accumulation check", "reference scripts"])]  # the report's part is open
    printed = capsys.readouterr().out
    assert "[lab] 1-baseline: Baseline: AdamW, lr 1e-3, 5 epochs\n" in printed
    assert ("[lab] reference: examples/production_loop.py and its Accelerate version, with "
            "step 6's config\n") in printed


def test_run_lab_keeps_an_existing_report_unless_told_to_overwrite(tmp_path, monkeypatch,
                                                                   cpu_bf16):
    out = tmp_path / "lab"
    out.mkdir()
    (out / "report.md").write_text("old")
    with pytest.raises(UserError, match="already holds a lab report; pass --overwrite"):
        run.run_lab("digits", out)
    # what --overwrite clears: every variant's folder, step 7's config, the checks' folders
    cleared = ["1-baseline", "9-fp16", "accum-check", "3b-clip-p95", "reference"]
    for name in cleared:
        (out / name / "sub").mkdir(parents=True)
        (out / name / "sub" / "f").write_text("x")
    (out / "7-crash-resume.yaml").write_text("x")
    (out / "mine").mkdir()
    seen = {}

    def stop(cfg):
        seen.update({p.name: p.exists() for p in out.iterdir()})
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "train_config", stop)
    with pytest.raises(KeyboardInterrupt):
        run.run_lab("digits", out, overwrite=True)
    assert seen == {"report.md": True, "mine": True}
    assert sorted(p.name for p in out.iterdir()) == ["mine", "report.md"]


def test_run_lab_skips_the_reference_scripts_without_the_examples(tmp_path, monkeypatch,
                                                                  cpu_bf16):
    roots = set()
    monkeypatch.setattr(run, "train_config", lambda cfg: roots.add(cfg.data.root))
    for name in ("crash_and_resume", "_same_weights", "draw"):
        monkeypatch.setattr(run, name, lambda *a: {})
    monkeypatch.setattr(run, "clip_comparison", lambda *a: [])
    monkeypatch.setattr(run, "accumulation_check", lambda *a: {})
    monkeypatch.setattr(run.lab_reference, "available", lambda: False)
    monkeypatch.setattr(run.lab_reference, "run_references", lambda *a: pytest.fail("ran"))
    got = []
    monkeypatch.setattr(run, "write_reports", lambda *a: got.append(a[5]) or tmp_path)
    run.run_lab("digits", tmp_path / "new" / "lab")  # its parent folders made too
    assert got == [None] and (tmp_path / "new" / "lab").is_dir()
    assert roots == {DataConfig().root}  # no root given: data.root's own default
