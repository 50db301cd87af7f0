"""The shipped recipes keep the accuracy their header states (one seed each; the header gives
the spread over seeds 0-2, and the margin below covers it)."""

from __future__ import annotations

import re

import pytest

from ironloop.config import load_config
from ironloop.tools.recipe import train_config
from tests.conftest import REPO

pytestmark = pytest.mark.slow

#: Percentage points below the stated figure that a single seed may land.
MARGIN = 1.0


def stated(name: str) -> tuple[str, float]:
    """The metric and accuracy a config's header states, e.g. "# Measured: test acc 97.9%"."""
    header = (REPO / "configs" / f"{name}.yaml").read_text()
    m = re.search(r"^# Measured: (test|val) acc (\d+\.\d+)%", header, re.M)
    assert m, f"configs/{name}.yaml must state its measured accuracy in its header"
    return m.group(1), float(m.group(2))


@pytest.mark.parametrize("name", ["digits", "mnist1d"])
def test_recipe_meets_its_stated_accuracy(tmp_path, name):
    metric, figure = stated(name)
    cfg = load_config(REPO / "configs" / f"{name}.yaml",
                      [f"run.dir={tmp_path / name}", "log.progress=off",
                       "checkpoint.enabled=false", "run.seed=0"])
    results = train_config(cfg).results
    acc = results["test_acc"] if metric == "test" else results["final_val_acc"]
    assert 100 * acc >= figure - MARGIN, (name, acc, figure)
