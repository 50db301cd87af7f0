"""Tests for ironloop.tools.report: a fake run directory (200 steps, 5 epochs, one crash and
resume)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from ironloop.errors import UserError
from ironloop.tools import plots, report

STEPS_PER_EPOCH, EPOCHS, LOG_EVERY = 40, 5, 4
TOTAL = STEPS_PER_EPOCH * EPOCHS
CKPT_STEP, CRASH_STEP = 120, 132  # last.pt at the end of epoch 3; the crash came 12 steps later
MAX_NORM = 1.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNGS = ["loss.png", "accuracy.png", "lr.png", "grad_norm.png", "grad_norm_hist.png"]

# Per-step pre-clip grad norms, ~0.5-3, identical on replay (a resumable RNG).
NORMS = np.exp(np.random.default_rng(0).normal(-0.25, 0.5, TOTAL)).clip(0.45, 3.0)
EXPECTED_FRAC = float((NORMS > MAX_NORM).mean())


def _lr(step: int) -> float:
    """OneCycle-like: rises to 0.1 by step 60, then cosine-anneals to ~0."""
    if step <= 60:
        return 0.004 + (0.1 - 0.004) * step / 60
    return 0.1 * 0.5 * (1 + math.cos(math.pi * (step - 60) / (TOTAL - 60))) + 1e-5


def _metric(step: int, attempt: int) -> dict:
    window = NORMS[step - LOG_EVERY:step]
    loss = 2.3 * math.exp(-step / 60) + 0.08 + 0.03 * math.sin(step) + 0.02 * attempt
    return {"step": step, "epoch": (step - 1) // STEPS_PER_EPOCH + 1, "loss": loss,
            "lr": _lr(step), "grad_norm": float(NORMS[step - 1]),
            "clipped": int((window > MAX_NORM).sum()), "steps": LOG_EVERY,
            "samples_per_s": 5000.0 + 10 * attempt, "skipped": 0,
            "time": 1.7e9 + 30 * attempt + step * 0.05}  # a Unix timestamp, as the loop writes


def _epoch(epoch: int) -> dict:
    step = epoch * STEPS_PER_EPOCH
    return {"epoch": epoch, "step": step, "train_loss": 2.3 * math.exp(-step / 60) + 0.1,
            "val_loss": 2.3 * math.exp(-step / 70) + 0.15, "val_acc": 0.55 + 0.08 * epoch,
            "lr": _lr(step), "seconds": 2.0, "samples_per_s": 5000.0, "clipped_frac": 0.3}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_run(run: Path, resume: bool = True, truncated: bool = False, knob: int = 0) -> Path:
    """A run dir after crashing at CRASH_STEP and resuming at CKPT_STEP. ``truncated``: the loop
    cut the logs back to the checkpoint on resume (no step reset); else the replayed steps stay.
    ``knob``: the config's fault.crash_at_step."""
    run.mkdir(parents=True)
    cfg = {"run": {"dir": str(run)}, "data": {"name": "mnist1d"}, "model": {"name": "mlp"},
           "schedule": {"name": "onecycle"}, "clip": {"max_norm": MAX_NORM, "mode": "norm"},
           "fault": {"crash_at_step": knob}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    steps = range(LOG_EVERY, TOTAL + 1, LOG_EVERY)
    if resume:
        metrics = [_metric(s, 0) for s in steps if s <= (CKPT_STEP if truncated else CRASH_STEP)]
        metrics += [_metric(s, 1) for s in steps if s > CKPT_STEP]
        _write_jsonl(run / "events.jsonl", [{"event": "resume", "step": CKPT_STEP, "epoch": 3,
                                             "from": str(run / "checkpoints/last.pt")}])
    else:
        metrics = [_metric(s, 0) for s in steps]
    _write_jsonl(run / "metrics.jsonl", metrics)
    _write_jsonl(run / "epochs.jsonl", [_epoch(e) for e in range(1, EPOCHS + 1)])
    results = {"best_val_acc": 0.95, "test_acc": 0.9412, "test_loss": 0.2345, "steps": TOTAL,
               "seconds": 12.5, "extra": "ignored"}
    (run / "results.json").write_text(json.dumps(results))
    return run


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("runs") / "mnist1d-mlp")
    return run, report.render_report(run)


