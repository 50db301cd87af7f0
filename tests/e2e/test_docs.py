"""The docs site: ./scripts/docs's build (mkdocs --strict) with no warnings; its generated reference
holds every config key, CLI command and flag, fit()'s parameters and the files a run writes; the
README is a short front page that links into it; the pages render in a real browser."""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import inspect
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ironloop import cli
from ironloop.state.run_dir import OUTPUTS as RUN_OUTPUTS
from tests.conftest import REPO, chromium, open_all_in_browser


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, str]:
    """The site, built as ./scripts/docs builds it (that script only adds the .venv); and the
    build's log."""
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return out, r.stdout + r.stderr


def _text(fragment: str) -> str:
    """What a reader sees of an HTML fragment: tags dropped, entities decoded, spaces squeezed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _sections(page: str, tag: str = "h2") -> dict[str, str]:
    """An HTML page cut at its ``tag`` headings: {heading text: the HTML up to the next one}."""
    parts = re.split(rf"(<{tag}[^>]*>.*?</{tag}>)", page, flags=re.S)
    return {_text(parts[i]).rstrip("¶ "): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_the_site_builds_with_no_warnings(site):
    _, log = site
    assert not [line for line in log.splitlines() if "WARNING" in line], log


def test_every_key_of_train_help_is_on_the_config_page_with_its_doc(site, capsys):
    capsys.readouterr()
    assert cli.main(["train", "help"]) == 0  # `ironloop train help`, in this process
    out = capsys.readouterr().out
    # the help's "(one of: a | b)" is the page's allowed column
    keys = dict(re.match(r"(\S+) = .*?  # (.*?)(?: \(one of: [^)]*\))?$", line).groups()
                for line in out.splitlines())
    assert len(keys) > 50  # the parse above read the help, not an empty page
    page = (site[0] / "reference" / "config.html").read_text()
    rows = {m.group(1): _text(m.group(0)) for m in
            re.finditer(r'<tr>\s*<td><code id="([^"]+)">.*?</tr>', page, re.S)}
    missing = sorted(set(keys) - set(rows))
    assert not missing, f"config keys missing from reference/config.html: {missing}"
    wrong = [k for k, doc in keys.items() if " ".join(doc.split()) not in rows[k]]
    assert not wrong, f"keys whose doc differs from `ironloop train help`: {wrong}"


def test_every_cli_command_and_flag_is_on_the_cli_page(site):
    page = (site[0] / "reference" / "cli.html").read_text()
    sections = _sections(page)
    top = cli.parser()
    subparsers = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) >= {"train", "doctor", "export", "report", "tune", "lab"}
    for name, sub in subparsers.choices.items():
        assert f"ironloop {name}" in sections, f"no section for `ironloop {name}` in cli.html"
        text = _text(sections[f"ironloop {name}"])
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings or [action.metavar or action.dest]:
                assert flag in text, f"`ironloop {name}`: {flag} missing from cli.html"
    assert "--version" in _text(page)


def test_fit_has_an_api_page_listing_its_parameters(site):
    import ironloop

    page = (site[0] / "reference" / "api.html").read_text()
    # under the names a user calls (issue 44: it read ironloop.engine.fit.fit)
    assert {"ironloop.fit", "ironloop.tune", "ironloop.Config"} <= set(_sections(page, "h3"))
    fit_section = _sections(page, "h3")["ironloop.fit"]
    table = _text(fit_section[fit_section.index("Parameters"):])
    params = list(inspect.signature(ironloop.fit).parameters)
    assert "train_data" in params and "callbacks" in params
    missing = [p for p in params if p not in table]
    assert not missing, f"fit() parameters missing from the API page's table: {missing}"
    for name in ("tune", "Callback", "RunView", "Config", "UserError", "ConfigError", "Preempted"):
        assert re.search(rf'<h3 id="[^"]*\b{name}"', page), f"{name} has no entry in api.html"


def test_the_files_page_lists_every_file_a_run_writes(site):
    text = _text((site[0] / "reference" / "run-files.html").read_text())
    missing = [n for n in RUN_OUTPUTS if n not in text]
    assert not missing, f"run outputs missing from reference/run-files.html: {missing}"


def test_the_readme_is_a_short_front_page_linking_the_site():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[^)#]+\.md)(?:#[^)]*)?\)", text)
    assert len(links) >= 5, "the README links into the site's pages"
    assert [link for link in links if not (REPO / link).is_file()] == []
    assert "./scripts/docs" in text


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP, as a reader's browser gets it from a server (the file:// case
    has its own test below)."""
    handler = functools.partial(_QuietHandler, directory=str(site[0]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would bury pytest's output
        pass


PAGES = ("index.html", "how-to/resume.html", "reference/config.html")
WIDTHS = (1280, 420)


@pytest.fixture(scope="module")
def in_chromium(served) -> dict:
    """Each page at each width, as headless Chromium renders it (one browser for them all)."""
    targets = [(f"{served}/{page}", width) for page in PAGES for width in WIDTHS]
    seen = open_all_in_browser(targets, wait_until="networkidle")
    return {(page, width): s for (page, width), s in
            zip([(p, w) for p in PAGES for w in WIDTHS], seen)}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("page", PAGES)
def test_pages_render_in_chromium_without_errors_or_sideways_scroll(in_chromium, page, width):
    seen = in_chromium[page, width]
    assert seen["errors"] == []
    assert seen["overflow"] <= 0, f"{page} scrolls sideways by {seen['overflow']} px at {width}"
    assert [i["name"] for i in seen["images"] if not i["ok"]] == []
    assert len(seen["text"]) > 500  # the page's content, not an error page


def test_the_committed_reference_pages_are_what_the_code_generates():
    """Committed so that the tutorial's and how-tos' links read on GitHub (issue 44: they
    pointed at pages that existed only on the built site); stale ones fail here, naming the
    command that regenerates them."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert not docs_hooks.stale(), (f"{docs_hooks.stale()} differ from the code: run `python "
                                    f"scripts/docs_hooks.py` and commit them")


def test_every_relative_link_in_the_markdown_names_a_file_in_the_repo():
    """What a reader on GitHub follows: docs/, the README and BENCHMARKS.md."""
    pages = [*(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "BENCHMARKS.md"]
    broken = [f"{md.relative_to(REPO)} -> {target}" for md in pages
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text())
              if "://" not in target and not (md.parent / target).exists()]
    assert not broken, broken


def test_a_page_with_a_table_of_contents_has_its_first_heading_near_the_top():
    """The site's table of contents lists a page's ## headings: resume.md had one, 200 lines
    down (Under SLURM), so its contents named only the page's tail."""
    late = {}
    for md in (REPO / "docs").rglob("*.md"):
        lines = md.read_text().splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("## ")), None)
        if first is not None and first > 50:
            late[str(md.relative_to(REPO))] = first + 1
    assert not late, f"first ## heading (line) far below the title: {late}"


def test_search_finds_pages_in_the_site_opened_from_the_file_system(site):
    """The README opens site/index.html from disk (file://), where a page may not fetch the
    search index nor start a Web Worker: mkdocs-material's offline plugin inlines the index as a
    script, and the worker shim it needs is ours (docs/javascripts), not fetched from unpkg."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install playwright)")
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium: apt-get install chromium, or set IRONLOOP_CHROMIUM")
    index = site[0] / "index.html"
    assert "unpkg.com" not in index.read_text()  # no script from the network
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(index.as_uri(), wait_until="load")
            page.locator("input.md-search__input").click(timeout=20_000)
            page.keyboard.type("preemption")
            page.wait_for_selector(".md-search-result__item", timeout=30_000)
            hrefs = [a.get_attribute("href") for a in
                     page.locator(".md-search-result__item a").all()]
        finally:
            browser.close()
    assert any("how-to/resume.html" in (h or "") for h in hrefs), hrefs
