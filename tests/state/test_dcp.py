"""Sharded (DCP) checkpoint directories: atomic commit, integrity, fallback, retention, export.

These run in one process (DCP works without a process group); the multi-rank saves, the
SIGKILL and the resharding resumes are in tests/e2e/test_distributed.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ironloop.errors import CheckpointError, UserError
from ironloop.state import dcp as sharded
from ironloop.state.checkpointer import _newest
from ironloop.state.export import export_run
from ironloop.state.io import LoadFailure
from ironloop.state.run_dir import step_name
from tests.conftest import tiny_mlp
from tests.state.test_io import Renames


def _trained(seed: int = 0):
    model = tiny_mlp(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _state(step: int) -> dict:
    # What collect_state returns, minus model/optimizer (the manager drops them if present).
    return {"format_version": 1, "progress": {"step": step, "epoch": 0, "offset": step * 8},
            "sampler": {"seed": 0, "epoch": 0, "offset": step * 8, "n": 100},
            "extra_from_another_feature": {"count": torch.tensor(step)}}


def _save(manager, step: int, best: bool = False, seed: int = 0):
    model, opt = _trained(seed)
    manager.model, manager.optimizer = model, opt  # what the checkpointer gives it
    manager.save({**_state(step), "model": None, "optimizer": None}, step, best)
    return model, opt


def test_save_commits_a_verified_directory_and_resumes_model_optimizer_and_extras(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=2)
    model, opt = _save(manager, 5, best=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.dcp", "last.dcp", "step-00000005.dcp"]  # no temp directory left
    files = {p.name for p in (tmp_path / "last.dcp").iterdir()}
    assert {"manifest.json", ".metadata", "extras-rank0.pt"} <= files
    # last/best are hard links: the bytes are written once
    assert os.path.samefile(tmp_path / "last.dcp" / ".metadata",
                            tmp_path / "step-00000005.dcp" / ".metadata")

    path, state = sharded.latest_sharded(tmp_path, warn=pytest.fail)
    assert path.name == "last.dcp" and state["progress"]["step"] == 5
    assert state["extra_from_another_feature"]["count"].item() == 5  # any extra key rides along
    assert "model" not in state
    fresh, fresh_opt = tiny_mlp(seed=1), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sharded.load_sharded(path, fresh, fresh_opt)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    exp = opt.state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"], exp, rtol=0, atol=0)


def test_a_manager_without_a_remote_mirror_closes_quietly(tmp_path, capsys):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    manager.close()  # no checkpoint.remote: nothing to wait for, nothing to report
    assert capsys.readouterr().out == ""


def test_on_one_process_the_manager_makes_its_directory_at_its_start_before_any_save(tmp_path):
    directory = tmp_path / "run" / "checkpoints"
    manager = sharded.ShardedWriter(directory, keep_last=1)
    assert directory.is_dir() and list(directory.iterdir()) == []  # as FileWriter's
    manager.close()

def test_the_checkpoint_directory_is_fsynced_after_the_renames(tmp_path, monkeypatch):
    manager = sharded.ShardedWriter(tmp_path, keep_last=2)
    _save(manager, 4)
    renames = Renames(monkeypatch, tmp_path)
    _save(manager, 5, best=True)  # replaces last.dcp: the old one is moved aside first
    assert {"step-00000005.dcp", "last.dcp", "best.dcp"} <= set(renames.renamed)
    assert renames.unsynced() == []


def test_damaged_or_unfinished_directories_are_skipped_and_cleaned(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        _save(manager, step)
    # step 3 (and last.dcp, which links the same bytes) gets a flipped bit in a shard
    shard = next((tmp_path / "step-00000003.dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # a killed writer's temp directory and a step directory without its manifest
    (tmp_path / ".step-00000004.dcp.tmp").mkdir()
    (tmp_path / "step-00000009.dcp").mkdir()
    warnings = []
    path, state = sharded.latest_sharded(tmp_path, warnings.append)
    assert path.name == "step-00000002.dcp" and state["progress"]["step"] == 2
    assert any("step-00000003.dcp" in w and "changed" in w for w in warnings)
    assert any("step-00000009.dcp" in w and "manifest" in w for w in warnings)
    removed = manager.discard_after(2)
    assert {p.name for p in removed} == {"step-00000003.dcp", "step-00000009.dcp"}
    assert not (tmp_path / ".step-00000004.dcp.tmp").exists()


def test_a_dcp_directory_a_kill_left_without_manifest_or_metadata_is_sharded_and_incomplete(
        tmp_path):
    # --resume step-N.dcp/ must say the save never finished, not "no checkpoint in this dir"
    unfinished = tmp_path / "step-00000009.dcp"
    unfinished.mkdir()
    assert sharded.is_sharded(unfinished) and not sharded.is_sharded(tmp_path)
    # a DCP directory by any name, once torch's .metadata is there (seed 8's is_sharded_11)
    plain = tmp_path / "exported"
    plain.mkdir()
    assert not sharded.is_sharded(plain)
    (plain / ".metadata").write_bytes(b"")
    assert sharded.is_sharded(plain)
    with pytest.raises(LoadFailure, match="incomplete"):
        sharded.verify(unfinished)


def test_a_shard_that_changed_is_refused_naming_it_and_the_fix(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 1)
    shard = next((tmp_path / "step-00000001.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes() + b"!")
    with pytest.raises(LoadFailure, match=f"{shard.name} does not match its manifest digest; "
                                          "resume from another checkpoint") as info:
        sharded.verify(tmp_path / "step-00000001.dcp")
    assert info.value.reason == f"{shard.name} changed"


def test_every_directory_damaged_is_an_error_naming_them(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 1)
    for d in ("last.dcp", "step-00000001.dcp"):
        (tmp_path / d / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="every checkpoint.*damaged"):
        sharded.latest_sharded(tmp_path, lambda m: None)


def test_a_save_over_a_killed_writers_temp_directory_commits_only_its_own_files(tmp_path):
    """A SIGKILL mid-write leaves .step-N.tmp/ behind; the next save of that step (a resume
    that redoes it) starts the directory afresh, so no stale shard is committed with it."""
    manager = sharded.ShardedWriter(tmp_path, keep_last=2)
    stale = tmp_path / f".{step_name(4, 'dcp')}.tmp"
    stale.mkdir()
    (stale / "__9_0.distcp").write_bytes(b"a killed writer's shard")
    _save(manager, 4)
    committed = tmp_path / "step-00000004.dcp"
    assert not (committed / "__9_0.distcp").exists() and not stale.exists()
    assert sharded.verify(committed) == 4


def test_keep_last_retention(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        _save(manager, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["last.dcp", "step-00000003.dcp", "step-00000004.dcp"]
    zero = sharded.ShardedWriter(tmp_path / "zero", keep_last=0)
    for step in (1, 2):
        _save(zero, step)
    assert sorted(p.name for p in (tmp_path / "zero").iterdir()) == ["last.dcp"]
    assert json.loads((tmp_path / "zero" / "last.dcp" / "manifest.json").read_text())["step"] == 2


def test_newest_of_files_and_directories_wins(tmp_path):
    from ironloop.state.io import save_atomic

    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 3)
    save_atomic(_state(7), tmp_path / "step-00000007.pt")  # e.g. resumed on one process
    path, state = _newest(tmp_path, pytest.fail)
    assert path.name == "step-00000007.pt" and state["progress"]["step"] == 7
    # and the other way round: a file run resumed under FSDP continues with directories
    other = tmp_path / "other"
    other.mkdir()
    save_atomic(_state(3), other / "step-00000003.pt")
    _save(sharded.ShardedWriter(other, keep_last=1), 7)
    path, state = _newest(other, pytest.fail)
    assert path.suffix == ".dcp" and state["progress"]["step"] == 7


def test_on_another_world_size_every_rank_gets_rank_0s_counters_and_its_own_rng(
        tmp_path, monkeypatch):
    """A checkpoint written by 2 ranks, read by one process posing as each rank of 3: rank 0's
    state for all; rank 1 keeps its own RNG, rank 2 (new) takes rank 0's."""
    from ironloop.state.io import file_digest, save_atomic

    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 5)
    path = tmp_path / "step-00000005.dcp"
    rank0 = sharded.load_extras(path)
    save_atomic({**_state(99), "rng": {"torch": torch.tensor([1])}}, path / "extras-rank1.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["world_size"] = 2
    manifest["files"]["extras-rank1.pt"] = file_digest(path / "extras-rank1.pt")
    (path / "manifest.json").write_text(json.dumps(manifest))
    for rank, rng in [(0, rank0.get("rng")), (1, {"torch": torch.tensor([1])}),
                      (2, rank0.get("rng"))]:
        monkeypatch.setattr(sharded, "_rank", lambda rank=rank: rank)
        state = sharded.load_extras(path)
        assert state["progress"] == _state(5)["progress"], rank
        assert str(state.get("rng")) == str(rng), rank


def test_export_consolidates_a_sharded_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    manager = sharded.ShardedWriter(run_dir / "checkpoints", keep_last=1)
    model, _ = _save(manager, 2)
    out = export_run(run_dir, tmp_path / "m.safetensors", which="last")
    weights = load_file(out)
    assert weights.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=0)
    with pytest.raises(UserError, match="last.dcp"):
        export_run(run_dir, tmp_path / "b.safetensors", which="best")