def assert_real_plot(path: Path, min_colour_px: int = 300) -> None:
    """A PNG that decodes, is not one flat colour, and has coloured (data) pixels, not just
    black axes and text."""
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 8_000, (path, len(data))
    img = mpimg.imread(path)[..., :3]
    assert img.std() > 0.05, (path, img.std())
    colour = (img.max(axis=-1) - img.min(axis=-1)) > 0.25
    assert colour.sum() >= min_colour_px, (path, int(colour.sum()))


def colour_px(path: Path, rgb: str, rows=slice(None), cols=slice(None)) -> int:
    """Pixels of (almost exactly) one matplotlib colour in a region: a panel's own line."""
    import matplotlib.colors as mcolors
    import matplotlib.image as mpimg

    img = mpimg.imread(path)[rows, cols, :3]
    return int((np.abs(img - np.array(mcolors.to_rgb(rgb))).max(axis=-1) < 0.06).sum())


def test_each_panel_has_its_data(rendered):
    """A panel that lost its line is caught even when the other panel still has colour."""
    run, _ = rendered
    acc, res = run / "report" / "accuracy.png", run / "report" / "resume.png"
    half = slice(None, 540), slice(540, None)  # 9 in x 120 dpi = 1080 px wide
    assert colour_px(acc, "C0", cols=half[0]) > 150 and colour_px(acc, "C1", cols=half[0]) > 150
    assert colour_px(acc, "C2", cols=half[1]) > 150
    assert colour_px(res, "C0", rows=slice(None, 330)) > 150  # 5.5 in x 120 dpi = 660 px tall
    assert colour_px(res, "C2", rows=slice(330, None)) > 150
    assert colour_px(res, "red") > 300 and colour_px(res, "green") > 150
    hist = run / "report" / "grad_norm_hist.png"
    assert colour_px(hist, "C3") > 150 and colour_px(hist, "C0") > 2000


def test_render_report_writes_every_plot(rendered):
    run, paths = rendered
    names = sorted(p.name for p in paths)
    assert names == sorted([*PNGS, "resume.png", "report.md", "report.html"])
    for p in paths:
        assert p.parent == run / "report" and p.is_file()
        if p.suffix == ".png":
            assert_real_plot(p)


def test_report_md_links_every_image(rendered):
    run, paths = rendered
    md = (run / "report" / "report.md").read_text()
    for p in paths:
        if p.suffix == ".png":
            assert f"]({p.name})" in md
    assert "mnist1d" in md and "mlp" in md and "onecycle" in md


def test_summarize_values(rendered):
    run, _ = rendered
    text = report.summarize(run)
    rows = dict(tuple(c.strip() for c in line.strip("|").split("|"))
                for line in text.splitlines() if line.startswith("| ") and "---" not in line)
    assert rows["epochs"] == "5"
    assert rows["optimizer steps"] == "200"
    assert rows["best val acc"] == "95.00%"
    assert rows["final val acc"] == "95.00%"
    assert rows["test acc"] == "94.12%"
    assert rows["test loss"] == "0.2345"
    assert rows["mean samples/s"] == "5004"  # 30 rows of attempt 0, 20 of attempt 1 after dedupe
    assert rows["clipped fraction"] == f"{EXPECTED_FRAC:.1%}"
    assert rows["resumes"] == "1"
    assert rows["total seconds"] == "12.5"


def test_clipped_fraction_matches_fake_data(rendered):
    run, _ = rendered
    raw = report.read_jsonl(run / "metrics.jsonl")
    assert 0.1 < EXPECTED_FRAC < 0.6  # the fake data really has clipping to count
    got = plots.clipped_fraction(report.continuous(raw), MAX_NORM)
    assert got == pytest.approx(EXPECTED_FRAC)
    # The replayed steps would be double-counted without the resume dedupe.
    assert plots.clipped_fraction(raw, MAX_NORM) != pytest.approx(EXPECTED_FRAC)


