"""ironloop.tools.report's plots, in process and fast: what each plot draws (titles, labels, lines
and their data, scales, notes), read off the Figure before it is saved. tests/tools/test_report.py
checks the rendered PNGs of a whole fake run."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from ironloop.tools import plots, report
from tests.tools.test_report_summary import _run  # a fake run's files


def _line(ln) -> dict:
    return {"label": ln.get_label(), "x": [float(v) for v in ln.get_xdata()],
            "y": [float(v) for v in ln.get_ydata()], "lw": ln.get_linewidth(),
            "ls": ln.get_linestyle(), "color": to_hex(ln.get_color()),
            "marker": ln.get_marker(), "ms": ln.get_markersize()}


def _axes(ax) -> dict:
    legend = ax.get_legend()
    grid = ax.get_xgridlines()
    return {"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
            "lines": [_line(ln) for ln in ax.lines],
            "legend": None if legend is None else [t.get_text() for t in legend.get_texts()],
            "legend_size": legend.get_texts()[0].get_fontsize() if legend and legend.get_texts()
            else None,
            "notes": [t.get_text() for t in ax.texts],
            "grid": bool(grid) and grid[0].get_visible(),
            "grid_alpha": grid[0].get_alpha() if grid else None,
            "below": ax.get_axisbelow(), "xticks": len(ax.get_xticks()),
            "yticks": len(ax.get_yticks())}


@pytest.fixture
def figures(monkeypatch):
    """Each figure a plot function saves, as (out, figure, [axes snapshot]); the file is a stub
    (no PNG is drawn: fast, and the image tests in test_report.py check real renders). The
    widths the plots set are theirs whatever a matplotlibrc says: the defaults here are off."""
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "lines.linewidth", 0.7)
    monkeypatch.setitem(matplotlib.rcParams, "lines.markersize", 9.0)
    seen: list = []

    def save(fig, out):
        out = Path(out)
        seen.append((out, fig, [_axes(ax) for ax in fig.axes]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"png")
        return out

    monkeypatch.setattr(plots, "_save", save)
    return seen


C = {f"C{i}": to_hex(f"C{i}") for i in range(10)}


# --- the figures ----------------------------------------------------------------------------

def test_a_figure_is_seven_by_four_inches_at_120_dpi():
    fig, axes = plots._figure()
    assert tuple(fig.get_size_inches()) == (7.0, 4.0) and fig.dpi == 120
    assert len(axes) == 1
    fig, axes = plots._figure(2, 1, size=(3.0, 5.0), sharex=True)
    assert tuple(fig.get_size_inches()) == (3.0, 5.0) and len(axes) == 2
    assert axes[0].get_shared_x_axes().joined(axes[0], axes[1])


def test_save_lays_out_writes_at_the_dpi_and_clears(tmp_path):
    calls = []

    class Fig:
        def tight_layout(self):
            calls.append("layout")

        def savefig(self, out, dpi):
            calls.append(("save", out, dpi))

        def clear(self):
            calls.append("clear")

    out = plots._save(Fig(), str(tmp_path / "a" / "b" / "x.png"))
    assert out == tmp_path / "a" / "b" / "x.png" and out.parent.is_dir()
    assert calls == ["layout", ("save", out, 120), "clear"]
    assert plots._save(Fig(), out.with_name("y.png")) == out.with_name("y.png")  # dir exists


def test_save_writes_a_png_of_the_figures_pixel_size(tmp_path):
    import matplotlib.image as mpimg

    fig, (ax,) = plots._figure()
    ax.plot([0, 1], [0, 1])
    out = plots._save(fig, tmp_path / "new" / "f.png")
    assert mpimg.imread(out).shape[:2] == (480, 840)
    assert fig.axes == []


def test_a_note_is_centred_grey_on_white_above_the_data():
    _, (ax,) = plots._figure()
    plots._note(ax, "nothing here")
    (t,) = ax.texts
    assert (t.get_text(), t.get_position(), t.get_ha(), t.get_va()) == \
        ("nothing here", (0.5, 0.5), "center", "center")
    assert t.get_transform() is ax.transAxes and t.get_zorder() == 5
    assert to_hex(t.get_color()) == to_hex("0.4")
    box = t.get_bbox_patch()
    assert to_hex(box.get_facecolor()) == "#ffffff" and box.get_edgecolor()[3] == 0
    assert len(ax.get_xticks()) > 0  # ticks kept unless told
    plots._note(ax, "again", ticks=False)
    assert len(ax.get_xticks()) == 0 and len(ax.get_yticks()) == 0


def test_finish_draws_a_small_legend_and_a_light_grid_behind_the_data():
    _, (ax,) = plots._figure()
    ax.plot([1, 2], [1, 2], label="a")
    plots._finish(ax, True, "empty", xlabel="x", title="t")
    s = _axes(ax)
    assert (s["legend"], s["legend_size"], s["grid"], s["grid_alpha"], s["below"]) == \
        (["a"], pytest.approx(8.33, abs=0.01), True, 0.3, True)
    assert (s["xlabel"], s["title"], s["notes"]) == ("x", "t", [])
    _, (ax,) = plots._figure()
    plots._finish(ax, False, "empty", ylabel="y")
    s = _axes(ax)
    assert (s["notes"], s["legend"], s["grid"], s["xticks"], s["ylabel"]) == \
        (["empty"], None, False, 0, "y")


def test_coinciding_curves_share_one_entry_in_first_seen_order():
    a = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    resumed = [*a, {"step": 2, "loss": 9.0}, {"step": 3, "loss": 8.0}]  # replayed after a crash
    got = plots.coinciding({"a": a, "none": [{"step": 1}], "b": list(a), "r": resumed},
                            "step", "loss")
    assert got == [(["a", "b"], ((1.0, 2.0, 3.0), (1.0, 0.5, 1 / 3))),
                   (["r"], ((1.0, 2.0, 3.0), (1.0, 9.0, 8.0)))]


def test_the_loss_plot_draws_one_labelled_line_per_distinct_curve(figures, tmp_path):
    a = [{"step": s, "loss": 2.0 / s} for s in (1, 2, 4)]
    b = [{"step": s, "loss": 3.0 / s} for s in (1, 2, 4)]
    out = plots.plot_loss_curves({"a": a, "b": b, "c": list(a)}, tmp_path / "l.png")
    assert out == tmp_path / "l.png"
    ((_, fig, (s,)),) = figures
    assert tuple(fig.get_size_inches()) == (7.0, 4.0)
    assert [(ln["label"], ln["x"], ln["y"], ln["lw"], ln["ls"]) for ln in s["lines"]] == [
        ("a = c (identical)", [1.0, 2.0, 4.0], [2.0, 1.0, 0.5], 1.3, "-"),
        ("b", [1.0, 2.0, 4.0], [3.0, 1.5, 0.75], 1.3, "-")]
    assert (s["title"], s["xlabel"], s["ylabel"], s["yscale"]) == \
        ("Training loss", "optimizer step", "train loss", "linear")
    assert s["legend"] == ["a = c (identical)", "b"] and s["grid"] and s["notes"] == []
    assert fig.axes[0].yaxis.get_major_formatter()._powerlimits != (-3, 3)  # loss: no sci


def test_loss_curves_go_log_past_two_decades_and_take_another_x(figures, tmp_path):
    rows = [{"step": s, "epochs": s / 10, "loss": v} for s, v in ((1, 5.0), (2, 0.04))]
    plots.plot_loss_curves({"r": rows}, tmp_path / "l.png", title="T", x="epochs",
                            xlabel="epochs")
    s = figures[0][2][0]
    assert (s["title"], s["xlabel"], s["yscale"]) == ("T", "epochs", "log")
    assert s["lines"][0]["x"] == [0.1, 0.2]
    plots.plot_loss_curves({"r": [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 0.05}]},
                            tmp_path / "l2.png")
    assert figures[1][2][0]["yscale"] == "linear"  # exactly two decades


def test_many_variants_cycle_the_line_style_every_ten(figures, tmp_path):
    runs = {f"v{i}": [{"step": 1, "loss": float(i + 1)}] for i in range(41)}
    plots.plot_loss_curves(runs, tmp_path / "l.png")
    styles = [ln["ls"] for ln in figures[0][2][0]["lines"]]
    assert styles == ["-"] * 10 + ["--"] * 10 + [":"] * 10 + ["-."] * 10 + ["-"]


def test_a_loss_plot_without_losses_says_so(figures, tmp_path):
    plots.plot_loss_curves({"a": [{"step": 1, "lr": 0.1}]}, tmp_path / "l.png")
    s = figures[0][2][0]
    assert (s["notes"], s["lines"], s["legend"], s["title"], s["xlabel"]) == \
        (["no train loss recorded"], [], None, "Training loss", "optimizer step")


def test_the_lr_plot_is_linear_with_scientific_ticks(figures, tmp_path):
    rows = [{"step": s, "lr": v} for s, v in ((1, 1e-5), (2, 1e-2))]
    plots.plot_lr({"a": rows}, tmp_path / "lr.png")
    ((_, fig, (s,)),) = figures
    assert (s["title"], s["ylabel"], s["xlabel"], s["yscale"]) == \
        ("Learning rate", "learning rate", "optimizer step", "linear")
    assert s["lines"][0]["y"] == [1e-5, 1e-2] and s["lines"][0]["label"] == "a"
    assert fig.axes[0].yaxis.get_major_formatter()._powerlimits == (-3, 3)
    assert fig.axes[0].xaxis.get_major_formatter()._powerlimits != (-3, 3)
    plots.plot_lr({"a": [{"step": 1}]}, tmp_path / "lr2.png")
    assert figures[1][2][0]["notes"] == ["no learning rate recorded"]


def _norm_rows(norms, clipped=None, steps=None):
    return [{"step": 10 * (i + 1), "grad_norm": v,
             **({} if clipped is None else {"clipped": clipped[i], "steps": steps})}
            for i, v in enumerate(norms)]


def test_the_norm_histogram_bins_linearly_with_the_threshold_and_share(figures, tmp_path):
    rows = _norm_rows([0.5, 1.0, 1.5, 2.0], clipped=[0, 0, 1, 3], steps=4)
    plots.plot_grad_norm_hist(rows, 1.0, tmp_path / "h.png")
    ((_, fig, (s,)),) = figures
    ax = fig.axes[0]
    bars = ax.patches
    assert len(bars) == 40 and to_hex(bars[0].get_facecolor()) == C["C0"]
    assert bars[0].get_x() == 0.5 and sum(b.get_height() for b in bars) == 4
    assert ax.get_ylim()[1] == pytest.approx(max(b.get_height() for b in bars) * 1.05 * 1.2)
    (thr,) = s["lines"]
    assert (thr["x"], thr["color"], thr["ls"], thr["lw"], thr["label"]) == \
        ([1.0, 1.0], C["C3"], "--", 1.5, "clip threshold = 1")
    assert s["legend"] == ["logged steps (n=4)", "clip threshold = 1"]
    assert (s["xlabel"], s["ylabel"], s["xscale"]) == \
        ("pre-clip global grad norm", "count", "linear")
    assert s["title"] == "Gradient norm distribution (clipped: 25.0% of optimizer steps)"
    assert s["grid"] and s["below"]


def test_the_norm_histogram_goes_log_past_a_decade_and_a_half(figures, tmp_path):
    plots.plot_grad_norm_hist(_norm_rows([0.1, 1.0, 3.2]), None, tmp_path / "h.png")
    ((_, fig, (s,)),) = figures
    bars = fig.axes[0].patches
    assert s["xscale"] == "log" and len(bars) == 40 and s["lines"] == []
    assert bars[0].get_x() == pytest.approx(0.1) and \
        bars[-1].get_x() + bars[-1].get_width() == pytest.approx(3.2)
    assert s["title"] == "Gradient norm distribution (clipping disabled)"
    plots.plot_grad_norm_hist(_norm_rows([0.1, 1.0, 3.1]), None, tmp_path / "h2.png")
    assert figures[1][2][0]["xscale"] == "linear"


def test_the_norm_histogram_without_norms_says_so(figures, tmp_path):
    plots.plot_grad_norm_hist([{"step": 1}], 1.0, tmp_path / "h.png")
    ((_, fig, (s,)),) = figures
    assert s["notes"] == ["no grad norm recorded"] and len(fig.axes[0].patches) == 0
    assert (s["lines"], s["xlabel"], s["title"]) == \
        ([], "pre-clip global grad norm", "Gradient norm distribution (clipped: n/a)")


def test_the_norm_plot_marks_clipped_logs_by_their_share(figures, tmp_path):
    rows = _norm_rows([0.5, 2.0, 3.0], clipped=[0, 1, 4], steps=4)
    rows.insert(1, {"step": 15, "clipped": 2, "steps": 4})  # no norm: no dot
    plots.plot_grad_norm(rows, 1.0, tmp_path / "g.png")
    ((_, fig, (s,)),) = figures
    line, thr = s["lines"]
    assert (line["x"], line["y"], line["lw"], line["color"], line["label"]) == \
        ([10.0, 20.0, 30.0], [0.5, 2.0, 3.0], 1.0, C["C0"], "pre-clip grad norm")
    assert (thr["y"], thr["color"], thr["ls"], thr["lw"], thr["label"]) == \
        ([1.0, 1.0], C["C3"], "--", 1.2, "clip threshold = 1")
    (dots,) = fig.axes[0].collections
    assert dots.get_offsets().tolist() == [[20.0, 2.0], [30.0, 3.0]]
    assert dots.get_sizes().tolist() == [9.0, 24.0]
    assert to_hex(dots.get_facecolor()[0]) == C["C3"] and dots.get_zorder() == 3
    assert s["legend"] == ["pre-clip grad norm", "clipped since last log (size: share)",
                           "clip threshold = 1"]
    assert (s["xlabel"], s["ylabel"], s["yscale"]) == \
        ("optimizer step", "pre-clip global grad norm", "linear")
    assert s["title"] == "Gradient norm (clipped: 43.8% of optimizer steps)"  # 7 of 16


def test_the_norm_plot_reads_one_trajectory_and_goes_log_past_two_decades(figures, tmp_path):
    rows = [*_norm_rows([0.01, 5.0]), {"step": 10, "grad_norm": 0.02}]  # a resume at step 10
    plots.plot_grad_norm(rows, None, tmp_path / "g.png")
    ((_, fig, (s,)),) = figures
    (line,) = s["lines"]
    assert line["x"] == [10.0] and s["yscale"] == "linear" and len(fig.axes[0].collections) == 0
    plots.plot_grad_norm(_norm_rows([0.01, 1.5]), None, tmp_path / "g2.png")
    assert figures[1][2][0]["yscale"] == "log"
    assert figures[1][2][0]["title"] == "Gradient norm (clipping disabled)"
    plots.plot_grad_norm(_norm_rows([0.01, 1.0]), None, tmp_path / "g3.png")
    assert figures[2][2][0]["yscale"] == "linear"


def test_the_norm_plot_without_norms_says_so(figures, tmp_path):
    plots.plot_grad_norm([{"step": 1, "loss": 1.0}], 1.0, tmp_path / "g.png")
    s = figures[0][2][0]
    assert (s["notes"], s["lines"], s["xlabel"], s["ylabel"]) == \
        (["no grad norm recorded"], [], "optimizer step", "pre-clip global grad norm")


def test_the_accuracy_plot_draws_losses_left_and_accuracy_right(figures, tmp_path):
    epochs = [{"epoch": e, "train_loss": 1.0 / e, "val_loss": 2.0 / e, "val_acc": 0.2 * e}
              for e in (1, 2, 3)]
    plots.plot_accuracy([*epochs, {"epoch": 2, "train_loss": 9.0}], tmp_path / "a.png")
    ((_, fig, (left, right)),) = figures
    assert tuple(fig.get_size_inches()) == (9.0, 4.0)
    assert [(ln["label"], ln["x"], ln["marker"]) for ln in left["lines"]] == \
        [("train loss", [1.0, 2.0], "o"), ("val loss", [1.0], "o")]
    assert left["lines"][0]["y"] == [1.0, 9.0]  # the resumed epoch 2 replaces the first
    assert (left["title"], left["xlabel"], left["ylabel"], left["legend"]) == \
        ("Loss per epoch", "epoch", "loss", ["train loss", "val loss"])
    (acc,) = right["lines"]
    assert (acc["x"], acc["y"], acc["color"], acc["marker"], acc["ms"]) == \
        ([1.0], [20.0], C["C2"], "o", 3.0)
    assert (right["title"], right["xlabel"], right["ylabel"], right["grid"]) == \
        ("Validation accuracy", "epoch", "validation accuracy (%)", True)
    assert right["grid_alpha"] == 0.3
    for ax in fig.axes:
        assert ax.xaxis.get_major_locator()._integer


def test_the_accuracy_plot_with_only_a_val_loss_or_nothing(figures, tmp_path):
    plots.plot_accuracy([{"epoch": 1, "val_loss": 2.0}], tmp_path / "a.png")
    left = figures[0][2][0]
    assert [ln["label"] for ln in left["lines"]] == ["val loss"] and left["notes"] == []
    plots.plot_accuracy([], tmp_path / "b.png")
    ((_, fig, (left, right)),) = figures[1:]
    assert left["notes"] == ["no epochs recorded"] and left["title"] == "Loss per epoch"
    assert right["notes"] == ["no validation accuracy or perplexity recorded"]
    assert (right["title"], right["xlabel"], right["xticks"]) == \
        ("Validation accuracy", "epoch", 0)
    for ax in fig.axes:  # no ticks to make integer
        assert not getattr(ax.xaxis.get_major_locator(), "_integer", False)


def test_the_validation_plot_draws_val_loss_and_accuracy_per_step(figures, tmp_path):
    rows = [{"step": 50, "val_loss": 2.0, "val_acc": 0.5},
            {"step": 100, "val_loss": 1.0, "val_acc": 0.75, "val_ppl": 3.0}]
    out = plots.plot_validation(rows, tmp_path / "v.png")
    assert out == tmp_path / "v.png"
    ((_, fig, (left, right)),) = figures
    assert tuple(fig.get_size_inches()) == (9.0, 4.0)
    (loss,) = left["lines"]
    assert (loss["x"], loss["y"], loss["marker"], loss["ms"], loss["color"], loss["label"]) == \
        ([50.0, 100.0], [2.0, 1.0], "o", 3.0, C["C0"], "val loss")
    assert (left["title"], left["xlabel"], left["ylabel"], left["legend"]) == \
        ("Validation loss per evaluation", "optimizer step", "validation loss", ["val loss"])
    (acc,) = right["lines"]
    assert (acc["y"], right["xlabel"], right["ylabel"]) == \
        ([50.0, 75.0], "optimizer step", "validation accuracy (%)")


def test_a_language_models_perplexity_goes_log_past_a_decade(figures, tmp_path):
    rows = [{"step": 1, "val_ppl": 200.0}, {"step": 2, "val_ppl": 19.0}]
    plots.plot_validation(rows, tmp_path / "v.png")
    left, right = figures[0][2]
    assert left["notes"] == ["no evaluations recorded"] and left["lines"] == []
    (ppl,) = right["lines"]
    assert (ppl["y"], ppl["color"], ppl["marker"], ppl["ms"]) == ([200.0, 19.0], C["C1"], "o", 3)
    assert (right["yscale"], right["grid"], right["title"], right["ylabel"]) == \
        ("log", True, "Validation perplexity", "validation perplexity")
    assert right["grid_alpha"] == 0.3
    plots.plot_validation([{"step": 1, "val_ppl": 200.0}, {"step": 2, "val_ppl": 20.0}],
                           tmp_path / "v2.png")
    assert figures[1][2][1]["yscale"] == "linear"


def test_averaged_pairs_are_metrics_with_both_weights_in_first_seen_order():
    rows = [{"step": 1, "val_avg_acc": 0.5, "val_acc": 0.4},
            {"val_loss": 1.0, "val_avg_loss": 0.9, "val_avg_f1": 0.3, "avg_loss": 1}]
    assert plots.averaged_pairs(rows) == [("val_acc", "val_avg_acc"),
                                           ("val_loss", "val_avg_loss")]
    assert plots.averaged_pairs([]) == []


def test_the_averaged_plot_puts_losses_left_and_metrics_right(figures, tmp_path):
    rows = [{"step": 10, "val_loss": 1.0, "val_avg_loss": 0.9, "val_acc": 0.5,
             "val_avg_acc": 0.6}, {"step": 20, "val_loss": 0.8, "val_avg_loss": 0.7}]
    plots.plot_averaged(rows, tmp_path / "av.png")
    ((_, fig, (left, right)),) = figures
    assert tuple(fig.get_size_inches()) == (9.0, 4.0)
    got = [[(ln["label"], ln["x"], ln["y"], ln["ls"], ln["color"], ln["marker"], ln["ms"])
            for ln in ax["lines"]] for ax in (left, right)]
    assert got == [[("val loss", [10.0, 20.0], [1.0, 0.8], "-", C["C0"], "o", 3.0),
                    ("val avg loss", [10.0, 20.0], [0.9, 0.7], "--", C["C1"], "o", 3.0)],
                   [("val acc", [10.0], [0.5], "-", C["C2"], "o", 3.0),
                    ("val avg acc", [10.0], [0.6], "--", C["C3"], "o", 3.0)]]
    assert (left["title"], left["xlabel"], right["title"], right["xlabel"]) == \
        ("Raw and averaged weights: loss", "optimizer step",
         "Raw and averaged weights: metric", "optimizer step")
    assert left["legend"] == ["val loss", "val avg loss"] and right["notes"] == []


def test_the_averaged_plot_says_which_side_has_nothing(figures, tmp_path):
    rows = [{"step": 10, "val_f1": 0.5, "val_avg_f1": 0.6}]
    plots.plot_averaged(rows, tmp_path / "av.png")
    left, right = figures[0][2]
    assert left["notes"] == ["no averaged loss recorded"] and left["lines"] == []
    assert right["notes"] == [] and [ln["color"] for ln in right["lines"]] == [C["C0"], C["C1"]]
    plots.plot_averaged([{"step": 1, "val_loss": 1.0}], tmp_path / "b.png")
    left, right = figures[1][2]
    assert right["notes"] == ["no averaged metric recorded"]


def test_the_resume_curve_marks_each_crash_and_resume_in_both_panels(figures, tmp_path):
    metrics = [{"step": s, "loss": 10.0 / s} for s in (1, 2, 4)]
    metrics += [{"step": 2, "loss": 3.0}, {"step": 4, "loss": 0.01}]
    epochs = [{"epoch": 1, "step": 2, "val_acc": 0.5}, {"epoch": 2, "step": 4, "val_acc": 0.75}]
    plots.plot_resume_curve(metrics, epochs, tmp_path / "r.png",
                             [{"step": 2}, {"event": "no step"}], [4, 3.0])
    ((_, fig, (top, bottom)),) = figures
    assert tuple(fig.get_size_inches()) == (7.0, 5.5)
    assert top["lines"][0] == {"label": "train loss", "x": [1.0, 2.0, 4.0],
                               "y": [10.0, 3.0, 0.01], "lw": 1.2, "ls": "-",
                               "color": C["C0"], "marker": "None", "ms": 9.0}
    assert top["yscale"] == "log"
    acc = bottom["lines"][0]
    assert (acc["x"], acc["y"], acc["color"], acc["marker"], acc["label"]) == \
        ([2.0, 4.0], [50.0, 75.0], C["C2"], "o", "val acc (epoch end)")
    marks = ["crash (step 4)", "crash (step 3)", "resumed from step 2"]
    for panel in (top, bottom):
        lines = panel["lines"][1:]
        assert [ln["label"] for ln in lines] == marks
        assert [(ln["x"][0], to_hex(ln["color"]), ln["ls"], ln["lw"]) for ln in lines] == [
            (4.0, "#ff0000", "-", 1.5), (3.0, "#ff0000", "-", 1.5),
            (2.0, "#008000", "--", 1.5)]
        assert panel["grid"] and panel["grid_alpha"] == 0.3
    assert top["legend"] == ["train loss", *marks] and bottom["legend"] is None
    assert top["legend_size"] == pytest.approx(8.33, abs=0.01)
    assert (top["title"], top["ylabel"]) == ("Crash and resume", "train loss")
    assert (bottom["xlabel"], bottom["ylabel"]) == \
        ("optimizer step", "validation accuracy (%)")
    assert fig.axes[0].get_shared_x_axes().joined(fig.axes[0], fig.axes[1])


def test_the_resume_curve_takes_one_crash_step_or_none(figures, tmp_path):
    metrics = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    plots.plot_resume_curve(metrics, [], tmp_path / "r.png", crash_step=7)
    top, bottom = figures[0][2]
    assert [ln["label"] for ln in top["lines"]] == ["train loss", "crash (step 7)"]
    assert top["yscale"] == "linear"
    assert bottom["notes"] == ["no validation accuracy recorded"] and bottom["xticks"] > 0
    plots.plot_resume_curve(metrics, [], tmp_path / "r2.png")
    top, _ = figures[1][2]
    assert [ln["label"] for ln in top["lines"]] == ["train loss"]


def test_the_report_of_an_epoch_run_draws_accuracy_and_links_every_plot(figures, tmp_path):
    run = _run(tmp_path, cfg={"clip": {"max_norm": 2.0}},
               metrics=[{"step": s, "epoch": 1, "loss": 1.0 / s, "lr": 0.1,
                         "grad_norm": float(s)} for s in (1, 2, 3)],
               epochs=[{"epoch": 1, "step": 3, "val_acc": 0.5}],
               evals=[{"step": 3, "val_loss": 1.0}])
    paths = report.render_report(run)
    out = run / "report"
    assert paths == [out / n for n in ("loss.png", "accuracy.png", "lr.png", "grad_norm.png",
                                       "grad_norm_hist.png", "report.md", "report.html")]
    titles = [f[2][0]["title"] for f in figures]
    assert titles == ["Training loss: run", "Loss per epoch", "Learning rate",
                      "Gradient norm (clipped: 33.3% of optimizer steps)",
                      "Gradient norm distribution (clipped: 33.3% of optimizer steps)"]
    md = (out / "report.md").read_text()
    assert md.startswith(report.summarize(run) + "\n## Diagnosis")
    assert md.endswith("\n![loss](loss.png)\n\n![accuracy](accuracy.png)\n\n![lr](lr.png)\n\n"
                       "![grad_norm](grad_norm.png)\n\n![grad_norm_hist](grad_norm_hist.png)\n")
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "<title>Run report: run</title>" in html
    assert "<tr><td>epochs</td><td>1</td></tr>" in html
    assert "<p>Nothing in the logs calls for attention.</p><ul></ul>" in html
    assert html.count('<img alt="') == 5 and '<img alt="grad_norm.png"' in html


def test_a_step_run_draws_validation_and_averaged_into_the_given_folder(figures, tmp_path):
    run = _run(tmp_path, metrics=[{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}],
               evals=[{"step": 2, "val_loss": 1.0, "val_avg_loss": 0.8}])
    out = tmp_path / "elsewhere"
    paths = report.render_report(str(run), str(out))
    assert [p.name for p in paths] == ["loss.png", "validation.png", "lr.png", "grad_norm.png",
                                       "grad_norm_hist.png", "averaged.png", "report.md",
                                       "report.html"]
    assert all(p.parent == out for p in paths) and not (run / "report").exists()
    assert figures[1][2][0]["title"] == "Validation loss per evaluation"
    assert figures[5][2][0]["lines"][1]["label"] == "val avg loss"


def test_a_run_without_epochs_or_evaluations_still_gets_the_accuracy_figure(figures, tmp_path):
    run = _run(tmp_path, metrics=[{"step": 1, "loss": 1.0}])
    names = [p.name for p in report.render_report(run)]
    assert names[1] == "accuracy.png" and "averaged.png" not in names


def _crash_titles(figures) -> list[str]:
    (resume,) = [f for f in figures if f[0].name == "resume.png"]
    return [ln["label"] for ln in resume[2][0]["lines"][1:]]


def test_the_resume_plot_places_crashes_from_the_resume_events(figures, tmp_path):
    metrics = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4)]
    run = _run(tmp_path, cfg={"fault": {"crash_at_step": 9}}, metrics=metrics,
               events=[{"event": "resume", "step": 2, "last_logged_step": 3},
                       {"event": "resume", "step": 3, "last_logged_step": 3},
                       {"event": "resume", "last_logged_step": 1}])
    assert report.render_report(run)[5] == run / "report" / "resume.png"
    assert _crash_titles(figures) == ["crash (step 3)", "crash (step 1)",
                                      "resumed from step 2", "resumed from step 3"]


def test_the_resume_plot_falls_back_to_step_resets_then_the_fault_knob(figures, tmp_path):
    reset = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 2, 3, 4)]
    run = _run(tmp_path, "a", cfg={"fault": {"crash_at_step": 9}}, metrics=reset,
               events=[{"event": "resume", "step": 2, "last_logged_step": 2}])
    report.render_report(run)
    assert _crash_titles(figures) == ["crash (step 3)", "resumed from step 2"]
    figures.clear()
    straight = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4)]
    run = _run(tmp_path, "b", cfg={"fault": {"crash_at_step": 3}}, metrics=straight,
               events=[{"event": "resume", "step": 2}])
    report.render_report(run)
    assert _crash_titles(figures) == ["crash (step 3)", "resumed from step 2"]
    figures.clear()
    run = _run(tmp_path, "c", metrics=straight, events=[{"event": "resume", "step": 2}])
    report.render_report(run)
    assert _crash_titles(figures) == ["resumed from step 2"]


def test_the_html_report_lists_notes_findings_and_images(tmp_path):
    from ironloop.tools.doctor.logs import Finding

    run = _run(tmp_path, "r&d", metrics=[{"step": 1}])
    img = tmp_path / "p.png"
    img.write_bytes(b"x")
    found = [Finding("flat_loss", "warning", "loss 2.3 < 2.4", "lr too low", "raise it")]
    out = report.write_html(run, found, [img], tmp_path / "o.html")
    html = out.read_text(encoding="utf-8")
    assert "<h1>Run report: r&amp;d</h1><div class='t'><table><tr><th></th><th></th></tr>" in html
    assert ("<blockquote>note: no config.yaml</blockquote><blockquote>note: no results.json: "
            "the run did not finish</blockquote><h2>Diagnosis</h2><ul><li><b>warning "
            "(flat_loss):</b> loss 2.3 &lt; 2.4. Likely cause: lr too low. Fix: raise it.</li>"
            "</ul><figure><img alt=\"p.png\" src=\"data:image/png;base64,eA==\">") in html
    assert "Nothing in the logs" not in html
