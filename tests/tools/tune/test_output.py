"""tools.tune.output: the progress bar, the exact text of the table, tune.json and tuned.yaml, and
where they are written."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

import ironloop
from ironloop.config import Config
from ironloop.errors import UserError
from ironloop.tools.tune import output
from ironloop.tools.tune.output import tuned_yaml
from ironloop.tools.tune.rows import Row
from ironloop.tools.tune.trials import Measure, Plan
from tests.tools.tune.helpers import mk, subject


def test_tuned_yaml_is_the_input_when_nothing_changes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# my comment\ntrain:\n  epochs: 3\ndata:\n  name: synthetic\n")
    cfg = ironloop.load_config(path)
    assert tuned_yaml(cfg, path, [], {}) == path.read_text()
    text = tuned_yaml(cfg.with_overrides(["train.batch_size=16"]), path,
                      ["train.batch_size=16"], {"data.num_workers": 2})
    back = Config.from_dict(yaml.safe_load(text))
    assert back.data.num_workers == 2 and back.train.batch_size == 16 and back.train.epochs == 3


# -- output.py ------------------------------------------------------------------------------------


def test_the_progress_bar_follows_the_budgets_seconds(clock):
    class TqdmBar:
        n = 0.0

        def __init__(self):
            self.descriptions = []

        def set_description(self, text):
            self.descriptions.append(text)

        def update(self, n):
            self.n += n

    inner = TqdmBar()
    bar = output._Bar(inner, 100.0)
    assert bar.started == clock.now and bar.budget == 100.0
    bar.set_description("data.num_workers=2")
    assert inner.descriptions == ["tune: data.num_workers=2"]
    clock.now += 30.0
    bar.update(1)
    assert inner.n == 30.0
    clock.now += 30.0
    bar.update(1)
    assert inner.n == 60.0
    clock.now += 500.0
    bar.update(1)
    assert inner.n == 100.0  # never past the budget


def test_the_progress_bar_shows_on_a_terminal_or_when_asked_and_always_closes(monkeypatch):
    made = []

    class Tqdm:
        def __init__(self, **kwargs):
            self.kwargs, self.closed = kwargs, False
            made.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(output, "tqdm", Tqdm)
    with output.progress_bar("on", 59.6) as bar:
        assert isinstance(bar, output._Bar) and bar.bar is made[0] and bar.budget == 59.6
    assert made[0].kwargs == {"total": 60, "disable": False, "leave": False, "unit": "s",
                              "bar_format": "{desc} {bar} {n:.0f}/{total:.0f} s budget",
                              "dynamic_ncols": True}
    assert made[0].closed
    with pytest.raises(RuntimeError), output.progress_bar("off", 10):
        raise RuntimeError
    assert made[1].kwargs["disable"] is True and made[1].closed
    monkeypatch.setattr(output.sys, "stderr", types.SimpleNamespace(isatty=lambda: True))
    with output.progress_bar("auto", 10):
        pass
    assert made[2].kwargs["disable"] is False
    monkeypatch.setattr(output.sys, "stderr", types.SimpleNamespace(isatty=lambda: False))
    with output.progress_bar("auto", 10):
        pass
    assert made[3].kwargs["disable"] is True


class Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if isinstance(self.item, Exception):
            raise self.item
        return self.item


def test_tokens_per_sample_counts_a_language_models_integer_sequences():
    ids = torch.zeros(16, dtype=torch.long)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    labels = torch.zeros(4, dtype=torch.long)
    assert output.tokens_per_sample((tokens, labels)) == 16  # the inputs, not the labels
    assert output.tokens_per_sample((tokens[:1], labels[:1])) == 16  # the first sample's
    assert output.tokens_per_sample([tokens, labels]) == 16
    assert output.tokens_per_sample((torch.zeros(4, 16), tokens)) is None  # floats
    assert output.tokens_per_sample((torch.zeros(4, 16, dtype=torch.bool), tokens)) is None
    assert output.tokens_per_sample((torch.zeros(4, 2, 8, dtype=torch.long), tokens)) is None
    assert output.tokens_per_sample(Items({"input_ids": ids[:8], "labels": ids})) == 8
    assert output.tokens_per_sample(Items((ids[:12], ids))) == 12
    assert output.tokens_per_sample(Items([ids[:12], ids])) == 12
    assert output.tokens_per_sample(Items(ids[:5])) == 5
    assert output.tokens_per_sample(Items({"x": ids})) is None  # no input_ids
    assert output.tokens_per_sample(Items(3)) is None
    assert output.tokens_per_sample(Items(ValueError("unreadable"))) is None
    loader = torch.utils.data.DataLoader(Items((ids[:7], ids)), batch_size=2)
    assert output.tokens_per_sample(loader) == 7


def test_the_context_in_tune_json(clock, monkeypatch):
    monkeypatch.setattr(output.os, "getloadavg", lambda: (1.234, 0.5, 0.0))
    monkeypatch.setattr(output.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    subj = subject({"run": {"device": "cpu"}, "train": {"epochs": 3, "max_steps": 20}})
    tuner = types.SimpleNamespace(started=clock.now - 42.36, samples=500, pairs=4,
                                  plan=Plan(3, 5, 4, measure_s=1.23456), est_s=2.345678)
    info = output.context(subj, tuner, 60.0, Path("c.yaml"), ["train.epochs=3"])
    assert info == {"config": "c.yaml", "overrides": ["train.epochs=3"], "device": "cpu",
                    "torch": torch.__version__, "cpus": 3, "load_average": [1.23, 0.5, 0.0],
                    "budget_s": 60.0, "used_s": 42.4, "epochs": 3, "max_steps": 20,
                    "train_samples": 64, "planned_samples": 500, "tokens_per_sample": None,
                    "plan": {"warmup_steps": 3, "window_steps": 5, "windows": 4,
                             "measure_s": 1.235, "pairs": 4, "trial_estimate_s": 2.35}}
    monkeypatch.delattr(output.os, "sched_getaffinity")
    monkeypatch.setattr(output.os, "cpu_count", lambda: 7)
    info = output.context(subj, tuner, 60.0, None, [])
    assert (info["config"], info["overrides"], info["cpus"]) == (None, [], 7)


def test_durations_read_in_the_unit_that_suits_them():
    assert output.duration(None) == "-"
    assert output.duration(2 * 3600) == "2.0 h"
    assert output.duration(72 * 3600) == "72.0 h"
    assert output.duration(7199) == "120 min"
    assert output.duration(120) == "2 min"
    assert output.duration(119.4) == "119 s"
    assert output.duration(10) == "10 s"
    assert output.duration(9.96) == "10.0 s"
    assert output.duration(9.44) == "9.4 s"


def _info(**changes) -> dict:
    info = {"config": "c.yaml", "overrides": [], "device": "cpu", "cpus": 2,
            "load_average": [1.5, 0.25, 0.0], "budget_s": 120.0, "used_s": 118.6,
            "tokens_per_sample": None, "epochs": 10, "max_steps": 0, "train_samples": 640,
            "planned_samples": 6400, "plan": {"pairs": 4}}
    return {**info, **changes}


def _result(**changes) -> types.SimpleNamespace:
    """A tune's result: the baseline, a chosen worker count, a failed row, a trajectory
    winner."""
    base = Row("baseline (the config as it is)", {}, status="ok", ratio=1.0, projected_s=5185.0,
               measure=Measure(1234.4, (1200.0, 1300.4), [1200.0, 1234.4, 1300.4], 12.5, 0.0,
                               2.0, peak_mb=2048.4,
                               time_split={"data": 50.0, "forward": 100.0, "backward": 48.0,
                                           "optimizer": 1.0, "checkpoint": 0.5, "other": 0.5}))
    workers = Row("data.num_workers=2", {"data.num_workers": 2}, status="ok", ratio=2.0,
                  projected_s=2592.5, measure=mk(2468.8, spread=(2400.0, 2500.0)), won=True,
                  gain=2.0, verdict="chosen (paired)")
    failed = Row("data.num_workers=4", {"data.num_workers": 4}, status="failed",
                 reason="RuntimeError: boom")
    bf16 = Row("train.precision=bf16", {"train.precision": "bf16"}, kind="trajectory",
               status="ok", ratio=1.5, projected_s=3456.7, measure=mk(1851.6, spread=(1800, 1900)),
               note="autocast, no scaler", verdict="faster")
    result = types.SimpleNamespace(
        info=_info(), baseline=base, rows=[workers, failed, bf16],
        chosen={"data.num_workers": 2}, trajectory={"train.precision": "bf16"},
        applied_trajectory=False, speedup=2.0, paths={})
    for key, value in changes.items():
        setattr(result, key, value)
    return result


HEAD = ("  " + "setting".ljust(44) + "samples/s".rjust(10) + "  " + "spread".ljust(15)
        + "x base".rjust(7) + "run time".rjust(10) + "   verdict")


def _line(setting: str, figures: str, verdict: str) -> str:
    return "  " + setting.ljust(44) + figures + "   " + verdict


def test_the_table_shows_the_baseline_both_tables_and_the_run_time(no_cuda):
    result = _result()
    assert output.table(result).splitlines() == [
        "ironloop tune c.yaml: cpu, 2 CPU cores, load 1.5 0.25 0.0, budget 120 s, used 119 s",
        "baseline: 1,234 samples/s, 12.50 ms/step; peak memory 2,048 MB (process RSS)",
        "  time split: data 25%, forward 50%, backward 24%, optimizer 0%",
        "",
        "settings that cannot change the trajectory (tune applies the chosen ones):",
        HEAD,
        _line("baseline (the config as it is)",
              "     1,234  1,200-1,300       1.00    86 min", ""),
        _line("data.num_workers=2", "     2,469  2,400-2,500       2.00    43 min",
              "chosen (paired)"),
        _line("data.num_workers=4", "-".rjust(10) + " " * 24 + "-".rjust(10),
              "failed: RuntimeError: boom"),
        "",
        "settings that change the trajectory (reported; --apply-trajectory-changes applies the "
        "winners):",
        HEAD,
        _line("train.precision=bf16", "     1,852  1,800-1,900       1.50    58 min",
              "faster (autocast, no scaler)"),
        "",
        "run time at 10 epochs of 640 samples (training only): 86 min -> 43 min (2.00x)"]


def test_the_tables_head_line_counts_tokens_and_cuda_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = _result(info=_info(config=None, tokens_per_sample=16, max_steps=50,
                                planned_samples=1600))
    lines = output.table(result).splitlines()
    assert lines[0] == ("ironloop tune: cpu, 2 CPU cores, load 1.5 0.25 0.0, budget 120 s, "
                        "used 119 s")
    assert lines[1] == ("baseline: 1,234 samples/s (19,750 tokens/s), 12.50 ms/step; peak memory "
                        "2,048 MB (CUDA allocated)")
    assert lines[-1] == "run time at 50 steps (training only): 86 min -> 43 min (2.00x)"
    # max_steps past the configured epochs: the epochs end the run
    result.info = _info(max_steps=100000, planned_samples=6400)
    assert output.table(result).splitlines()[-1].startswith("run time at 10 epochs of 640 ")


def test_the_table_without_a_winner_says_why_tuned_yaml_is_the_input(no_cuda):
    base = _result().baseline
    base.measure.time_split = None
    threads = Row("run.threads=1", {"run.threads": 1}, status="ok", ratio=1.01, projected_s=5100.0,
                  measure=mk(1250.0), verdict="within noise",
                  pairs={"ratios": [1.2, 1.3], "wins": False})
    result = _result(baseline=base, rows=[threads], chosen={}, trajectory={}, speedup=1.0)
    lines = output.table(result).splitlines()
    assert lines[2] == ""  # no time split; and no trajectory table without its rows
    assert "settings that change the trajectory" not in "\n".join(lines)
    assert lines[-2] == ("run time at 10 epochs of 640 samples (training only): 86 min -> "
                         "86 min (1.00x)")
    assert lines[-1] == ("the budget ran out during the paired runs of run.threads=1 (faster in "
                         "every pair measured): tuned.yaml is the input config; rerun with a "
                         "larger --budget to confirm them")
    no_faster = ("no trajectory-free setting was faster beyond the noise (faster in every paired "
                 "run, median more than 5%): tuned.yaml is the input config")
    for pairs in ({"ratios": [1.2, 1.3, 1.2, 1.1], "wins": False},  # all ran
                  {"ratios": [1.2, 1.0], "wins": False},  # one said not faster
                  None):
        threads.pairs = pairs
        assert output.table(result).splitlines()[-1] == no_faster
    threads.pairs = {"ratios": [], "wins": False}  # the budget ended them before the first
    assert output.table(result).splitlines()[-1].startswith("the budget ran out")
    threads.pairs = {"ratios": [1.2, 1.3], "wins": False}
    result.info["plan"] = {"pairs": 2}  # a tune of two pairs: both ran
    assert output.table(result).splitlines()[-1] == no_faster
    result.info["plan"] = {}  # the default: 4 pairs
    assert output.table(result).splitlines()[-1].startswith("the budget ran out")
    threads.pairs = {"ratios": [1.2, 1.3, 1.2, 1.1], "wins": False}
    assert output.table(result).splitlines()[-1] == no_faster
    del result.info["plan"]
    assert output.table(result).splitlines()[-1] == no_faster
    threads.pairs = {"ratios": [1.2, 1.3, 1.2], "wins": False}
    assert output.table(result).splitlines()[-1].startswith("the budget ran out")
    threads.kind = "trajectory"  # only free settings are applied
    assert output.table(result).splitlines()[-1] == no_faster
    threads.kind, result.chosen = "free", {"x": 1}
    assert output.table(result).splitlines()[-1].startswith("run time at")


def test_the_table_of_free_settings_shows_the_baseline_even_with_none_tried(no_cuda):
    result = _result()
    result.rows = [r for r in result.rows if r.kind == "trajectory"]
    lines = output.table(result).splitlines()
    assert lines[4:8] == [
        "settings that cannot change the trajectory (tune applies the chosen ones):", HEAD,
        _line("baseline (the config as it is)", "     1,234  1,200-1,300       1.00    86 min",
              ""), ""]
    assert lines[8].startswith("settings that change the trajectory")


def test_the_time_split_leaves_out_the_parts_under_half_a_percent(no_cuda):
    result = _result()
    result.baseline.measure.time_split = {"other": 0.0}
    assert output.table(result).splitlines()[2] == "  time split: "


def test_set_makes_the_sections_it_needs():
    raw = {"a": 5, "keep": {"x": 1}}
    output._set(raw, "a.b.c", 1)
    output._set(raw, "keep.y", 2)
    output._set(raw, "top", 3)
    assert raw == {"a": {"b": {"c": 1}}, "keep": {"x": 1, "y": 2}, "top": 3}
    assert output._get(Config(), "train.precision") == "fp32"
    assert output._get(Config(), "data.num_workers") == 0


def test_tuned_yaml_from_python_objects_holds_what_differs_and_says_how_to_pass_it_to_fit(
        tmp_path):
    cfg = Config().with_overrides({"train.epochs": 3, "run.dir": str(tmp_path)})
    applied = {"data.num_workers": 2, "run.threads": 1}
    text = output.tuned_yaml(cfg, None, [], applied, "a Net on 1,437 training samples")
    assert text == ("# from ironloop.tune() of a Net on 1,437 training samples: the config's "
                    "keys that differ from the defaults, with the chosen ones\n"
                    "#   data.num_workers: 2\n#   run.threads: 1\n"
                    "# use it: ironloop.fit(model, train_data, config=ironloop.load_config("
                    f"{str(tmp_path / 'tuned.yaml')!r}))\n"
                    + yaml.safe_dump({"run": {"dir": str(tmp_path), "threads": 1},
                                      "train": {"epochs": 3}, "data": {"num_workers": 2}},
                                     sort_keys=False))
    # no data or model section the Python objects replaced (data.name: digits, model.name: mlp)
    assert "digits" not in text and "mlp" not in text
    assert ironloop.load_config(_written(tmp_path, text)) == cfg.with_overrides(applied)
    unchanged = output.tuned_yaml(Config(), None, [], {})
    assert unchanged.splitlines()[1:] == ["#   (no change)", "# use it: ironloop.fit(model, "
                                          "train_data, config=ironloop.load_config("
                                          "'runs/run/tuned.yaml'))"]
    assert ironloop.load_config(_written(tmp_path, unchanged)) == Config()


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tuned.yaml"
    path.write_text(text)
    return path


def test_tuned_yaml_from_a_file_keeps_its_keys_and_the_command_lines(tmp_path):
    from ironloop.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 3\ndata:\n  name: synthetic\n")
    overrides = ["train.batch_size=16", "data.root="]
    cfg = load_config(path, overrides)
    text = output.tuned_yaml(cfg, path, overrides, {"data.num_workers": 2})
    assert text == (f"# ironloop tune {path} train.batch_size=16 data.root=\n"
                    f"#   data.num_workers: 2\n"
                    + yaml.safe_dump({"train": {"epochs": 3, "batch_size": 16},
                                      "data": {"name": "synthetic", "root": "",
                                               "num_workers": 2}}, sort_keys=False))
    plain = load_config(path)
    assert output.tuned_yaml(plain, path, [], {"run.threads": 1}).splitlines()[:2] == [
        f"# ironloop tune {path}", "#   run.threads: 1"]
    assert output.tuned_yaml(cfg, path, overrides, {}).splitlines()[1] == "#   (no change)"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert yaml.safe_load(output.tuned_yaml(load_config(empty), empty, [], {"run.threads": 1})) \
        == {"run": {"threads": 1}}


def test_write_puts_tune_json_and_tuned_yaml_in_run_dir_and_says_how_to_fit_it(
        tmp_path, capsys, no_cuda):
    run = tmp_path / "a" / "run"
    cfg = Config().with_overrides({"run.dir": str(run)})
    result = _result(speedup=2.000049)
    output.write(result, cfg, None, [], {"data.num_workers": 2})
    doc = {"info": result.info, "baseline": result.baseline.to_dict(),
           "trials": [r.to_dict() for r in result.rows], "chosen": {"data.num_workers": 2},
           "trajectory_winners": {"train.precision": "bf16"},
           "applied_trajectory_changes": False, "speedup": 2.0}
    assert (run / "tune.json").read_text() == json.dumps(doc, indent=2) + "\n"
    assert (run / "tuned.yaml").read_text() == output.tuned_yaml(cfg, None, [],
                                                                 {"data.num_workers": 2})
    assert result.paths == {"tune.json": run / "tune.json", "tuned.yaml": run / "tuned.yaml"}
    out = capsys.readouterr().out
    assert out == (output.table(result) + "\n"
                   "the second table's winners change the trajectory and were not applied: "
                   "train.precision=bf16 (--apply-trajectory-changes applies them)\n"
                   f"wrote {run}/tune.json and {run}/tuned.yaml; train with: ironloop.fit("
                   f"model, train_data, config=result.config), or config=ironloop.load_config("
                   f"'{run}/tuned.yaml')\n")
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  dir: {run}\n")
    output.write(result, ironloop.load_config(path), path, [], {"data.num_workers": 2})
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {run}/tune.json and {run}/tuned.yaml; train with: ironloop train "
        f"{run}/tuned.yaml")


def test_write_notes_each_applied_trajectory_change(tmp_path, capsys, no_cuda):
    cfg = Config().with_overrides({"run.dir": str(tmp_path)})
    result = _result(applied_trajectory=True,
                     trajectory={"train.precision": "bf16", "train.batch_size": 128})
    output.write(result, cfg, None, [], {"train.precision": "bf16", "train.batch_size": 128})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:-1] == [
        "notice: --apply-trajectory-changes: train.precision: 'fp32' -> 'bf16' changes the "
        "training trajectory",
        "notice: --apply-trajectory-changes: train.batch_size: 64 -> 128 changes the training "
        "trajectory"]
    assert json.loads((tmp_path / "tune.json").read_text())["applied_trajectory_changes"] is True
    result = _result(trajectory={})
    output.write(result, cfg, None, [], {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == output.table(result).splitlines()[-1] and lines[-1].startswith("wrote ")


def test_a_run_dir_that_cannot_be_written_is_a_one_line_error(tmp_path, no_cuda):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = Config().with_overrides({"run.dir": str(blocker / "run")})
    result = _result()
    with pytest.raises(UserError) as raised:
        output.write(result, cfg, None, [], {})
    assert str(raised.value) == (f"run.dir {blocker / 'run'} cannot be created or written (Not a "
                                 f"directory); choose a writable run.dir")
    assert isinstance(raised.value.__cause__, OSError) and result.paths == {}


def test_a_tune_that_chose_nothing_is_named_by_the_advice_instead_of_running_it_again(
        tmp_path, capsys, no_cuda, monkeypatch):
    from ironloop.outputs.time_split import RunSettings, advice, tuned_none
    from ironloop.tools.doctor import data_checks, env_checks

    monkeypatch.setattr(sys, "argv", ["ironloop", "train", "c.yaml"])
    slow_data = {"data": 4.0, "forward": 3.0, "backward": 3.0}
    cfg = Config().with_overrides({"run.dir": str(tmp_path)})
    assert tuned_none(tmp_path) == ""  # no tune here: the advice sends the user to one
    (line,) = advice(slow_data, RunSettings(cores=4))
    assert line.endswith("`ironloop tune c.yaml` measures the options on this run and writes a "
                         "faster config")
    output.write(_result(), cfg, None, [], {"data.num_workers": 2})  # this tune chose one
    assert tuned_none(tmp_path) == ""
    output.write(_result(chosen={}), cfg, None, [], {})  # and this one found nothing faster
    found = tuned_none(tmp_path)
    assert found == str(tmp_path / "tune.json")
    (line,) = advice(slow_data, RunSettings(cores=4, tuned_none=found))
    assert line.endswith(f"the tune in {found} measured this run.dir's config and found no "
                         f"trajectory-free setting faster beyond the noise")
    assert "ironloop tune" not in line
    fix = data_checks.loader_fix(types.SimpleNamespace(cfg=cfg, device=torch.device("cpu")),
                                 2.0, 1.0)  # the preflight's input_bound fix says the same
    assert fix.endswith(f"; the tune in {found} measured this run.dir's config and found no "
                        f"trajectory-free setting faster beyond the noise")
    monkeypatch.setattr(env_checks, "cores", lambda: 4)
    threads = cfg.with_overrides({"run.threads": 4, "data.num_workers": 1, "run.device": "cpu"})
    (f,) = env_checks.check_threads(threads)  # and so does its threads finding
    assert f.fix == (f"if the loader is the bottleneck, set run.threads=3 (the tune in {found} "
                     f"measured this run.dir's config and found no trajectory-free setting "
                     f"faster beyond the noise)")
    (tmp_path / "tune.json").write_text("not json")
    assert tuned_none(tmp_path) == ""
