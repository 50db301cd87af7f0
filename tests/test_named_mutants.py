"""scripts/named_mutants.py: every named mutant still points at today's code and tests, so a
rename or a move fails the fast suite instead of leaving `./scripts/mutants named` broken."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("named_mutants",
                                              REPO / "scripts" / "named_mutants.py")
assert spec is not None and spec.loader is not None
named = importlib.util.module_from_spec(spec)
sys.modules["named_mutants"] = named  # its dataclass looks its module up there
spec.loader.exec_module(named)


def test_there_are_twelve_named_mutants_with_distinct_names():
    assert len(named.MUTANTS) == 12
    assert len({m.name for m in named.MUTANTS}) == 12


@pytest.mark.parametrize("mutant", named.MUTANTS, ids=lambda m: m.name)
def test_each_old_string_is_in_its_file_exactly_once_and_changes_it(mutant):
    text = (named.SRC / mutant.file).read_text(encoding="utf-8")
    assert named.mutated(mutant, text) != text  # raises MovedCode when not found exactly once


@pytest.mark.parametrize("mutant", named.MUTANTS, ids=lambda m: m.name)
def test_each_named_test_exists_and_is_not_marked_slow(mutant):
    # collecting would take seconds per file: the definition, and the decorator above it
    for node in mutant.tests:
        file, name = node.split("::")
        source = (REPO / file).read_text(encoding="utf-8")
        found = re.search(rf"((?:^@.*\n)*)^def {name}\(", source, re.M)
        assert found is not None, f"{node} is not defined: update MUTANTS"
        slow = "slow" in found.group(1) or re.search(r"^pytestmark = .*slow", source, re.M)
        assert not slow, f"{node} is marked slow: the fast suite misses it"


def test_a_moved_line_is_an_error_naming_the_mutant():
    m = named.MUTANTS[0]
    with pytest.raises(named.MovedCode, match=f"mutant {m.name}: .* 0 times"):
        named.mutated(m, "")
    old = m.edits[0][0]
    with pytest.raises(named.MovedCode, match="2 times"):
        named.mutated(m, old + "\n" + old)
