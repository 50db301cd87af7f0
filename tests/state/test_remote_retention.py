"""A retention failure after a checkpoint's manifest landed is told as what it is: the step
is in the store, only older ones could not be removed (it read "step N was not uploaded")."""

from __future__ import annotations

import time
import uuid

import pytest

from ironloop.state.remote.mirror import Mirror
from ironloop.state.remote.store import open_remote


@pytest.mark.usefixtures("quick_lease")
def test_a_retention_failure_after_the_manifest_landed_is_not_a_failed_upload(
        tmp_path, monkeypatch):
    remote = open_remote(f"memory://retention-{uuid.uuid4().hex}/prefix")
    said: list[str] = []
    mirror = Mirror(remote, tmp_path / "staging", keep_last=1, retries=0, warn=said.append)

    def outage(step: int) -> None:  # the store stops answering deletes
        raise OSError("connection reset")

    monkeypatch.setattr(remote, "remove_checkpoint", outage)
    for step in (1, 2):
        path = tmp_path / "ck" / f"step-{step:08d}.pt"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(f"weights {step}".encode())
        mirror.push(step, {path.name: path}, "file", False, {})
        deadline = time.monotonic() + 10
        while step not in mirror.uploaded + mirror.failed and time.monotonic() < deadline:
            time.sleep(0.01)
    mirror.close()
    assert remote.manifests() == [1, 2] and mirror.failed == []
    assert not any("not uploaded" in line for line in said), said
    assert any("step 2 was uploaded" in line and "removing older ones failed" in line
               for line in said), said
