"""The data pages run as written (issue 57, item 5): streams.md's two `ironloop train`
commands on its own shards.py, and map-style-data.md's Hugging Face snippet; its first snippet
names nothing it does not define."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_cli
from tests.stream_data import write_files

DOCS = REPO / "docs" / "how-to"


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def test_the_streams_commands_run_as_written(tmp_path):
    page = DOCS / "streams.md"
    (tmp_path / "shards.py").write_text("\n\n".join(_blocks(page)[:2]))  # both in shards.py
    write_files(tmp_path / "data", "jsonl", shards=2)
    write_files(tmp_path / "data", "tar", shards=2)
    commands = re.findall(r"`(ironloop train [^`]*)`", page.read_text())
    assert len(commands) == 2, commands
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "src"), str(REPO)])}
    for i, command in enumerate(commands):
        args = [*shlex.split(command)[1:], f"run.dir=run{i}"]
        r = run_cli(*args, cwd=tmp_path, env=env)
        assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        assert (tmp_path / f"run{i}" / "results.json").is_file()


def test_the_map_style_snippets_define_what_they_use_and_the_hf_one_runs(tmp_path):
    first, hf = _blocks(DOCS / "map-style-data.md")[:2]
    for i, code in enumerate((first, hf)):
        (tmp_path / f"b{i}.py").write_text(code)
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821",
                        str(tmp_path / "b0.py"), str(tmp_path / "b1.py")],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"undefined names in map-style-data.md:\n{r.stdout}"
    r = subprocess.run([sys.executable, str(tmp_path / "b1.py")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "runs" / "hf" / "results.json").is_file()
