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
from ironloop.tools import recipe
from ironloop.tools.recipe import train_config
from tests.conftest import REPO, blobs, tiny_mlp


@pytest.fixture
def calls(monkeypatch):
    """Every call to the loop, the preflight, the run.dir check and the lock, in order."""
    seen: list[tuple] = []

    def fit(model, train, val, cfg, **kwargs):
        seen.append(("fit", model, train, val, cfg, kwargs))
        return "result"

    def preflight(cfg, model, bundle, **kwargs):
        seen.append(("preflight", cfg, model, bundle, kwargs))

    @contextlib.contextmanager
    def hold(run_dir, enabled=True):
        seen.append(("hold", run_dir, enabled))
        yield

    monkeypatch.setattr(recipe.engine, "fit", fit)
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
    assert [c[0] for c in calls] == ["fit"]
    _, m, t, v, cfg, kwargs = calls[0]
    assert (m, t, v, cfg.run.dir, kwargs) == (model, train, val, str(tmp_path),
                                             {"num_classes": 3})


def test_the_public_fit_carries_the_loops_signature_and_documentation():
    import inspect

    from ironloop.engine.fit import fit

    assert recipe.fit.__wrapped__ is fit and recipe.fit.__doc__ == fit.__doc__
    assert inspect.signature(recipe.fit) == inspect.signature(fit)


def test_fit_with_the_preflight_holds_and_checks_run_dir_before_the_doctor(calls, tmp_path):
    model, train, val, test = tiny_mlp(), blobs(8), blobs(4), blobs(2)
    step, loss = object(), object()
    config = {"run.dir": str(tmp_path), "doctor.preflight": True}
    assert recipe.fit(model, train, val, config, test_data=test, num_classes=3, resume=True,
                      overwrite=True, step_fn=step, loss_fn=loss) == "result"
    assert [c[0] for c in calls] == ["hold", "check", "preflight", "fit"]
    assert calls[0][1:] == (Path(tmp_path), True)
    assert calls[1][1:] == (Path(tmp_path), True, True)
    _, cfg, m, bundle, kwargs = calls[2]
    assert (cfg.doctor.preflight, m) == (True, model)
    assert (bundle.train, bundle.val, bundle.test, bundle.num_classes, bundle.input_shape) == \
        (train, val, test, 3, ())
    assert kwargs == {"resume": True, "step_fn": step, "loss_fn": loss}
    assert calls[3][1:4] == (model, train, val)
    assert calls[3][5] == {"test_data": test, "num_classes": 3, "resume": True,
                           "overwrite": True, "step_fn": step, "loss_fn": loss}


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
    assert recipe.train_config(cfg, resume="last", overwrite=True,
                               allow_config_change=True) == "result"
    assert [c[0] for c in calls] == ["hold", "check", "preflight", "fit"]
    assert calls[1][1:] == (Path(tmp_path), "last", True)
    _, checked, model, bundle, kwargs = calls[2]
    assert checked.doctor.preflight is True and kwargs["resume"] == "last"
    assert bundle.num_classes == 3 and model(bundle.train[0][0][None]).shape == (1, 3)
    _, m, train, val, fit_cfg, fit_kwargs = calls[3]
    assert (m, train, val, fit_cfg) == (model, bundle.train, bundle.val, checked)
    assert fit_kwargs == {"test_data": bundle.test, "num_classes": 3, "resume": "last",
                          "overwrite": True, "allow_config_change": True, "from_config": True}
    calls.clear()
    recipe.train_config(cfg.with_overrides({"doctor.preflight": False}))
    assert calls[2][1].doctor.preflight is False  # the doctor itself skips its checks
    assert calls[3][5] == {"test_data": None, "num_classes": 3, "resume": False,
                           "overwrite": False, "allow_config_change": False,
                           "from_config": True}


#: Percentage points below the stated figure that a single seed may land.
MARGIN = 1.0


def stated(name: str) -> tuple[str, float]:
    """The metric and accuracy a config's header states, e.g. "# Measured: test acc 97.9%"."""
    header = (REPO / "configs" / f"{name}.yaml").read_text()
    m = re.search(r"^# Measured: (test|val) acc (\d+\.\d+)%", header, re.M)
    assert m, f"configs/{name}.yaml must state its measured accuracy in its header"
    return m.group(1), float(m.group(2))


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