def test_an_async_save_commits_only_once_it_is_waited_for(tmp_path, monkeypatch):
    from concurrent.futures import Future

    writes = []

    def async_save(state, checkpoint_id, process_group):  # torch's, done at once (its own
        sharded.dcp.save(state, checkpoint_id=checkpoint_id)  # thread costs seconds here)
        writes.append(process_group)
        done: Future = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(sharded.dcp, "async_save", async_save)
    manager = sharded.ShardedWriter(tmp_path, keep_last=3, async_write=True)
    model, _ = _save(manager, 2)
    assert writes == [None]  # one process: no group of its own
    assert not (tmp_path / "step-00000002.dcp").exists()  # committed only once waited for
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp", "step-00000002.dcp"]
    path, state = sharded.latest_sharded(tmp_path, warn=pytest.fail)
    assert path.name == "last.dcp" and state["progress"]["step"] == 2
    # the async write holds the model where a load reads it (seed 8's save_34)
    fresh = tiny_mlp(seed=1)
    sharded.load_sharded(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_async_save_in_a_process_group_runs_on_a_gloo_group_of_its_own(tmp_path, monkeypatch):
    """The background write's collectives must not share the training group (NCCL on GPUs)."""
    from concurrent.futures import Future
    from datetime import timedelta

    import torch.distributed as dist

    groups = []

    def async_save(state, checkpoint_id, process_group):
        sharded.dcp.save(state, checkpoint_id=checkpoint_id)
        groups.append(process_group)
        done: Future = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(sharded.dcp, "async_save", async_save)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60),
                            store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        manager = sharded.ShardedWriter(tmp_path / "ckpt", keep_last=3,
                                                   async_write=True)
        _save(manager, 2)
        manager.close()
        [group] = groups
        assert group is not None and group != dist.group.WORLD
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "ckpt" / "step-00000002.dcp").is_dir()