def test_clipped_fraction_rules():
    rows = [{"clipped": 1, "steps": 4}, {"clipped": 0, "steps": 4}, {"clipped": 3, "steps": 4}]
    assert plots.clipped_fraction(rows, 1.0) == pytest.approx(4 / 12)
    norms = [{"grad_norm": v} for v in (0.5, 1.5, 2.0, 0.9, None, float("nan"))]
    assert plots.clipped_fraction(norms, 1.0) == pytest.approx(2 / 4)
    assert plots.clipped_fraction(norms, 0) is None  # clipping disabled, no counts
    assert plots.clipped_fraction([], 1.0) is None


def test_continuous_drops_superseded_steps():
    rows = [{"step": s, "a": 0} for s in (4, 8, 12, 16)] + [{"step": s, "a": 1} for s in (12, 20)]
    kept = report.continuous(rows)
    assert [(r["step"], r["a"]) for r in kept] == [(4, 0), (8, 0), (12, 1), (20, 1)]
    assert plots.crash_steps(rows) == [16]
    assert plots.crash_steps(kept) == []


def test_read_jsonl_missing_partial_and_glued(tmp_path):
    assert report.read_jsonl(tmp_path / "nope.jsonl") == []
    p = tmp_path / "m.jsonl"
    # A crash left '{"step": 3, "lo' without a newline; the resumed run appended a full row to it.
    p.write_text('{"step": 1}\n{"step": 2, "x": {"y": 1}}\n'
                 '{"step": 3, "lo{"step": 3, "loss": 1.5}\n[1, 2]\n{"step": 4, "x": {"y": 2}\n'
                 '{"step": 5, "l')
    expected = [{"step": 1}, {"step": 2, "x": {"y": 1}}, {"step": 3, "loss": 1.5}]
    assert report.read_jsonl(p) == expected  # the stub's nested {"y": 2} is no row


