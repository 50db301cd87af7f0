"""The Python API page as a reader sees it: the public names with their members and docstrings,
nothing inherited from ``object`` or ``dataclass`` (no ``__weakref__`` headings)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ironloop.callbacks import HOOKS
from tests.conftest import REPO


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[Path, str]:
    """The site as ./scripts/docs builds it, and the build's output."""
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-3000:]}"
    return Path(out), r.stdout + r.stderr


@pytest.fixture(scope="module")
def api_page(build) -> str:
    return (build[0] / "reference" / "api.html").read_text()


def test_the_build_does_not_run_the_cli(build):
    # the docs' inspection imports ironloop.__main__: it must not parse mkdocs' own arguments
    assert "invalid choice" not in build[1] and "usage: ironloop" not in build[1]


def headings(page: str) -> list[str]:
    return re.findall(r'<h[2-6] id="([^"]+)"', page)


def test_no_heading_of_the_api_page_is_a_dunder_or_a_dataclass_internal(api_page):
    dunders = [h for h in headings(api_page) if "__" in h]
    assert not dunders, f"api.html lists Python internals as members: {dunders}"
    assert "_MISSING_TYPE" not in api_page and " object at 0x" not in api_page


def test_callbacks_hooks_and_fit_results_fields_are_listed(api_page):
    found = headings(api_page)
    missing = [h for h in HOOKS if f"ironloop.callbacks.Callback.{h}" not in found]
    assert not missing, f"Callback's hooks missing from api.html: {missing}"
    fit_result = api_page[api_page.index('id="ironloop.FitResult"'):
                          api_page.index('id="ironloop.tune"')]
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fit_result)).split())
    assert all(f" {field} " in text for field in ("model", "results", "run_dir")), text
