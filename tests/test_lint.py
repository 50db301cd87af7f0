"""ruff on the source and the tests, mypy on the package: both must report nothing. Their rules and
settings are in pyproject.toml ([tool.ruff], [tool.mypy])."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--no-cache", "src", "tests")
    assert r.returncode == 0, f"ruff check src tests:\n{r.stdout}{r.stderr}"


def test_mypy_finds_nothing():
    # The cache is mypy's own (.mypy_cache, git-ignored): a rerun checks only what changed.
    r = _run("mypy", "src/ironloop")
    assert r.returncode == 0, f"mypy src/ironloop:\n{r.stdout}{r.stderr}"


def test_ruff_reads_every_file_under_src():
    """No file is left out by ruff's default excludes (a package named ``dist`` or ``build``
    is skipped as build output: issue 41)."""
    r = _run("ruff", "check", "--no-cache", "--show-files", "src")
    shown = {line.strip() for line in r.stdout.splitlines() if line.strip().endswith(".py")}
    every = {str(p) for p in (REPO / "src").rglob("*.py")}
    assert every and every <= shown, sorted(every - shown)
