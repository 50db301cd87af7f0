"""A file:// store's planted links are never followed: an upload onto a link, into a folder
that is a link, or a manifest or lease that is a link to /dev/zero changes no byte outside the
store, and the run goes on (or falls back) with one line. Anyone who can write a shared store
must not be able to make this run overwrite the training user's files."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from ironloop.callbacks import Callback
from ironloop.state.remote import lease as remote_lease
from ironloop.state.remote.store import open_remote
from tests.state.test_remote import StopAt, _config, _fit


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "other_run").mkdir(parents=True)
    (victim / "thesis.txt").write_text("four years of work\n")
    for name in ("metrics.jsonl", "events.jsonl", "run.json"):
        (victim / "other_run" / name).write_text(f"another run's {name}\n")
    return victim


LINKED = (15, 20, 25, 28)  # the saves after the plant: every 5 steps, epoch ends, the last


class Plant(Callback):
    """Links planted in the store while the run trains, under the names its next saves take."""

    def __init__(self, store: Path, victim: Path, at: int):
        self.store, self.victim, self.at, self.steps = store, victim, at, 0

    def on_step_end(self, run, metrics: dict) -> None:
        self.steps += 1
        if self.steps == self.at:
            (self.store / "step-00000010.pt").symlink_to(self.victim / "thesis.txt")
            (self.store / "logs").mkdir(exist_ok=True)
            for step in LINKED:  # each: a pending upload a newer one supersedes is dropped
                (self.store / "logs" / f"step-{step:08d}").symlink_to(self.victim / "other_run")


def test_links_planted_in_the_store_while_it_trains_change_no_byte_outside_it(tmp_path,
                                                                              capsys):
    url, store, victim = f"file://{tmp_path}/remote", tmp_path / "remote", _victim(tmp_path)
    kept = _tree(victim)
    _fit(_config(tmp_path, checkpoint__remote=url), callbacks=[Plant(store, victim, 6)])
    out = capsys.readouterr().out
    assert _tree(victim) == kept
    assert (victim / "thesis.txt").read_text() == "four years of work\n"
    lines = [line for line in out.splitlines() if "is a symbolic link" in line]
    assert lines, out  # the final save (step 28) is never superseded
    for line in lines:  # one line for each upload that met a link, naming it
        assert line.startswith("warning: remote checkpoint step ") and \
            "was not uploaded" in line and "/logs/step-000000" in line
    assert len(lines) == len(set(lines)) and "logs/step-00000028 is a symbolic" in lines[-1]
    assert not (store / "step-00000010.pt").is_symlink()  # replaced by the checkpoint itself


def test_a_manifest_linked_to_dev_zero_is_damage_the_resume_falls_back_past(tmp_path, capsys):
    url, store = f"file://{tmp_path}/remote", tmp_path / "remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    before = open_remote(url).manifests()[-2]
    manifest = store / "manifests" / "step-00000012.json"
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    shutil.rmtree(tmp_path / "run")  # a new node
    _fit(config, resume=True, callbacks=[StopAt(13)])
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if "step-00000012 is damaged" in line]
    assert len(damaged) == 1 and "is a symbolic link" in damaged[0], out
    assert f"fetched {url}/step-{before:08d}.pt" in out


@pytest.mark.parametrize("to", ["/dev/zero", "a file"])
def test_a_lease_linked_to_dev_zero_names_nobody_and_is_replaced_not_written_through(
        tmp_path, capsys, to):
    url, store = f"file://{tmp_path}/remote", tmp_path / "remote"
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(7)])
    target = Path(to) if to.startswith("/") else tmp_path / "victim.json"
    if to == "a file":  # a file the training user can write: a write through it would show
        target.write_text("keep me\n")
    (store / "lease.json").unlink()
    (store / "lease.json").symlink_to(target)
    _fit(config, resume=True, callbacks=[StopAt(9)])
    if to == "a file":
        assert target.read_text() == "keep me\n"
    out = capsys.readouterr().out
    named = [line for line in out.splitlines() if "lease.json names no run" in line]
    assert len(named) == 1 and "is a symbolic link" in named[0], out
    assert remote_lease.read(open_remote(url)).released and \
        not (store / "lease.json").is_symlink()