def test_truncated_last_line_tolerated(tmp_path):
    run = make_run(tmp_path / "run", resume=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 204, "epoch": 6, "loss": 0.1')
    paths = report.render_report(run, tmp_path / "out")
    # no resume.png
    assert sorted(p.name for p in paths) == sorted([*PNGS, "report.md", "report.html"])
    assert all(p.parent == tmp_path / "out" for p in paths)
    assert len(report.read_jsonl(run / "metrics.jsonl")) == TOTAL // LOG_EVERY


@pytest.mark.parametrize("content", [None, "", '{"step": 1, "lo'])
def test_missing_or_empty_metrics_is_user_error(tmp_path, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(UserError, match="has no metrics.jsonl.*Pass the run.dir"):
        report.render_report(tmp_path)
    assert not (tmp_path / "report").exists()


def test_sparse_rows_do_not_crash(tmp_path):
    """Missing keys, nulls and NaNs are skipped; a run with no val acc and no config still plots."""
    run = tmp_path / "sparse"
    run.mkdir()
    rows = [{"step": s, "loss": 2.0 / s, "lr": 0.01} for s in range(1, 60)]
    rows += [{"step": 60, "loss": None, "grad_norm": float("nan")}, {"epoch": 1}]
    rows += [{"step": s, "loss": 0.03, "grad_norm": 0.2 * s} for s in range(61, 70)]
    _write_jsonl(run / "metrics.jsonl", rows)
    _write_jsonl(run / "epochs.jsonl", [{"epoch": 1, "train_loss": 1.0, "val_acc": None},
                                        {"epoch": 2, "train_loss": 0.5}])
    paths = report.render_report(run)
    for p in paths:
        if p.suffix == ".png":
            assert_real_plot(p)
    text = report.summarize(run)
    assert "| epochs | 2 |" in text and "no config.yaml" in text and "did not finish" in text
    assert "| total seconds | n/a |" in text and "test acc" not in text
    stamps = [{"step": 1, "time": 1.7e9}, {"step": 2, "time": 1.7e9 + 42}]
    _write_jsonl(run / "metrics.jsonl", stamps)
    assert "| total seconds | 42.0 |" in report.summarize(run)  # span of the timestamps


def test_plot_functions_compare_variants_and_mark_events(tmp_path):
    a = [_metric(s, 0) for s in range(4, 201, 4)]
    b = [dict(r, loss=r["loss"] * 1.5, lr=r["lr"] / 2) for r in a]
    out = plots.plot_loss_curves({"sgd": a, "adamw": b}, tmp_path / "l.png", title="cmp")
    assert out == tmp_path / "l.png"
    assert_real_plot(out)
    assert_real_plot(plots.plot_lr({"sgd": a, "adamw": b}, tmp_path / "lr.png"))
    assert_real_plot(plots.plot_resume_curve(a, [_epoch(e) for e in range(1, 6)],
                                              tmp_path / "r.png", [{"step": 120}], 132))


def test_threshold_line_and_clipped_dots_are_drawn(tmp_path):
    rows = [_metric(s, 0) for s in range(4, 201, 4)]
    unclipped = [dict(r, clipped=0) for r in rows]
    hist_on = plots.plot_grad_norm_hist(rows, MAX_NORM, tmp_path / "h1.png")
    hist_off = plots.plot_grad_norm_hist(rows, None, tmp_path / "h0.png")
    assert colour_px(hist_on, "C3") > colour_px(hist_off, "C3") + 150  # the dashed clip line
    dots = plots.plot_grad_norm(rows, MAX_NORM, tmp_path / "g1.png")
    no_dots = plots.plot_grad_norm(unclipped, MAX_NORM, tmp_path / "g0.png")
    assert colour_px(dots, "C3") > colour_px(no_dots, "C3") + 500  # red dots where clipped > 0


@pytest.mark.parametrize("knob", [0, CRASH_STEP])
def test_crash_line_from_fault_knob_when_logs_were_truncated(tmp_path, knob):
    """The loop truncates the logs on resume, so only fault.crash_at_step can place the crash."""
    run = make_run(tmp_path / "run", truncated=True, knob=knob)
    assert plots.crash_steps(report.read_jsonl(run / "metrics.jsonl")) == []
    paths = report.render_report(run)
    resume = run / "report" / "resume.png"
    assert resume in paths
    assert_real_plot(resume)
    assert colour_px(resume, "green") > 150  # the resume line is always there
    assert (colour_px(resume, "red") > 300) == bool(knob)


# -- diagnoses from the logs (ironloop.tools.doctor.logs) ----------------------------------------

from ironloop.tools.doctor.logs import diagnose_logs  # noqa: E402


def _diag_run(run: Path, epochs: list[dict], metrics: list[dict] | None = None) -> list:
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"clip": {"max_norm": 1.0}}))
    _write_jsonl(run / "epochs.jsonl", epochs)
    steps = metrics or [{"step": s, "loss": 2.0 / s, "samples_per_s": 1000.0, "clipped": 0,
                         "steps": 10, "grad_norm": 0.5} for s in range(10, 210, 10)]
    _write_jsonl(run / "metrics.jsonl", steps)
    return diagnose_logs(run)


def _epochs(train: list[float], val: list[float], acc: list[float] | None = None) -> list[dict]:
    acc = acc or [0.5 + 0.05 * i for i in range(len(train))]
    return [{"epoch": i + 1, "step": 10 * (i + 1), "train_loss": t, "val_loss": v,
             "val_acc": a} for i, (t, v, a) in enumerate(zip(train, val, acc))]


def test_diagnosis_clean_run_is_silent(tmp_path):
    assert diagnose_logs(make_run(tmp_path / "run")) == []
    assert _diag_run(tmp_path / "r2", _epochs([1.0, 0.6, 0.4, 0.3], [1.0, 0.7, 0.5, 0.45])) == []