def test_check_any_verifies_a_sharded_directory_and_a_file(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 3)
    sharded.check_any(tmp_path / "step-00000003.dcp")
    extras = tmp_path / "step-00000003.dcp" / "extras-rank0.pt"
    os.unlink(extras)
    with pytest.raises(CheckpointError, match=r"extras-rank0\.pt does not match its manifest "):
        sharded.check_any(tmp_path / "step-00000003.dcp")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        sharded.check_any(tmp_path / "step-00000003.pt")


def test_a_damaged_directorys_short_reason_says_which_file_and_how(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 3)
    step = tmp_path / "step-00000003.dcp"
    with open(step / "extras-rank0.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(LoadFailure) as e:
        sharded.verify(step)
    assert (e.value.path, e.value.reason) == (step, "extras-rank0.pt changed")
    os.unlink(step / "extras-rank0.pt")
    with pytest.raises(LoadFailure) as e:
        sharded.verify(step)
    assert e.value.reason == "extras-rank0.pt missing"


def test_a_sharded_checkpoint_of_another_model_is_refused_naming_what_to_check(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 3)
    other = torch.nn.Linear(8, 3)
    with pytest.raises(CheckpointError) as e:
        sharded.load_sharded(tmp_path / "last.dcp", other,
                             torch.optim.AdamW(other.parameters(), lr=1e-2))
    assert str(e.value).startswith(f"{tmp_path / 'last.dcp'} does not fit this model or "
                                   f"optimizer (")
    assert str(e.value).endswith("); check that model.name, model.kwargs and optim.name match "
                                 "the run that wrote it")


def test_every_directory_damaged_is_one_error_listing_each_with_its_reason(tmp_path):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 1)
    for d in ("last.dcp", "step-00000001.dcp"):
        (tmp_path / d / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        sharded.latest_sharded(tmp_path, lambda m: None)
    assert str(e.value) == (
        f"every checkpoint in {tmp_path} is damaged: {tmp_path / 'last.dcp'} (unreadable "
        f"manifest), {tmp_path / 'step-00000001.dcp'} (unreadable manifest). Pass --overwrite "
        "to start over, or --resume PATH to pick one (e.g. best.dcp) yourself.")


def test_a_shard_that_fails_to_load_on_export_is_named_by_its_errors_first_200_characters(
        tmp_path, monkeypatch):
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("x" * 300 + "\nthe traceback's second line")

    monkeypatch.setattr(sharded.dcp, "load", broken)
    with pytest.raises(CheckpointError) as e:
        sharded.consolidate_model(tmp_path / "last.dcp")
    assert str(e.value) == f"refused to load {tmp_path / 'last.dcp'}: RuntimeError: {'x' * 200}"


def test_where_hard_links_fail_last_and_best_are_copies_that_verify(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    manager = sharded.ShardedWriter(tmp_path, keep_last=1)
    _save(manager, 4, best=True)
    for name in ("last.dcp", "best.dcp"):
        assert sharded.verify(tmp_path / name) == 4
        step = tmp_path / "step-00000004.dcp"
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == \
            sorted(p.name for p in step.iterdir())
        assert (tmp_path / name / sharded.MANIFEST).stat().st_ino != \
            (step / sharded.MANIFEST).stat().st_ino  # a copy, not a link


def test_a_rename_that_fails_publishing_a_directory_is_a_checkpoint_error_naming_it(
        tmp_path, monkeypatch):
    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", full)
    with pytest.raises(CheckpointError, match=r"^could not write checkpoint .*last\.dcp: No space "
                                              r"left on device\. The previous checkpoint"):
        sharded._swap(tmp_path / "new", tmp_path / "last.dcp")

