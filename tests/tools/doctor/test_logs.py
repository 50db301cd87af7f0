"""tools.doctor.logs: the findings read from a finished run's logs (a flat loss, overfitting,
clipping, throughput, averaged weights), at both sides of every threshold."""

from __future__ import annotations

import json
import math

from ironloop.tools.doctor import logs
from ironloop.tools.doctor.findings import Finding, info

# -- after the run: the logs -----------------------------------------------------------------------

def epochs(*rows, key="train_loss"):
    return [{"epoch": i + 1, key: v} for i, v in enumerate(rows)]


def test_a_training_loss_less_than_five_percent_lower_after_epoch_one_is_flat():
    from ironloop.outputs.numbers import number

    (f,) = logs.flat_loss(epochs(1.0, 0.96, 0.95), [])
    assert f.severity == "warning" and f.measured == (
        f"the training loss is flat: {number(1.0)} in the first epoch, at best {number(0.95)} "
        f"over the next 2 (less than 5% lower)")
    assert logs.flat_loss(epochs(1.0, 0.9499), []) == []
    assert logs.flat_loss(epochs(0.0, 0.0), []) == []
    assert logs.flat_loss(epochs(-1.0, -1.0), []) == []


def test_within_one_epoch_the_flat_loss_reads_five_or_more_log_windows():
    windows = [{"step": i, "loss": 1.0} for i in range(1, 6)]
    (f,) = logs.flat_loss(epochs(1.0), windows)
    assert "in the first log window" in f.measured and "over the next 4" in f.measured
    assert logs.flat_loss(epochs(1.0), windows[:4]) == []
    assert logs.flat_loss([], [*windows[:4], {"step": 5, "loss": None}]) == []


def test_validation_loss_five_percent_above_its_minimum_two_epochs_on_is_overfitting():
    from ironloop.outputs.numbers import number

    rows = [{"epoch": 1, "train_loss": 1.0, "val_loss": 1.0},
            {"epoch": 2, "train_loss": 0.8, "val_loss": 0.5},
            {"epoch": 3, "train_loss": 0.6, "val_loss": 0.51},
            {"epoch": 4, "train_loss": 0.4, "val_loss": 0.525}]
    (f,) = logs.overfitting(rows)
    assert f.measured == (f"validation loss rises from epoch 3 ({number(0.5)} at epoch 2 -> "
                          f"{number(0.525)} at epoch 4) while the training loss falls "
                          f"({number(0.8)} -> {number(0.4)})")
    assert f.cause == "the model memorises the training set from epoch 3 on"
    assert f.fix.endswith("or train.epochs=2")
    assert logs.overfitting([*rows[:3], {**rows[3], "val_loss": 0.5249}]) == []
    assert logs.overfitting([*rows[:3], {**rows[3], "train_loss": 0.8}]) == []
    assert logs.overfitting(rows[:3]) == []  # one epoch after the minimum
    assert logs.overfitting([rows[1], rows[3]]) == []
    assert logs.overfitting([*rows, {"epoch": 5, "train_loss": 0.3}]) == [f]


def test_a_first_validation_accuracy_of_95_percent_is_suspicious():
    (f,) = logs.high_first_val_acc([{"val_acc": 0.95}, {"val_acc": 0.1}])
    assert f.measured == "validation accuracy is 95.0% after one epoch"
    assert f.cause == ("validation samples that also appear in training (leakage), labels that "
                       "leak into the inputs, or a task easier than expected")
    assert f.fix == "run `ironloop doctor CONFIG` (the leakage and initial_loss checks)"
    assert logs.high_first_val_acc([{"val_acc": 0.9499}]) == []
    assert logs.high_first_val_acc([{"val_acc": 0.1}, {"val_acc": 0.99}]) == []
    assert logs.high_first_val_acc([{}]) == [] and logs.high_first_val_acc([]) == []


def clip_rows(clipped_late):
    return [{"step": 10, "clipped": 10, "steps": 10, "grad_norm": 100.0},  # warm-up: left out
            {"step": 50, "clipped": 5, "steps": 10, "grad_norm": 2.0},
            {"step": 100, "clipped": clipped_late, "steps": 10, "grad_norm": 3.0}]


def test_clipping_on_more_than_half_the_steady_steps_is_a_hidden_lr_cut():
    assert logs.clipping(clip_rows(5), 1.0) == []  # 10 of 20: half
    (f,) = logs.clipping(clip_rows(6), 1.0, "SGD")
    assert f.severity == "warning"
    assert f.measured == ("55% of steady-state steps were clipped at clip.max_norm=1.0; median "
                          "pre-clip norm 2.5")
    assert f.fix == ("raise clip.max_norm (about 3.8) so it only catches spikes, or lower "
                     "optim.lr")
    assert "hidden LR cut" in f.cause
    bare = [{k: v for k, v in r.items() if k != "grad_norm"} for r in clip_rows(6)]
    (f,) = logs.clipping(bare, 0.5)
    assert f.measured == "55% of steady-state steps were clipped at clip.max_norm=0.5"
    assert f.fix == "raise clip.max_norm so it only catches spikes, or lower optim.lr"


def test_clipping_needs_ten_steady_steps_and_is_only_reported_for_adaptive_optimizers():
    assert logs.clipping([{"step": 1, "clipped": 9, "steps": 9}], 1.0) == []
    assert logs.clipping([{"step": 1, "clipped": 10, "steps": 10}], 1.0)[0].severity == "warning"
    (f,) = logs.clipping(clip_rows(6), 1.0, "AdamW")
    assert f.severity == "info" and f.measured.startswith(
        "55% of steady-state steps were clipped at clip.max_norm=1.0; median pre-clip norm 2.5. "
        "With AdamW, which divides each step")
    assert logs.clipping([], 1.0) == []


