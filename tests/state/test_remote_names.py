"""checkpoint.remote's object names as untrusted input: a name that is not one ironloop writes
(a Unicode-digit step, a stray file) is skipped, never an exit 1, and a manifest the resume
cannot read keeps every object it names (nothing is deleted that was not read and verified).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest

from ironloop.state.remote.store import open_remote
from tests.state.test_remote import StopAt, _config, _equal, _fit, s3, s3_server, uninterrupted

__all__ = ["s3", "s3_server", "uninterrupted"]  # fixtures shared with test_remote.py

ARABIC_546 = "step-\u0660\u0660\u0660\u0660\u0660\u0665\u0664\u0666"  # step-٠٠٠٠٠٥٤٦


def _stopped_at_12(tmp_path: Path, url: str) -> tuple[dict, int]:
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    steps = open_remote(url).manifests()
    assert steps[-1] == 12 and len(steps) >= 2
    return config, steps[-2]


def test_a_unicode_digit_object_name_is_not_a_step_and_blocks_no_resume(tmp_path, capsys,
                                                                       uninterrupted):
    url = f"file://{tmp_path}/remote"
    config, _ = _stopped_at_12(tmp_path, url)
    remote = open_remote(url)
    for rel in (f"manifests/{ARABIC_546}.json", f"{ARABIC_546}.pt", f"logs/{ARABIC_546}"):
        remote.write(rel if not rel.startswith("logs/") else f"{rel}/run.json", b"{}")
    assert remote.manifests()[-1] == 12 and 546 not in remote.step_objects()
    resumed = _fit(config, resume=True)  # a local resume: the store is listed all the same
    assert _equal(resumed, uninterrupted)
    assert (tmp_path / "remote" / "manifests" / f"{ARABIC_546}.json").exists()  # not ours


def _objects(fs, root: str) -> set[str]:
    return {p[len(root) + 1:] for p in fs.find(root)}


@pytest.mark.parametrize("where", ["file", "s3"])
def test_after_a_resume_past_an_unreadable_manifest_every_object_it_named_is_kept(
        tmp_path, capsys, request, where):
    if where == "s3":
        url, fs = request.getfixturevalue("s3")
        root = url.removeprefix("s3://")
    else:
        url, fs, root = f"file://{tmp_path}/remote", fsspec.filesystem("file"), \
            f"{tmp_path}/remote"
    config, _ = _stopped_at_12(tmp_path, url)
    remote = open_remote(url)
    rel = "manifests/step-00000012.json"
    manifest = json.loads(remote.read(rel))
    named = {rel, *manifest["files"], *manifest["logs"]}
    remote.write(rel, json.dumps({**manifest, "files": list(manifest["files"])}).encode())
    shutil.rmtree(tmp_path / "run")  # a new node
    _fit(config, resume=True)  # on to the end: retention runs past step 12 several times
    out = capsys.readouterr().out
    assert "step-00000012 is damaged" in out
    assert named <= _objects(fs, root), named - _objects(fs, root)