def test_diagnosis_flat_loss(tmp_path):
    (f,) = _diag_run(tmp_path / "r", _epochs([2.30, 2.29, 2.30, 2.29], [2.3] * 4))
    assert f.check == "flat_loss" and "2.300 in the first epoch" in f.measured
    assert "--lr-find" in f.fix


def test_diagnosis_overfitting_names_the_epoch(tmp_path):
    found = _diag_run(tmp_path / "r", _epochs([1.0, 0.6, 0.4, 0.25, 0.15, 0.1],
                                              [1.0, 0.7, 0.6, 0.65, 0.72, 0.8]))
    (f,) = [f for f in found if f.check == "overfitting"]
    assert "rises from epoch 4" in f.measured and "epoch 3" in f.measured
    assert "early_stop.patience" in f.fix


def test_diagnosis_high_val_acc_at_epoch_one(tmp_path):
    found = _diag_run(tmp_path / "r", _epochs([0.5, 0.3], [0.2, 0.1], [0.97, 0.98]))
    assert [f.check for f in found] == ["val_acc_epoch1"]
    assert "97.0%" in found[0].measured and "leakage" in found[0].cause


def test_diagnosis_clipping_in_steady_state(tmp_path):
    # The first 10% of steps (warm-up) may clip; after that 8 of 10 steps per window do.
    metrics = [{"step": s, "loss": 2.0 / s, "samples_per_s": 1000.0, "steps": 10,
                "clipped": 10 if s <= 20 else 8, "grad_norm": 2.0} for s in range(10, 210, 10)]
    found = _diag_run(tmp_path / "r", _epochs([1.0, 0.5], [1.0, 0.6]), metrics)
    (f,) = found
    assert f.check == "clipping" and f.measured.startswith("80% of steady-state steps")
    assert "median pre-clip norm 2" in f.measured and "raise clip.max_norm" in f.fix
    metrics = [{**m, "clipped": 10 if m["step"] <= 20 else 2} for m in metrics]
    assert _diag_run(tmp_path / "r2", _epochs([1.0, 0.5], [1.0, 0.6]), metrics) == []


def test_diagnosis_throughput_drop_names_the_part(tmp_path):
    metrics = [{"step": s, "loss": 2.0 / s, "clipped": 0, "steps": 10, "grad_norm": 0.5,
                "samples_per_s": 1000.0 if s <= 100 else 400.0} for s in range(10, 210, 10)]
    epochs = _epochs([1.0, 0.5], [1.0, 0.6])
    epochs[0]["time_split"] = {"data": 0.1, "forward": 1.0, "other": 0.1}
    epochs[1]["time_split"] = {"data": 1.6, "forward": 1.0, "other": 0.1}
    (f,) = _diag_run(tmp_path / "r", epochs, metrics)
    assert f.check == "throughput" and "1000 to 400.0 samples/s (60% lower)" in f.measured
    assert "data grew most" in f.measured


def test_report_md_has_a_diagnosis_section(tmp_path):
    run = tmp_path / "r"
    _diag_run(run, _epochs([2.30, 2.29, 2.30], [2.3] * 3))
    report.render_report(run)
    md = (run / "report" / "report.md").read_text()
    assert "## Diagnosis" in md and "(flat_loss)" in md


# --- report.html: one self-contained page, checked in a real browser (issue 22) ---------------

def test_report_html_is_self_contained_and_has_a_viewport(rendered):
    run, paths = rendered
    html = (run / "report" / "report.html").read_text()
    assert "<meta name='viewport' content='width=device-width" in html
    pngs = [p for p in paths if p.suffix == ".png"]
    assert html.count("data:image/png;base64,") == len(pngs) == 6
    assert "src=\"http" not in html and "href=" not in html  # nothing to fetch
    assert "best val acc" in html and "<h2>Diagnosis</h2>" in html


