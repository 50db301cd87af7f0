"""state/prepare.py and the checkpointer's finding, on hand-made run directories (no training
run): which run.dir a fresh run or a resume is refused, and which checkpoint a ``--resume DIR``
resumes from."""

from __future__ import annotations

import pytest
import torch

from ironloop.config import Config
from ironloop.errors import CheckpointError, UserError
from ironloop.parallel.world import World
from ironloop.state import prepare as rundir
from ironloop.state.checkpointer import Checkpointer, Found, holds_any
from ironloop.state.io import save_atomic
from ironloop.state.lock import LOCK_NAME
from ironloop.state.run_dir import RunDir


def _checkpoint(folder, step: int, name: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or f"step-{step:08d}.pt")
    save_atomic({"model": {"w": torch.full((1,), float(step))}, "progress": {"step": step}},
                path)
    return path


def _find(run_dir, resume):
    """What --resume finds for a run in ``run_dir``."""
    return Checkpointer(RunDir(run_dir), Config().checkpoint, World()).find(resume)


def _at(path, step: int) -> Found:
    return Found(path, {"progress": {"step": step}})


def test_a_fresh_run_over_a_run_with_checkpoints_is_refused_unless_overwritten(tmp_path):
    _checkpoint(tmp_path / "checkpoints", 5)
    (tmp_path / LOCK_NAME).write_text("{}")
    with pytest.raises(UserError) as e:
        rundir.check_run_dir(tmp_path, resume=False, overwrite=False)
    assert str(e.value) == (f"run.dir {tmp_path} already holds a run; pass --resume to continue "
                            f"it, --overwrite to delete its outputs and start over, or choose "
                            f"another run.dir")
    rundir.check_run_dir(tmp_path, resume=False, overwrite=True)
    rundir.check_run_dir(tmp_path, resume=True, overwrite=False)


def test_a_fresh_run_over_a_run_that_logged_steps_is_refused_but_not_over_an_empty_log(
        tmp_path):
    (tmp_path / LOCK_NAME).write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    rundir.check_run_dir(tmp_path, resume=False, overwrite=False)  # failed before step 1
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="already holds a run"):
        rundir.check_run_dir(tmp_path, resume=False, overwrite=False)


def test_resume_from_a_directory_without_a_checkpoint_is_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(CheckpointError) as e:
        rundir.check_run_dir(tmp_path / "run", resume=str(other), overwrite=False)
    assert str(e.value) == (f"--resume {other}: no checkpoint in this directory; pass the "
                            f"run.dir or the checkpoint file of the run to resume, or leave "
                            f"--resume out to start a fresh run")
    (other / "checkpoints" / "step-00000003.dcp").mkdir(parents=True)  # a sharded one counts
    rundir.check_run_dir(tmp_path / "run", resume=str(other), overwrite=False)


@pytest.mark.parametrize("where", ["run.dir", "its checkpoints", "a file"])
def test_resume_from_another_directory_takes_its_newest_checkpoint(tmp_path, where, capsys):
    other = tmp_path / "other"
    _checkpoint(other / "checkpoints", 3)
    newest = _checkpoint(other / "checkpoints", 7)
    _checkpoint(tmp_path / "run" / "checkpoints", 9)  # run.dir's own: not what was asked
    resume = {"run.dir": other, "its checkpoints": other / "checkpoints",
              "a file": newest}[where]
    found = _find(tmp_path / "run", str(resume))
    assert found.source == str(newest) and found.state["progress"]["step"] == 7
    assert found.step == 7


def test_a_bare_resume_takes_run_dirs_own_newest_or_nothing(tmp_path):
    assert _find(tmp_path, True) is None
    path = _checkpoint(tmp_path / "checkpoints", 4)
    found = _find(tmp_path, True)
    assert found.source == str(path) and found.step == 4
    assert Found(path, {}).step == 0 and Found(path, {"progress": None}).step == 0


def test_a_resume_from_another_lineage_may_not_delete_run_dirs_newer_checkpoints(tmp_path):
    run = tmp_path / "run"
    own = _checkpoint(run / "checkpoints", 5)
    _checkpoint(run / "checkpoints", 7)
    (run / "checkpoints" / "step-00000009.dcp").mkdir()  # the newest of three: named
    other = _checkpoint(tmp_path / "other", 4)
    with pytest.raises(CheckpointError) as e:
        rundir._refuse_other_lineage(Checkpointer(RunDir(run)), _at(other, 4))
    assert str(e.value) == (f"--resume {other}: run.dir {run} holds its own checkpoints up to "
                            f"step 9, past this checkpoint's step 4, which the resume would "
                            f"delete; choose another run.dir, or pass one of "
                            f"{(run / 'checkpoints').resolve()}'s own checkpoints")
    rundir._refuse_other_lineage(Checkpointer(RunDir(run)), _at(own, 5))  # its own: a rewind
    rundir._refuse_other_lineage(Checkpointer(RunDir(run)), _at(other, 9))  # nothing newer


