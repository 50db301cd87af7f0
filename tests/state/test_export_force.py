"""``export --force`` replaces only a regular file: a folder, a symlink or a device node at
--out is refused in one line and left as it was."""

from __future__ import annotations

import os

import pytest

from ironloop.errors import UserError
from ironloop.state.export import export_run


@pytest.mark.parametrize("kind", ["symlink", "device"])  # a folder: test_export.py
def test_force_refuses_an_out_that_is_not_a_regular_file(kind, tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("thesis")
    if kind == "folder":
        out.mkdir()
    elif kind == "symlink":
        out.symlink_to(victim)
    else:
        os.symlink("/dev/null", out)  # a link to a device node
    with pytest.raises(UserError, match="not a regular file|is a directory"):
        export_run(tmp_path / "run", out, force=True)
    assert victim.read_text() == "thesis"
    assert out.is_dir() if kind == "folder" else out.is_symlink()  # left as it was
