"""ironloop.tools.report's readers, numbers and text, in process and fast: the small readers, the
run's config, and the exact numbers and text the summary and the report write."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ironloop.tools import plots, report

# --- the small readers and numbers ----------------------------------------------------------

def test_values_and_pairs_skip_missing_null_nan_and_bools():
    rows = [{"a": 1, "b": 2.5}, {"a": None, "b": 3}, {"a": float("nan"), "b": 1},
            {"a": True, "b": 4}, {"b": 5}, {"a": 7, "b": "x"}, {"a": 9.5, "b": 0}]
    assert plots.values_of(rows, "a") == [1.0, 7.0, 9.5]
    assert plots._xy(rows, "a", "b") == ([1.0, 9.5], [2.5, 0.0])


def test_a_crash_is_the_last_step_before_the_counter_goes_back_or_repeats():
    rows = [{"step": s} for s in (4, 8, 8, 12, 6, 10, 2)]
    assert plots.crash_steps(rows) == [8, 12, 10]
    assert plots.crash_steps([{"step": 1.0}, {"step": 3.0}]) == []


def test_clipped_fraction_counts_clipped_steps_over_steps():
    rows = [{"clipped": 1, "steps": 4}, {"clipped": 3, "steps": 4, "grad_norm": 0.1},
            {"clipped": 2}]  # no steps: not counted
    assert plots.clipped_fraction(rows, None) == 0.5


def test_clipped_fraction_falls_back_to_norms_above_the_threshold():
    # counts of zero steps say nothing: the norms decide; a norm equal to max_norm is not clipped
    rows = [{"clipped": 0, "steps": 0, "grad_norm": v} for v in (1.0, 2.0, 0.5, 3.0)]
    assert plots.clipped_fraction(rows, 1.0) == 0.5
    assert plots.clipped_fraction(rows, None) is None
    assert plots.clipped_fraction(rows, 0) is None
    assert plots.clipped_fraction([{"step": 1}], 1.0) is None


def test_a_threshold_is_a_positive_number_else_none():
    assert plots._threshold(0.5) == 0.5
    assert plots._threshold(2) == 2.0
    for off in (0, 0.0, -1.0, None, "1.0", float("nan"), True):
        assert plots._threshold(off) is None


def test_a_series_spans_decades_only_when_positive_and_wider_than_asked():
    assert plots._spans([1.0, 100.5], 2) is True
    assert plots._spans([1.0, 100.0], 2) is False  # exactly two decades is not more
    assert plots._spans([2.0, 60.0], 1.5) is False and plots._spans([2.0, 70.0], 1.5) is True
    assert plots._spans([0.0, 1e9], 1) is False
    assert plots._spans([-1.0, 1e9], 1) is False
    assert plots._spans([], 1) is False


def test_linear_bins_are_n_equal_bins_over_the_range():
    assert plots.linear_bins([0.0, 4.0, 1.0], n=4) == [0.0, 1.0, 2.0, 3.0, 4.0]
    bins = plots.linear_bins([1.0, 3.0])
    assert len(bins) == 41 and bins[0] == 1.0 and bins[-1] == 3.0 and bins[1] == 1.05


def test_linear_bins_pad_a_range_too_narrow_for_distinct_edges():
    assert plots.linear_bins([4e14]) == [4e14 - 2e13, 4e14 + 2e13]
    assert plots.linear_bins([-2.0, -2.0]) == [-2.1, -1.9]
    assert plots.linear_bins([0.0, 0.0]) == [-0.5, 0.5]
    # a range of exactly a millionth of the values' size is still too narrow
    assert plots.linear_bins([999999.0, 1000000.0]) == [999999.0 - 50000.0, 1050000.0]
    assert len(plots.linear_bins([999998.0, 1000000.0])) == 41


def test_interval_clip_is_the_share_of_steps_a_row_covers_that_clipped():
    assert plots._interval_clip({"clipped": 1, "steps": 4}, None) == 0.25
    assert plots._interval_clip({"clipped": 6, "steps": 4}, None) == 1.0  # capped
    assert plots._interval_clip({"clipped": 2}, None) == 1.0  # uncounted steps: any clip
    assert plots._interval_clip({"clipped": 0, "steps": 0}, None) == 0.0
    assert plots._interval_clip({"clipped": 0.5, "steps": 0}, None) == 1.0
    # no counts: the row's own norm against the threshold (equal is not clipped)
    assert plots._interval_clip({"grad_norm": 1.5}, 1.0) == 1.0
    assert plots._interval_clip({"grad_norm": 1.0}, 1.0) == 0.0
    assert plots._interval_clip({"grad_norm": 1.5}, None) == 0.0
    assert plots._interval_clip({}, 0.5) == 0.0  # no norm counts as 0


def test_accuracies_become_percent_unless_already_above_one():
    assert plots.as_percent([0.5, 1.0]) == [50.0, 100.0]
    assert plots.as_percent([50.0, 1.5]) == [50.0, 1.5]
    assert plots.as_percent([]) == []


def test_the_clip_title_says_disabled_unknown_or_the_share():
    assert plots._clip_title([{"grad_norm": 2.0}], None) == "clipping disabled"
    assert plots._clip_title([{"clipped": 0, "steps": 4}], None) == "clipping disabled"
    assert plots._clip_title([{"clipped": 1, "steps": 4}], None) == \
        "clipped: 25.0% of optimizer steps"
    assert plots._clip_title([], 1.0) == "clipped: n/a"
    assert plots._clip_title([{"grad_norm": 2.0}, {"grad_norm": 0.5}], 1.0) == \
        "clipped: 50.0% of optimizer steps"


def test_fmt_takes_the_first_finite_number():
    assert report._fmt(None, float("nan"), "x", 0.12345, 9.0) == "0.1235"
    assert report._fmt(1234.56, spec=".1f") == "1234.6"
    assert report._fmt(0.9512, pct=True) == "95.12%" and report._fmt(95.0, pct=True) == "95.00%"
    assert report._fmt(3) == "3.000" and report._fmt(0.0, spec=".1f") == "0.0"
    assert report._fmt() == "n/a" and report._fmt(None, pct=True) == "n/a"


def test_span_is_the_wall_clock_between_the_first_and_last_stamp():
    assert report._span([5.0, 2.0, 9.5]) == 7.5
    assert report._span([5.0]) is None and report._span([]) is None


def test_epochs_done_says_when_the_run_ended_inside_an_epoch():
    assert report._epochs_done([{}, {}], [{"epoch": 2}]) == "2"
    assert report._epochs_done([{}, {}], [{"epoch": 3}, {"epoch": 1}]) == \
        "2 complete; ended inside epoch 3"
    assert report._epochs_done([], []) == "0"


def test_split_sizes_name_an_eval_subset_and_a_stream():
    assert report._split_size("train", {"size": 1438}, 20) == "1,438 train"
    assert report._split_size("val", {"size": 240}, 20) == \
        "240 val evaluated (eval.max_batches=20)"
    assert report._split_size("validation", {"size": 5}, 1) == \
        "5 validation evaluated (eval.max_batches=1)"
    assert report._split_size("val", {"size": 240}, 0) == "240 val"
    assert report._split_size("val", {}, 0) == "val (no length)"
    assert report._split_size("train", {"size": 3.0}, 0) == "train (no length)"


# --- the run's config: what it used --------------------------------------------------------

def test_used_rows_fall_back_to_the_configs_names():
    assert report._used_rows({"data": {"name": "d"}, "model": {"name": "m"}}) == \
        [("data", "d"), ("model", "m")]
    assert report._used_rows({"used": "junk"}) == [("data", None), ("model", None)]


def test_used_rows_from_the_config_keep_its_names_and_add_the_classes():
    cfg = {"data": {"name": "mnist1d"}, "model": {"name": "mlp"}, "eval": {"max_batches": 3},
           "used": {"source": "config", "optimizer": "SGD", "scheduler": "OneCycleLR",
                    "model": {"class": "MLP", "parameters": 12345},
                    "data": {"train": {"type": "T", "size": 4000}, "val": {"size": 1000},
                             "note": "not a split"}}}
    assert report._used_rows(cfg) == [
        ("data", "mnist1d (4,000 train, 1,000 val evaluated (eval.max_batches=3))"),
        ("model", "mlp (MLP, 12,345 parameters)"), ("optimizer", "SGD + OneCycleLR")]


def test_used_rows_of_code_the_user_passed_name_its_classes():
    cfg = {"data": {"name": "d"}, "used": {"optimizer": "AdamW",
                                           "model": {"class": "Net"},
                                           "data": {"train": {"type": "Windows", "size": 7}}}}
    assert report._used_rows(cfg) == [("data", "Windows (7 train)"),
                                      ("model", "Net (0 parameters)"), ("optimizer", "AdamW")]
    no_type = {"data": {"name": "d"}, "used": {"model": {"parameters": 5},
                                               "data": {"val": {"size": 2}}}}
    assert report._used_rows(no_type) == [("data", "d (2 val)"), ("model", None)]


# --- the summary and the report -------------------------------------------------------------

def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(tmp_path: Path, name: str = "run", cfg: dict | None = None,
         results: dict | None = None, **logs: list[dict]) -> Path:
    run = tmp_path / name
    run.mkdir()
    if cfg is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    if results is not None:
        (run / "results.json").write_text(json.dumps(results))
    for log, rows in logs.items():
        _write_jsonl(run / f"{log}.jsonl", rows)
    return run


def test_the_summary_of_a_finished_epoch_run(tmp_path):
    run = _run(tmp_path, cfg={"data": {"name": "d"}, "model": {"name": "m"},
                              "schedule": {"name": "cosine"}, "clip": {"max_norm": 1.0}},
               results={"steps": 40, "best_val_acc": 0.9, "test_acc": 0.875,
                        "test_loss": 0.25, "seconds": 12.25, "train_seconds": 10.04,
                        "bad_steps": 2, "rollbacks": 0, "skipped_samples": 5},
               metrics=[{"step": 20, "epoch": 1, "samples_per_s": 100.0, "clipped": 1,
                         "steps": 20, "time": 100.0},
                        {"step": 40, "epoch": 2, "samples_per_s": 300.0, "clipped": 3,
                         "steps": 20, "time": 150.0}],
               epochs=[{"epoch": 1, "val_acc": 0.8}, {"epoch": 2, "val_acc": 0.85}],
               events=[{"event": "resume", "step": 20}, {"event": "other"},
                       {"event": "resume", "step": 30}])
    rows, notes = report.summary(run)
    assert rows == [("data", "d"), ("model", "m"), ("schedule", "cosine"), ("epochs", "2"),
                    ("evaluations", 0), ("optimizer steps", "40"), ("best val acc", "90.00%"),
                    ("final val acc", "85.00%"), ("test acc", "87.50%"),
                    ("test loss", "0.2500"), ("mean samples/s", "200.0"),
                    ("clipped fraction", "10.0%"), ("resumes", 2), ("total seconds", "12.2"),
                    ("training seconds", "10.0"), ("bad steps", 2), ("skipped samples", 5)]
    assert notes == []


def test_the_summary_counts_the_runs_own_steps_past_the_last_logged_one(tmp_path):
    """results.json's steps, not metrics.jsonl's last row: a run of 45 steps logged every 20
    ends past its last metrics row (seed 8's summary_126)."""
    run = _run(tmp_path, results={"steps": 45}, metrics=[{"step": 20}, {"step": 40}])
    assert dict(report.summary(run)[0])["optimizer steps"] == "45"


def test_the_summary_of_a_step_run_that_did_not_finish(tmp_path):
    run = _run(tmp_path, metrics=[{"step": 10, "tokens_per_s": 50.0, "time": 1.0},
                                  {"step": 30, "tokens_per_s": 150.0, "grad_norm": 3.0,
                                   "time": 4.5}],
               evals=[{"step": 10, "val_acc": 0.7, "val_loss": 2.0, "val_ppl": 7.0},
                      {"step": 30, "val_acc": 0.6, "val_loss": 1.5, "val_ppl": 4.5}])
    rows, notes = report.summary(run)
    assert rows == [("data", "n/a"), ("model", "n/a"), ("schedule", "n/a"), ("epochs", "0"),
                    ("evaluations", 2), ("optimizer steps", "30"), ("best val acc", "70.00%"),
                    ("final val acc", "60.00%"), ("final val loss", "1.500"),
                    ("final val ppl", "4.500"), ("mean samples/s", "n/a"),
                    ("mean tokens/s", "100.0"), ("clipped fraction", "n/a"), ("resumes", 0),
                    ("total seconds", "3.5"), ("training seconds", "n/a")]
    assert notes == ["no config.yaml", "no results.json: the run did not finish"]


def test_the_summary_adds_the_time_split_validation_to_the_training_seconds(tmp_path):
    run = _run(tmp_path, results={"train_seconds": 8.0, "time_split": {"validation": 1.5}},
               metrics=[{"step": 1}])
    assert dict(report.summary(run)[0])["total seconds"] == "9.5"
    (run / "results.json").write_text(json.dumps({"train_seconds": 8.0, "time_split": 3}))
    assert dict(report.summary(run)[0])["total seconds"] == "8.0"
    (run / "results.json").write_text(json.dumps({"time_split": {"validation": 2.0}}))
    assert dict(report.summary(run)[0])["total seconds"] == "2.0"
    (run / "results.json").write_text(json.dumps({"seconds": 5.0, "train_seconds": 8.0}))
    assert dict(report.summary(run)[0])["total seconds"] == "5.0"


def test_the_summary_counts_norms_above_the_configs_clip_threshold(tmp_path):
    run = _run(tmp_path, cfg={"clip": {"max_norm": 1.0}},
               metrics=[{"step": 1, "grad_norm": 0.5}, {"step": 2, "grad_norm": 2.0}])
    assert dict(report.summary(run)[0])["clipped fraction"] == "50.0%"


def test_the_summary_says_what_could_not_be_read(tmp_path):
    run = _run(tmp_path, metrics=[{"step": 1}])
    (run / "config.yaml").write_text("- a list\n")
    (run / "results.json").write_text("{broken")
    assert report.summary(run)[1] == ["config.yaml is not a mapping",
                                      "results.json is unreadable (JSONDecodeError): "
                                      "the run did not finish"]


def test_the_summary_reports_the_averaged_weights_at_the_last_evaluation(tmp_path):
    run = _run(tmp_path, metrics=[{"step": 1}],
               evals=[{"step": 10, "val_loss": 0.5, "val_avg_loss": 0.4},
                      {"step": 20, "val_loss": 0.5, "val_avg_loss": 0.25}])
    assert dict(report.summary(run)[0])["averaged weights"] == \
        ("averaged weights better than raw (val_avg_loss 0.2500 < val_loss 0.5000) "
         "at the last evaluation (step 20)")
    assert report._averaged_words([{"step": 1, "val_loss": 0.5}]) is None


def test_summarize_writes_a_markdown_table_and_the_notes(tmp_path):
    run = _run(tmp_path, name="my-run", metrics=[{"step": 5, "samples_per_s": 10.0}])
    assert report.summarize(run) == (
        "# Run report: my-run\n\n| | |\n|---|---|\n| data | n/a |\n| model | n/a |\n"
        "| schedule | n/a |\n| epochs | 0 |\n| evaluations | 0 |\n| optimizer steps | 5 |\n"
        "| best val acc | n/a |\n| mean samples/s | 10.00 |\n"
        "| clipped fraction | n/a |\n| resumes | 0 |\n| total seconds | n/a |\n"
        "| training seconds | n/a |\n\n> note: no config.yaml\n"
        "> note: no results.json: the run did not finish\n")
    (run / "config.yaml").write_text("{}\n")
    (run / "results.json").write_text("{}")
    assert report.summarize(run).endswith("| training seconds | n/a |\n")