@pytest.mark.usefixtures("quick_lease")
def test_a_new_node_resumes_from_the_remotes_newest_good_checkpoint_warning_once(
        tmp_path, capsys):
    import uuid

    from ironloop.state.remote.mirror import Mirror
    from ironloop.state.remote.store import open_remote

    url = f"memory://rundir-{uuid.uuid4().hex}/prefix"
    store = open_remote(url)
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror = Mirror(store, tmp_path / "staging", keep_last=3, warn=pytest.fail, logs_from=old)
    for step in (1, 2):
        path = _checkpoint(old / "checkpoints", step)
        mirror.push(step, {path.name: path}, "file", True, mirror.snapshot_logs(step))
        assert mirror.close() is not None and mirror.uploaded[-1] == step
    store.write("step-00000002.pt", b"rot")  # the newest, damaged: both fetches meet it
    cfg = Config().with_overrides({"checkpoint.remote": url})
    new = tmp_path / "new"
    said: list[str] = []
    found = Checkpointer(RunDir(new), cfg.checkpoint, World()).latest(warn=said.append)
    path = found.path
    assert path == new / "checkpoints" / "step-00000001.pt" and found.step == 1
    assert said == [f"remote checkpoint {store.show('step-00000002')} is damaged "
                    f"(step-00000002.pt checksum mismatch); falling back to an older one"]
    assert (new / "checkpoints" / "best.pt").is_file()  # the final restore reads it
    assert (new / "metrics.jsonl").read_text() == '{"step": 1}\n'
    out = capsys.readouterr().out
    assert f"notice: restored metrics.jsonl from {store.show('logs/step-00000001')}" in out
    assert (f"notice: fetched {store.show('step-00000001.pt')} into {path}: it is newer than "
            f"anything in run.dir") in out


def test_a_folder_with_only_a_sharded_step_directory_holds_a_checkpoint(tmp_path):
    assert not holds_any(tmp_path)
    (tmp_path / "checkpoints" / "step-00000003.dcp").mkdir(parents=True)
    assert holds_any(tmp_path)  # run.dir: in its checkpoints/ folder
    assert holds_any(tmp_path / "checkpoints")  # the folder itself
    assert not holds_any(tmp_path / "checkpoints" / "step-00000003.dcp")


def test_a_run_dir_that_cannot_be_written_is_one_line_naming_why(tmp_path, monkeypatch):
    from ironloop.state import lock

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run_dir = blocker / "run"
    monkeypatch.setattr(lock, "_claimed", set())  # this test's claim stays out of the others'
    with pytest.raises(UserError) as e:
        rundir._take(run_dir, Config(), None, False, {"run": {}})
    assert str(e.value) == (f"run.dir {run_dir} cannot be created or written (Not a directory); "
                            f"choose a writable run.dir")


def test_overwrite_removes_a_runs_outputs_and_nothing_else_and_writes_the_new_config(
        tmp_path, monkeypatch):
    from ironloop.state import lock

    monkeypatch.setattr(lock, "_claimed", set())  # this test's claim stays out of the others'
    _checkpoint(tmp_path / "checkpoints", 5)
    (tmp_path / LOCK_NAME).write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 5}\n')
    (tmp_path / "notes.txt").write_text("mine")
    got = rundir.prepare_run_dir(Checkpointer(RunDir(tmp_path)), Config(), False, True, World(),
                                 {"run": {"seed": 3}}, False)
    assert got is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "config.yaml", "notes.txt"]
    assert (tmp_path / "config.yaml").read_text() == "run:\n  seed: 3\n"


def test_a_checkpoint_without_a_recorded_step_counts_as_step_0():
    assert _at(None, 12).step == 12
    assert Found(None, {"progress": {}}).step == Found(None, {"progress": None}).step == 0
    assert Found(None, {}).step == 0


def test_resume_from_a_sharded_checkpoint_names_it_as_its_source(tmp_path):
    from tests.state.test_dcp_safe import sharded_run

    run, _, _ = sharded_run(tmp_path)
    last = run / "checkpoints" / "last.dcp"
    found = _find(tmp_path / "other", str(last))
    assert found.source == str(last)  # the resume event's "from" and the other-lineage check's
    assert found.state["progress"] == {"step": 3, "epoch": 0, "offset": 0}