@pytest.mark.parametrize("width", [420, 1280])
def test_report_html_renders_in_chromium(rendered, width):
    from tests.conftest import open_in_browser

    run, _ = rendered
    seen = open_in_browser(run / "report" / "report.html", width)
    assert seen["errors"] == []
    assert len(seen["images"]) == 6 and all(i["ok"] for i in seen["images"]), seen["images"]
    assert seen["overflow"] <= 0, f"the page scrolls sideways by {seen['overflow']} px"
    assert "best val acc" in seen["text"]


def test_identical_curves_are_grouped_and_labelled_once(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 20)]
    other = [{"step": s, "loss": 2.0 / s} for s in range(1, 20)]
    groups = plots.coinciding({"a": rows, "b": [dict(r) for r in rows], "c": other},
                               "step", "loss")
    assert [names for names, _ in groups] == [["a", "b"], ["c"]]
    assert plots.plot_loss_curves({"a": rows, "b": rows}, tmp_path / "l.png").is_file()


# --- every plot survives the values a real run logs (issue 44) ---------------------------------

INF, NAN = float("inf"), float("nan")
#: Shapes of one logged series: the values every metric of the fake run takes, in step order.
SHAPES = {
    "one value": [0.5],
    "one huge value": [4e14],  # nanoGPT's one logged grad_norm of 4e14: 40 bins finer than a ulp
    "constant": [0.25] * 12,
    "constant huge": [4e14] * 12,
    "zeros": [0.0] * 12,
    "a spike of 4e14": [1.0, 1.2, 0.9, 4e14, 1.1, 0.8],
    "with inf": [1.0, INF, 0.5, INF, 0.25],
    "with nan": [1.0, NAN, 0.5, NAN, 0.25],
    "only inf": [INF, INF, INF],
    "only nan": [NAN, NAN],
}


def _shaped_run(run: Path, values: list[float]) -> Path:
    """A run directory where every figure a plot reads (loss, lr, grad_norm, speed, validation,
    the averaged weights' metrics) takes ``values``; with a resume, epochs and evaluations."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"clip": {"max_norm": 1.0}}))
    steps = range(1, len(values) + 1)
    _write_jsonl(run / "metrics.jsonl", [
        {"step": s, "epoch": 1, "loss": v, "lr": v, "grad_norm": v, "clipped": 1, "steps": 1,
         "samples_per_s": v, "tokens_per_s": v, "time": 1.7e9 + s} for s, v in zip(steps, values)])
    evals = [{"step": s, "epoch": 1, "val_loss": v, "val_acc": v, "val_ppl": v,
              "val_avg_loss": v, "val_avg_acc": v} for s, v in zip(steps, values)]
    _write_jsonl(run / "evals.jsonl", evals)
    _write_jsonl(run / "epochs.jsonl", [{**e, "epoch": e["step"], "train_loss": e["val_loss"]}
                                        for e in evals])
    _write_jsonl(run / "events.jsonl", [{"event": "resume", "step": 1, "last_logged_step": 2}])
    (run / "results.json").write_text(json.dumps(
        {"steps": len(values), "test_loss": values[0], "train_seconds": values[-1]}))
    return run


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_plot_survives_one_value_constant_values_inf_and_nan(tmp_path, shape):
    run = _shaped_run(tmp_path / "run", SHAPES[shape])
    paths = report.render_report(run)
    pngs = [p for p in paths if p.suffix == ".png"]
    assert {p.name for p in pngs} >= {"loss.png", "lr.png", "grad_norm.png",
                                      "grad_norm_hist.png", "averaged.png", "resume.png"}
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)
    assert "| optimizer steps |" in (run / "report" / "report.md").read_text()


# --- advice that is right for the run it reads (issue 44) --------------------------------------

CLIPPED = [{"step": s, "loss": 2.0 / s, "samples_per_s": 1000.0, "steps": 10, "clipped": 8,
            "grad_norm": 1.6} for s in range(10, 210, 10)]


def _with_optimizer(run: Path, optimizer: str) -> Path:
    """The run's config.yaml, as a run records the optimizer class it used."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"clip": {"max_norm": 1.0}, "optim": {"name": "adamw"},
         "used": {"optimizer": optimizer, "source": "config"}}))
    _write_jsonl(run / "epochs.jsonl", _epochs([1.0, 0.5], [1.0, 0.6]))
    _write_jsonl(run / "metrics.jsonl", CLIPPED)
    return run


