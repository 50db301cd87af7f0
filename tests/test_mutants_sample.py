"""scripts/mutants_sample.py: the draw behind `./scripts/mutants sample N` is seeded and per
package, and its interval is Wilson's (the score a sample reports for ~12,000 mutants)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("mutants_sample",
                                              REPO / "scripts" / "mutants_sample.py")
assert spec is not None and spec.loader is not None
sample = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sample)


def _names() -> list[str]:
    sizes = {"engine": 50, "state": 30, "guard": 8, "data": 20, "tools": 40, "outputs": 12,
             "parallel": 10}
    return [f"ironloop.{p}.mod.x_f__mutmut_{i}" for p, n in sizes.items() for i in range(n)]


def test_the_draw_is_per_package_seeded_and_takes_all_of_a_small_package():
    drawn = sample.draw(_names(), 70, seed=0)
    per = {p: sum(m.split(".")[1] == p for m in drawn) for p in sample.PACKAGES}
    assert per == {"engine": 10, "state": 10, "guard": 8, "data": 10, "tools": 10, "outputs": 10,
                   "parallel": 10}
    assert len(set(drawn)) == len(drawn)
    assert drawn == sample.draw(list(reversed(_names())), 70, seed=0)  # the input's order aside
    assert drawn != sample.draw(_names(), 70, seed=1)


def test_the_interval_is_wilsons():
    lo, hi = sample.wilson(90, 100)
    assert (lo, hi) == pytest.approx((0.8256, 0.9448), abs=1e-4)
    assert sample.wilson(0, 0) == (0.0, 1.0)
    lo, hi = sample.wilson(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.7225, abs=1e-4)


def test_timeouts_count_as_caught_and_segfaults_do_not(capsys):
    names = [f"ironloop.{p}.m.x_f__mutmut_{i}" for p in sample.PACKAGES for i in range(2)]
    codes = dict.fromkeys(names, 1)
    codes[names[0]], codes[names[1]] = 36, -11  # engine: a timeout and a segfault
    codes[names[2]] = 0  # state: one survivor
    rows = sample.report(names, codes, {p: 2 for p in sample.PACKAGES})
    assert rows["engine"]["caught"] == 1 and rows["state"]["caught"] == 1
    # 14 drawn, 2 per package: 12 caught, all packages the same size
    assert rows["guard"]["caught"] == 2 and rows["all"]["caught"] == 12
    assert rows["weighted"] == pytest.approx(12 / 14)
    out = capsys.readouterr().out
    assert "segfault" in out and "survived" in out and names[1] in out


def test_a_run_restricted_to_some_packages_scores_only_those():
    # a practice run's [tool.mutmut] may mutate tools/ alone: the other packages have no mutants
    names = [f"ironloop.tools.m.x_f__mutmut_{i}" for i in range(4)]
    codes = {names[0]: 1, names[1]: 1, names[2]: 1, names[3]: 0}
    rows = sample.report(names, codes, {"tools": 40})
    assert rows["tools"]["caught"] == 3 and rows["engine"]["ran"] == 0
    assert rows["weighted"] == pytest.approx(3 / 4)
    assert sample.draw([f"ironloop.tools.m.x_f__mutmut_{i}" for i in range(40)], 70, 0) != []