def speeds(*values):
    return [{"step": 0, "samples_per_s": 1.0}] + [
        {"step": i + 1, "samples_per_s": v} for i, v in enumerate(values)]


def test_throughput_below_seventy_percent_of_the_first_quarter_is_a_drop():
    from ironloop.outputs.numbers import number

    assert logs.throughput_drop(speeds(100, 100, 90, 90, 80, 80, 70, 70), []) == []
    (f,) = logs.throughput_drop(speeds(100, 100, 90, 90, 80, 80, 69, 69), [])
    assert f.measured == (f"throughput fell from {number(100.0)} to {number(69.0)} samples/s "
                          f"(31% lower) between the first and the last quarter of the run")
    assert f.fix == ("see from which step samples_per_s falls in metrics.jsonl, and keep only "
                     ".item() values of what you store")
    assert logs.throughput_drop(speeds(100, 100, 90, 90, 80, 69, 69), []) == []  # 7 windows
    (f,) = logs.throughput_drop(speeds(100, 100, 90, 90, 80, 80, 75, 60), [])  # quarters of 2
    assert f.measured.startswith(f"throughput fell from {number(100.0)} to {number(67.5)} "
                                 f"samples/s (32% lower)")


def test_the_throughput_finding_points_to_the_time_split_that_shows_the_growth():
    slow = speeds(100, 100, 90, 90, 80, 80, 50, 50)
    split = [{"epoch": 1, "time_split": {"data": 1.0, "compute": 2.0}},
             {"epoch": 2, "time_split": {"data": 3.0, "compute": 2.5}}]
    (f,) = logs.throughput_drop(slow, split)
    assert f.measured.endswith("; the time split says data grew most (1.00 s in the first "
                               "epoch, 3.00 s in the last)")
    assert f.fix.startswith("compare the time split per epoch in epochs.jsonl")
    (f,) = logs.throughput_drop(slow, split[:1], {"time_split": {"data": 1.0}})
    assert f.fix.startswith("see which part takes the time in results.json's time_split")
    assert f.measured.endswith("quarter of the run")
    shrank = [split[1], {"epoch": 2, "time_split": {"data": 3.0, "compute": 2.5}}]
    assert logs._part_that_grew(shrank) == ""


def test_a_nan_training_loss_is_named_at_its_step():
    (f,) = logs.non_finite_loss([{"step": 1, "loss": 1.0}, {"step": 2, "loss": "x"},
                                 {"step": 3, "loss": math.inf}, {"step": 4, "loss": math.nan}])
    assert f.severity == "error" and f.measured == "the training loss is inf at step 3"
    assert logs.non_finite_loss([{"step": 1, "loss": 1.0}]) == []


def test_the_optimizer_is_the_class_the_run_used_else_optim_name():
    assert logs.optimizer_name({"used": {"optimizer": "Lion"}, "optim": {"name": "sgd"}}) == "Lion"
    assert logs.optimizer_name({"used": {}, "optim": {"name": "sgd"}}) == "sgd"
    assert logs.optimizer_name({"used": "Lion", "optim": {"name": "sgd"}}) == "sgd"


def averaged(avg_loss, raw_loss=1.0, **acc):
    return [{"step": 5, "val_loss": raw_loss, "val_avg_loss": avg_loss, **acc}]


def test_averaged_weights_more_than_five_percent_worse_are_a_warning():
    assert logs.average_worse(averaged(1.05), {}) == []
    (f,) = logs.average_worse(averaged(1.06), {"average": {"decay": 0.999}})
    assert f.severity == "warning" and f.measured.endswith("at the last evaluation (step 5)")
    assert f.cause == ("the average still holds early weights: average.decay=0.999 keeps "
                       "decay^t of the weights from t updates back")
    assert f.fix.startswith("average.warmup=true (the default)")
    assert f.fix.endswith("; final.safetensors holds the raw weights")
    (f,) = logs.average_worse(averaged(1.06), {"average": {"decay": 0.9, "warmup": False}})
    assert f.cause.endswith(", and average.warmup=false gives the first weights that share too")
    (f,) = logs.average_worse(averaged(1.06), {"average": {"kind": "swa"}})
    assert "SWA's equal average" in f.cause and f.fix.startswith("start it later")
    assert logs.average_worse(averaged(1.06, val_acc=0.5, val_avg_acc=0.6), {}) == []
    assert logs.average_worse([{"step": 5, "val_loss": 1.0}], {}) == []


def test_the_diagnosis_section_lists_every_finding_or_says_nothing_calls_for_attention():
    assert logs.markdown([]) == "## Diagnosis\n\nNothing in the logs calls for attention.\n"
    assert logs.markdown([Finding("x", "warning", "m", "c", "f"), info("y", "n")]) == (
        "## Diagnosis\n\n- **warning** (x): m. *Likely cause:* c. *Fix:* f.\n"
        "- **info** (y): n.\n")  # an info has no cause or fix to print


def test_diagnose_logs_reads_every_log_of_a_run(tmp_path):
    import yaml

    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("metrics.jsonl", [{"step": 1, "loss": 1.0, "clipped": 10, "steps": 10}])
    jsonl("epochs.jsonl", [{"epoch": 1, "train_loss": 1.0, "val_acc": 0.99},
                           {"epoch": 2, "train_loss": 1.0}])
    jsonl("evals.jsonl", averaged(2.0))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"clip": {"max_norm": 0.25},
                                                         "optim": {"name": "sgd"}}))
    (tmp_path / "results.json").write_text("{}")
    found = logs.diagnose_logs(str(tmp_path))
    assert [f.check for f in found] == ["flat_loss", "val_acc_epoch1", "clipping", "average"]
    assert "clip.max_norm=0.25" in found[2].measured and found[2].severity == "warning"
