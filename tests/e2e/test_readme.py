"""The README's and the docs' Python examples run as written, and their claims hold."""

from __future__ import annotations

import re

from tests.conftest import REPO


def _python_blocks(path: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / path).read_text(), re.S)


def test_readme_python_example_runs(tmp_path, monkeypatch):
    block = _python_blocks("README.md")[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["result"].results["best_val_acc"] >= 0.9  # "about 0.95"
    assert (tmp_path / "runs" / "quickstart" / "epochs.jsonl").exists()


def test_the_tutorial_trains_the_readme_example():
    # One example, run above: the tutorial's "your own model in ten lines" is the README's.
    assert _python_blocks("docs/tutorial/getting-started.md")[0] == _python_blocks("README.md")[0]


def test_python_howto_examples_run(tmp_path, monkeypatch):
    block = _python_blocks("docs/how-to/python.md")[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "docs/how-to/python.md", "exec"), namespace)  # noqa: S102 - our docs
    assert namespace["result"].results["best_val_acc"] >= 0.9
    epochs = (tmp_path / "runs" / "readme-regression" / "epochs.jsonl").read_text()
    assert '"val_mae"' in epochs


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["./scripts/demo", "./scripts/test"]
