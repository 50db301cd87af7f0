"""``ironloop.fit`` (the preflight doctor when doctor.preflight asks for it) and ``ironloop
train``'s path from a config (tools/recipe.py), with the doctor and the loop recorded instead
of run: what each is given.

Then (slow) the shipped recipes keep the accuracy their header states (one seed each; the
header gives the spread over seeds 0-2, and the margin below covers it)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from ironloop.config import load_config
from ironloop.engine.build import Given
from ironloop.tools import recipe
from ironloop.tools.recipe import train_config
from tests.conftest import REPO, blobs, tiny_mlp


@pytest.fixture
def calls(monkeypatch):
    """Every call to the loop, the preflight, the run.dir check and the lock, in order."""
    seen: list[tuple] = []

    def train_run(cfg, model, data, given, peeked=None):
        seen.append(("fit", model, data, cfg, given))
        return "result"

    def preflight(cfg, model, bundle, **kwargs):
        seen.append(("preflight", cfg, model, bundle, kwargs))

    @contextlib.contextmanager
    def hold(run_dir, enabled=True):
        seen.append(("hold", run_dir, enabled))
        yield

    monkeypatch.setattr(recipe.engine, "train_run", train_run)
    monkeypatch.setattr(recipe, "preflight", preflight)
    monkeypatch.setattr(recipe, "check_run_dir", lambda *args: seen.append(("check", *args)))
    monkeypatch.setattr(recipe.lock, "hold", hold)
    monkeypatch.delenv("RANK", raising=False)
    return seen


@pytest.mark.parametrize("preflight", [None, False])
def test_fit_goes_straight_to_the_loop_without_the_preflight(calls, preflight, tmp_path):
    model, train, val = tiny_mlp(), blobs(8), blobs(4)
    config = {"run.dir": str(tmp_path), "doctor.preflight": preflight}
    assert recipe.fit(model, train, val, config, num_classes=3) == "result"
    assert [c[0] for c in calls] == ["hold", "fit"]  # run.dir held at the front door, once
    _, m, data, cfg, given = calls[1]
    assert (m, data.train, data.val, cfg.run.dir) == (model, train, val, str(tmp_path))
    assert given == Given(num_classes=3)


def test_the_public_fit_is_the_front_door_with_its_documented_signature():
    import inspect

    import ironloop

    assert ironloop.fit is recipe.fit and "__wrapped__" not in vars(recipe.fit)
    assert list(inspect.signature(recipe.fit).parameters) == [
        "model", "train_data", "val_data", "config", "loss_fn", "step_fn", "test_data",
        "num_classes", "optimizer", "scheduler", "callbacks", "metrics", "resume",
        "overwrite", "allow_config_change", "from_config"]
    assert recipe.fit.__doc__.startswith("Train ``model`` on ``train_data``")


def test_fit_with_the_preflight_holds_and_checks_run_dir_before_the_doctor(calls, tmp_path):
    model, train, val, test = tiny_mlp(), blobs(8), blobs(4), blobs(2)
    step, loss = object(), object()
    config = {"run.dir": str(tmp_path), "doctor.preflight": True}
    # (resume and overwrite together are refused: tests/e2e/test_bad_inputs_round3.py)
    assert recipe.fit(model, train, val, config, test_data=test, num_classes=3, resume=True,
                      step_fn=step, loss_fn=loss) == "result"
    assert [c[0] for c in calls] == ["hold", "check", "preflight", "fit"]
    assert calls[0][1:] == (Path(tmp_path), True)
    assert calls[1][1:] == (Path(tmp_path), True, False)
    _, cfg, m, bundle, kwargs = calls[2]
    assert (cfg.doctor.preflight, m) == (True, model)
    assert (bundle.train, bundle.val, bundle.test, bundle.num_classes, bundle.input_shape) == \
        (train, val, test, 3, ())
    assert kwargs == {"resume": True, "step_fn": step, "loss_fn": loss}
    assert calls[3][1:4] == (model, bundle, cfg)  # the preflight's data and config, the same
    assert calls[3][4] == Given(num_classes=3, resume=True, step_fn=step, loss_fn=loss)


def test_fit_with_the_preflight_and_no_flags_checks_run_dir_as_a_fresh_run_never_overwriting(
        calls, tmp_path):
    """Without resume= or overwrite=, run.dir is checked as a fresh run's: a finished run
    there is refused, never overwritten (seed 8's _checked_fit_37)."""
    recipe.fit(tiny_mlp(), blobs(8), None, {"run.dir": str(tmp_path), "doctor.preflight": True})
    assert [c for c in calls if c[0] == "check"] == [("check", Path(tmp_path), False, False)]


def test_fit_with_the_preflight_on_another_rank_leaves_run_dir_to_rank_0(calls, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("RANK", "1")
    recipe.fit(tiny_mlp(), blobs(8), None, {"run.dir": str(tmp_path), "doctor.preflight": True})
    assert [c[0] for c in calls] == ["hold", "preflight", "fit"]
    assert calls[0][2] is False
    assert calls[1][4] == {"resume": False, "step_fn": None, "loss_fn": None}


def test_train_builds_the_configs_data_and_model_and_asks_for_the_preflight(calls, tmp_path):
    cfg = load_config(None, ["data.name=tests.resume_cases:clean_data", "model.name=mlp",
                             "model.kwargs={hidden: [4]}", f"run.dir={tmp_path}"])
    assert cfg.doctor.preflight is None
    assert recipe.train_config(cfg, resume="last", allow_config_change=True) == "result"
    assert [c[0] for c in calls] == ["hold", "check", "preflight", "fit"]
    assert calls[1][1:] == (Path(tmp_path), "last", False)
    _, checked, model, bundle, kwargs = calls[2]
    # null is ironloop train's default (the preflight runs): the config is not rewritten
    assert checked == cfg and kwargs["resume"] == "last"
    assert bundle.num_classes == 3 and model(bundle.train[0][0][None]).shape == (1, 3)
    _, m, data, fit_cfg, given = calls[3]
    assert (m, data, fit_cfg) == (model, bundle, checked)
    assert given == Given(num_classes=3, resume="last", allow_config_change=True,
                          from_config=True)
    calls.clear()
    recipe.train_config(cfg.with_overrides({"doctor.preflight": False}))
    assert calls[2][1].doctor.preflight is False  # the doctor itself skips its checks
    assert calls[3][4] == Given(num_classes=3, from_config=True)


def test_train_under_the_cli_does_not_take_run_dir_again(calls, tmp_path):
    """ironloop train holds run.dir from before torch's import (cli.py) and says so: the front
    door checks run.dir and runs the preflight under that hold, without a second one."""
    cfg = load_config(None, ["data.name=tests.resume_cases:clean_data", "model.name=mlp",
                             "model.kwargs={hidden: [4]}", f"run.dir={tmp_path}"])
    recipe.train_config(cfg, run_dir_held=True)
    assert [c[0] for c in calls] == ["check", "preflight", "fit"]


#: Percentage points below the stated figure that a single seed may land.
MARGIN = 1.0


def stated(name: str) -> tuple[str, float]:
    """The metric and accuracy a config's header states, e.g. "# Measured: test acc 97.9%"."""
    header = (REPO / "configs" / f"{name}.yaml").read_text()
    m = re.search(r"^# Measured: (test|val) acc (\d+\.\d+)%", header, re.M)
    assert m, f"configs/{name}.yaml must state its measured accuracy in its header"
    return m.group(1), float(m.group(2))


@pytest.mark.parametrize("name", ["digits", "mnist1d"])
def test_a_recipe_headers_figures_are_dated_and_name_the_command(name):
    """Every percentage and second in a header is dated (their 98.0% and 98.3% had gone stale
    with no date to say so), and the measured figure names the command that gives it."""
    header = "".join(line for line in (REPO / "configs" / f"{name}.yaml").read_text()
                     .splitlines(keepends=True) if line.startswith("#"))
    stanzas = re.split(r"^# (?=[A-Z][a-z]+:)", header, flags=re.M)[1:]  # Measured:, Time:
    figures = [s for s in stanzas if re.search(r"\d+(\.\d+)?(%| s\b)", s)]
    assert figures, header
    undated = [s for s in figures if not re.search(r"\b20\d\d-\d\d-\d\d\b", s)]
    assert not undated, f"configs/{name}.yaml: figures without a date: {undated}"
    assert f"`ironloop train configs/{name}.yaml" in header.replace("\n# ", " ")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits", "mnist1d"])
def test_recipe_meets_its_stated_accuracy(tmp_path, name):
    metric, figure = stated(name)
    cfg = load_config(REPO / "configs" / f"{name}.yaml",
                      [f"run.dir={tmp_path / name}", "log.progress=off",
                       "checkpoint.enabled=false", "run.seed=0"])
    results = train_config(cfg).results
    acc = results["test_acc"] if metric == "test" else results["final_val_acc"]
    assert 100 * acc >= figure - MARGIN, (name, acc, figure)