def test_clipping_under_an_adaptive_optimizer_is_no_hidden_lr_cut():
    """nanoGPT's clip=1.0 with AdamW clips most steps; raising it changed nothing (1.9054
    against 1.9053): the report says so instead of advising it."""
    from ironloop.tools.doctor.logs import clipping

    (f,) = clipping(CLIPPED, 1.0, "AdamW")
    assert f.severity == "info" and f.fix == "" and "80% of steady-state steps" in f.measured
    assert "no hidden LR cut" in f.measured and "raise" not in f.measured


def test_clipping_under_sgd_still_advises_a_higher_threshold(tmp_path):
    (f,) = diagnose_logs(_with_optimizer(tmp_path / "sgd", "SGD"))
    assert f.severity == "warning" and "hidden LR cut" in f.cause
    assert "raise clip.max_norm (about 2.4)" in f.fix
    (f,) = diagnose_logs(_with_optimizer(tmp_path / "adam", "AdamW"))  # read from used:
    assert f.severity == "info"


SLOWER = [{"step": s, "loss": 2.0 / s, "clipped": 0, "steps": 10, "grad_norm": 0.5,
           "samples_per_s": 1000.0 if s <= 100 else 400.0} for s in range(10, 210, 10)]


def test_the_throughput_fix_points_to_a_file_that_holds_a_time_split(tmp_path):
    """A max_steps run inside its first epoch has no epochs.jsonl line: the fix names
    results.json's time split, or metrics.jsonl when the run did not finish."""
    from ironloop.tools.doctor.logs import throughput_drop

    split = {"time_split": {"data": 1.0, "forward": 2.0}}
    (f,) = throughput_drop(SLOWER, [], split)
    assert "results.json's time_split" in f.fix and "epochs.jsonl" not in f.fix
    (f,) = throughput_drop(SLOWER, [], {})
    assert "metrics.jsonl" in f.fix and "epochs.jsonl" not in f.fix


def test_the_throughput_fix_names_epochs_jsonl_when_two_epochs_have_a_split(tmp_path):
    from ironloop.tools.doctor.logs import throughput_drop

    epochs = _epochs([1.0, 0.5], [1.0, 0.6])
    for e, data in zip(epochs, (0.1, 1.6)):
        e["time_split"] = {"data": data, "forward": 1.0}
    (f,) = throughput_drop(SLOWER, epochs, {"time_split": {"data": 1.7}})
    assert "time split per epoch in epochs.jsonl" in f.fix


def _summary_rows(run: Path) -> dict:
    return dict(tuple(c.strip() for c in line.strip("|").split("|"))
                for line in report.summarize(run).splitlines()
                if line.startswith("| ") and "---" not in line)


def test_a_run_that_ends_inside_its_first_epoch_does_not_read_epochs_0(tmp_path):
    run = tmp_path / "lm"
    run.mkdir()
    _write_jsonl(run / "metrics.jsonl", [{"step": s, "epoch": 1, "loss": 1.0}
                                         for s in range(10, 2010, 10)])
    assert _summary_rows(run)["epochs"] == "0 complete; ended inside epoch 1"


def test_a_run_that_ends_at_an_epoch_boundary_counts_its_epochs_plainly(rendered):
    run, _ = rendered
    assert _summary_rows(run)["epochs"] == "5"


def _sized_run(run: Path, max_batches: int) -> Path:
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"name": "examples.char_gpt:data"}, "eval": {"max_batches": max_batches},
         "used": {"source": "config", "data": {"train": {"type": "Windows", "size": 1003854},
                                               "val": {"type": "Windows", "size": 240}}}}))
    _write_jsonl(run / "metrics.jsonl", [{"step": 10, "epoch": 1, "loss": 1.0}])
    return run


