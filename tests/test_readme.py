"""The README's Python example runs as written, and its claim holds."""

from __future__ import annotations

import re

from tests.conftest import REPO


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["result"].results["best_val_acc"] >= 0.9
    assert (tmp_path / "runs" / "readme-regression" / "epochs.jsonl").exists()
    epochs = (tmp_path / "runs" / "readme-regression" / "epochs.jsonl").read_text()
    assert '"val_mae"' in epochs


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["./scripts/demo", "./scripts/test"]
