"""A lean install: the base dependencies, the extras, and the error a missing extra gives; what
./scripts/demo installs (the [demo] extra, whose closure is read from the installed packages'
metadata, no network: none of the heavy extras the test suite needs)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from ironloop.config import DataConfig
from ironloop.data import build_data
from ironloop.errors import UserError
from ironloop.tools.plots import plot_lr
from tests.conftest import REPO

HEAVY = ("scikit-learn", "sklearn", "matplotlib", "mnist1d", "tensorboard", "wandb", "mlflow",
         "fsspec", "s3fs", "gcsfs", "torchmetrics")


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI, in the test extra
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_dependencies_are_lean_and_all_has_every_extra():
    project = _pyproject()["project"]
    names = [d.split(">")[0].split("=")[0].split("[")[0].strip().lower()
             for d in project["dependencies"]]
    assert sorted(names) == ["numpy", "pyyaml", "safetensors", "torch", "tqdm"]
    extras = project["optional-dependencies"]
    assert {"data", "plots", "tensorboard", "wandb", "mlflow", "all"} <= set(extras)
    every = {d for name, deps in extras.items() if name != "all" for d in deps}
    assert every == set(extras["all"])


def test_importing_ironloop_imports_no_extra():
    code = ("import sys, ironloop, ironloop.cli, ironloop.tools.recipe, ironloop.tools.report; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def test_a_missing_extra_names_what_to_install(monkeypatch, tmp_path):
    # None in sys.modules makes `import sklearn` raise ImportError, as if it were not installed.
    for name in ("sklearn", "sklearn.datasets", "mnist1d", "mnist1d.data"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"data\.name=digits needs the sklearn package.*"
                                        r"pip install 'ironloop\[data\]'"):
        build_data(DataConfig(name="digits"))
    with pytest.raises(UserError, match=r"ironloop\[data\]"):
        build_data(DataConfig(name="mnist1d"))
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"pip install 'ironloop\[plots\]'"):
        plot_lr({"run": [{"step": 1, "lr": 0.1}]}, tmp_path / "lr.png")


def test_a_tracker_that_is_not_installed_names_its_extra(monkeypatch, tmp_path):
    from ironloop.config import Config
    from ironloop.outputs import loggers

    for name in ("wandb", "mlflow", "mlflow.tracking", "mlflow.entities"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"log\.wandb=true needs the wandb package.*"
                                        r"pip install 'ironloop\[wandb\]'"):
        loggers.WandB(Config(), tmp_path, None)
    with pytest.raises(UserError, match=r"log\.mlflow=true needs the mlflow package.*"
                                        r"pip install 'ironloop\[mlflow\]'"):
        loggers.MLflow(Config(), tmp_path, None)
    # torch is installed; what torch.utils.tensorboard imports, and misses, is tensorboard
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(UserError, match=r"log\.tensorboard=true needs the tensorboard package.*"
                                        r"pip install 'ironloop\[tensorboard\]'"):
        loggers.TensorBoard(tmp_path, None)


#: what ./scripts/demo must not install: the test suite's heavy extras
DEMO_LEAVES_OUT = {"lightning", "pytorch-lightning", "transformers", "mlflow", "wandb", "mkdocs",
                   "moto", "playwright", "datasets", "tensorboard", "mutmut"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> set[str]:
    """Every distribution these requirements pull in, read off the installed metadata."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        for sub in metadata.requires(req.name) or []:
            if req.extras:  # the extras asked for, as pip resolves them
                wanted = any(Requirement(sub).marker is not None and
                             Requirement(sub).marker.evaluate({"extra": e}) for e in req.extras)
                if wanted:
                    todo.append(Requirement(sub.split(";")[0]))
            todo.append(Requirement(sub))
    return seen


def test_the_demos_install_pulls_in_none_of_the_heavy_extras():
    project = _pyproject()["project"]
    demo = closure([*project["dependencies"], *project["optional-dependencies"]["demo"]])
    assert {"torch", "scikit-learn", "matplotlib"} <= demo
    heavy = sorted(demo & DEMO_LEAVES_OUT)
    assert not heavy, f"./scripts/demo would install {heavy}"
    # the whole install does pull them in: the check reads a real closure
    assert {"lightning", "mkdocs"} <= closure(project["optional-dependencies"]["all"])


def test_scripts_demo_asks_for_the_demo_extra_and_says_what_the_first_run_costs():
    demo, env = (REPO / "scripts" / "demo").read_text(), (REPO / "scripts" / "_env").read_text()
    assert demo.index("IRONLOOP_EXTRAS=demo") < demo.index('source "$(dirname "$0")/_env"')
    assert 'EXTRAS=${IRONLOOP_EXTRAS:-all}' in env and '-e ".[$EXTRAS]"' in env
    assert "first run" in demo