def test_an_eval_subset_is_counted_as_what_is_evaluated(tmp_path):
    data = _summary_rows(_sized_run(tmp_path / "sub", max_batches=20))["data"]
    assert data == ("examples.char_gpt:data (1,003,854 train, 240 val evaluated "
                    "(eval.max_batches=20))")
    whole = _summary_rows(_sized_run(tmp_path / "whole", max_batches=0))["data"]
    assert whole == "examples.char_gpt:data (1,003,854 train, 240 val)"


def test_a_language_models_validation_plot_draws_perplexity_on_its_own_labelled_panel(
        tmp_path, monkeypatch):
    """Issue 44: an LM's validation.png put perplexity on an unlabelled second axis beside an
    empty accuracy panel. Now: loss on the left, perplexity on the right, one axis each."""
    rows = [{"step": s, "epoch": 1, "val_loss": 4.0 - s / 100, "val_ppl": math.exp(4.0 - s / 100)}
            for s in (50, 100, 150, 200)]
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, out: (figures.append(
        [(ax.get_ylabel(), ax.get_title(), len(ax.lines)) for ax in fig.axes]), save(fig, out))[1])
    assert_real_plot(plots.plot_validation(rows, tmp_path / "validation.png"))
    assert figures == [[("validation loss", "Validation loss per evaluation", 1),
                        ("validation perplexity", "Validation perplexity", 1)]]
    plots.plot_accuracy([{**r, "epoch": i + 1} for i, r in enumerate(rows)], tmp_path / "a.png")
    assert figures[1][1][:2] == ("validation perplexity", "Validation perplexity")


def test_a_validation_panel_without_a_val_loss_says_none_was_recorded(tmp_path, monkeypatch):
    rows = [{"step": s, "epoch": 1, "val_ppl": 20.0} for s in (50, 100)]  # no val_loss
    texts = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, out: (texts.append(
        [t.get_text() for t in fig.axes[0].texts]), save(fig, out))[1])
    plots.plot_validation(rows, tmp_path / "validation.png")
    assert texts == [["no evaluations recorded"]]


def test_a_single_evaluation_is_drawn_as_a_visible_point(tmp_path):
    """A line through one point draws nothing: each validation value needs its marker (a
    language model evaluated once has one perplexity)."""
    rows = [{"step": 50, "epoch": 1, "val_loss": 4.0, "val_ppl": math.exp(4.0)}]
    out = plots.plot_validation(rows, tmp_path / "validation.png")
    assert colour_px(out, "C0", cols=slice(None, 540)) > 20  # the val loss point
    assert colour_px(out, "C1", cols=slice(540, None)) > 20  # the perplexity point


def test_the_grad_norm_plot_draws_the_clip_threshold_in_the_clip_colour(tmp_path):
    rows = [dict(_metric(s, 0), clipped=0) for s in range(4, 201, 4)]  # no clipped dots
    with_line = plots.plot_grad_norm(rows, MAX_NORM, tmp_path / "on.png")
    without = plots.plot_grad_norm(rows, None, tmp_path / "off.png")
    assert colour_px(with_line, "C3") > colour_px(without, "C3") + 150


def test_the_resume_curve_panels_share_the_step_axis(tmp_path, monkeypatch):
    """The crash and resume lines stand at the same x in both panels, even where validation
    covers fewer steps than the loss."""
    limits = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, out: (limits.append(
        [ax.get_xlim() for ax in fig.axes]), save(fig, out))[1])
    metrics = [_metric(s, 0) for s in range(4, 201, 4)]
    plots.plot_resume_curve(metrics, [_epoch(e) for e in (3, 4)], tmp_path / "r.png",
                             [{"step": 120}], 132)
    (top, bottom), = limits
    assert top == bottom and top[0] < 4 and top[1] > 200
