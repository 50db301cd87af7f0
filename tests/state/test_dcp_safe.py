"""Sharded (DCP) checkpoints load without unpickling anything a user could swap in: a
``.metadata`` or a non-tensor item that would run code is refused before it is built, even when
the manifest's digests were recomputed to match (they are checksums, not signatures)."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ironloop
from ironloop.cli import main
from ironloop.errors import CheckpointError
from ironloop.state import dcp as sharded
from ironloop.state.dcp_safe import SafeReader
from ironloop.state.export import export_run
from ironloop.state.io import file_digest


class Evil:
    """A pickle whose loading runs code: it creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def sharded_run(tmp_path):
    """A run.dir whose checkpoints/ holds step-00000003.dcp and last.dcp, written in one
    process by the manager FSDP runs use."""
    model, opt = model_and_optimizer()
    manager = sharded.ShardedWriter(tmp_path / "run" / "checkpoints", keep_last=2, model=model,
                                    optimizer=opt)
    manager.save({"progress": {"step": 3, "epoch": 0, "offset": 0}}, step=3)
    return tmp_path / "run", model, opt


def recompute_manifest(path) -> None:
    """What an attacker does: make the manifest's blake2b digests match the files again."""
    manifest = json.loads((path / sharded.MANIFEST).read_text())
    manifest["files"] = {name: file_digest(path / name) for name in manifest["files"]}
    (path / sharded.MANIFEST).write_text(json.dumps(manifest))


def test_a_valid_sharded_checkpoint_still_loads_and_exports(tmp_path):
    run, model, _opt = sharded_run(tmp_path)
    last = run / "checkpoints" / "last.dcp"
    assert sharded.verify(last) == 3
    fresh, fresh_opt = model_and_optimizer(seed=1)
    sharded.load_sharded(last, fresh, fresh_opt)  # non-tensor items (param_groups) included
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 1e-2
    out = tmp_path / "m.safetensors"
    export_run(run, out, which="last")
    exported = load_file(out)
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


def test_a_malicious_metadata_is_refused_by_export_and_resume(tmp_path, capsys):
    run, _, _ = sharded_run(tmp_path)
    marker = tmp_path / "pwned"
    for name in ("last.dcp", "step-00000003.dcp"):
        path = run / "checkpoints" / name
        (path / ".metadata").unlink()  # a hard link shared with the step directory
        (path / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
        recompute_manifest(path)
    last = run / "checkpoints" / "last.dcp"
    assert main(["export", str(run), "--out", str(tmp_path / "x.safetensors"),
                 "--which", "last"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "posix.mkdir" in err and "Traceback" not in err
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(CheckpointError, match="refused"):
        ironloop.fit(nn.Linear(4, 3), (torch.randn(16, 4), torch.randint(0, 3, (16,))), None,
                     {"run.dir": str(tmp_path / "other"), "log.progress": "off",
                      "doctor.preflight": False}, resume=str(last))
    assert not marker.exists(), "loading must never run the pickle's code"
    with open(last / ".metadata", "rb") as f:  # the control: torch's own reader would run it
        pickle.load(f)
    assert marker.exists()


def test_a_malicious_non_tensor_item_is_refused(tmp_path):
    # .metadata stays legitimate, but one non-tensor item (the optimizer's lr) now points at a
    # torch.save'd pickle with code in it, appended to a .distcp file; digests recomputed.
    run, _, _ = sharded_run(tmp_path)
    path = run / "checkpoints" / "step-00000003.dcp"
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own, trusted file: rewritten as an attacker would
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[key]
    shard = path / info.relative_path
    marker = tmp_path / "pwned"
    blob = io.BytesIO()
    torch.save(Evil(marker), blob)
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data + blob.getvalue())
    info.offset, info.length = len(data), len(blob.getvalue())
    (path / ".metadata").unlink()
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    recompute_manifest(path)
    model, opt = model_and_optimizer(seed=1)
    with pytest.raises(CheckpointError) as refused:
        sharded.load_sharded(path, model, opt)
    assert str(refused.value) == (
        f"refused to load {path}: its item {key.fqn} is a pickle that would run code; ironloop "
        f"loads only tensors and plain values. Resume from another checkpoint")
    assert not marker.exists(), "loading must never run the pickle's code"


def test_each_unloadable_directory_is_a_load_failure_naming_it_and_why(tmp_path):
    from ironloop.state.io import LoadFailure

    run, _, _ = sharded_run(tmp_path)
    last = run / "checkpoints" / "last.dcp"
    (last / ".metadata").unlink()  # a hard link shared with the step directory
    (last / ".metadata").write_bytes(pickle.dumps(Evil(tmp_path / "pwned")))
    recompute_manifest(last)
    with pytest.raises(LoadFailure) as e:
        sharded.verify(last)
    assert (e.value.path, e.value.reason) == (last, "unsafe .metadata")
    (last / sharded.MANIFEST).write_text("{not json")
    with pytest.raises(LoadFailure) as e:
        sharded.verify(last)
    assert (e.value.path, e.value.reason) == (last, "unreadable manifest")
    assert str(e.value) == f"{last}/{sharded.MANIFEST} is damaged"
    with pytest.raises(CheckpointError) as refused:  # export says the same
        sharded.consolidate_model(last)
    assert str(refused.value) == f"{last}/{sharded.MANIFEST} is damaged"
    assert not (tmp_path / "pwned").exists()


def test_a_metadata_that_is_not_a_pickle_is_unreadable_not_unsafe(tmp_path):
    from ironloop.state.io import LoadFailure

    run, _, _ = sharded_run(tmp_path)
    last = run / "checkpoints" / "last.dcp"
    (last / ".metadata").unlink()
    (last / ".metadata").write_bytes(b"garbage, not a pickle")
    recompute_manifest(last)
    with pytest.raises(LoadFailure) as e:
        sharded.verify(last)
    assert (e.value.path, e.value.reason) == (last, "unreadable .metadata")


@pytest.mark.parametrize("stored", [True, False], ids=["with storage_meta", "without"])
def test_the_safe_reader_gives_the_metadata_its_load_id_in_the_storage_meta_it_has(
        tmp_path, stored):
    """As FileSystemReader does: the load_id set on the .metadata's own storage_meta, kept
    whole (its checkpoint id), or on a fresh one where an older torch wrote none (seed 8's
    SafeReader.read_metadata_19)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    from ironloop.state.dcp_safe import read_metadata

    run, _, _ = sharded_run(tmp_path)
    last = run / "checkpoints" / "last.dcp"
    metadata = read_metadata(last)
    if not stored:
        metadata.storage_meta = None
    else:
        metadata.storage_meta = StorageMeta(checkpoint_id="the-saved-id")
    (last / ".metadata").write_bytes(pickle.dumps(metadata))
    reader = SafeReader(str(last))
    got = reader.read_metadata().storage_meta
    assert isinstance(got, StorageMeta) and got.load_id == reader.load_id
    assert got.checkpoint_id == ("the-saved-id" if stored else None)


def test_dcps_per_rank_metadata_fallback_finds_none(tmp_path):
    run, _, _ = sharded_run(tmp_path)
    reader = SafeReader(str(run / "checkpoints" / "last.dcp"))
    with pytest.raises(FileNotFoundError, match="^no per-rank metadata in an ironloop "
                                                "checkpoint$"):
        reader.read_metadata(rank=1)
    assert reader.read_metadata(rank=None).state_dict_metadata  # the directory's own
