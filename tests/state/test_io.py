"""Checkpoint files and the checkpoint manager, against real files in tmp_path.

Faults are injected below the code under test (the OS-level ``open``/``fsync`` it calls, or the
bytes on disk), never by mocking ironloop itself.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import stat
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import ironloop.state.io as ckio
from ironloop.errors import CheckpointError, UserError
from ironloop.state.file_writer import (
    FileWriter,
    has_checkpoints,
    latest_file,
    retention_victims,
)
from ironloop.state.io import (
    load_model_state,
    load_verified,
    save_atomic,
    state_digest,
    strip_prefixes,
)


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def train_state(step: int = 1, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "progress": {"step": step, "epoch": 0},
        "plain": {"lr": 1e-3, "name": "run", "flags": [True, None], "shape": (2, 3),
                  "big": 2**70, "inf": float("-inf")},
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "scalar": torch.tensor(3.5),
        "rng": torch.get_rng_state(),
    }


def listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


class FullDisk:
    """A real file whose write fails with ENOSPC after ``budget`` bytes, like a disk filling up."""

    def __init__(self, f, budget: int):
        self._f, self._left = f, budget

    def write(self, data):
        self._left -= memoryview(data).nbytes
        if self._left < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class Renames:
    """Records, in order, every rename under ``root`` (os.replace, os.rename) and every fsync of
    a directory descriptor, to check that a rename is made durable by an fsync of the directory
    that holds the new name: until then a power cut can bring back the old entry, or none."""

    def __init__(self, monkeypatch, root: Path):
        self.root, self.events = Path(root), []
        real_fsync = os.fsync

        def fsync(fd):
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                self.events.append(("fsync_dir", (info.st_dev, info.st_ino)))
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        for name in ("replace", "rename"):
            monkeypatch.setattr(os, name, self._recording(getattr(os, name)))

    def _recording(self, real):
        def rename(src, dst, *args, **kwargs):
            real(src, dst, *args, **kwargs)
            if Path(dst).resolve().is_relative_to(self.root.resolve()):
                parent = os.stat(Path(dst).parent)  # now: a temp directory may move later
                self.events.append(("rename", (Path(dst), (parent.st_dev, parent.st_ino))))
        return rename

    @property
    def renamed(self) -> list[str]:
        return [what[0].name for kind, what in self.events if kind == "rename"]

    def unsynced(self) -> list[str]:
        """The renamed names with no fsync of their directory after the rename."""
        return [what[0].name for i, (kind, what) in enumerate(self.events)
                if kind == "rename" and ("fsync_dir", what[1]) not in self.events[i + 1:]]


# ---------------------------------------------------------------------------------- io.py --
def test_round_trip_and_plain_torch_load(tmp_path):
    state, path = train_state(), tmp_path / "ckpt.pt"
    expected = {k: v for k, v in state.items()}
    save_atomic(state, path)
    loaded = load_verified(path)
    assert_same(expected, {k: loaded[k] for k in expected})
    assert loaded["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0  # Adam really stepped
    direct = torch.load(path, weights_only=True)  # no ironloop needed to read it
    assert direct["integrity"]["algo"] == "blake2b"
    assert_same(loaded, direct)


def test_digest_survives_save_and_catches_a_flipped_byte(tmp_path):
    state = {"pattern": torch.full((1 << 18,), 0x5A, dtype=torch.uint8), "progress": {"step": 1}}
    before = state_digest(state)
    path = tmp_path / "ckpt.pt"
    save_atomic(state, path)
    assert state["integrity"]["digest"] == before
    assert state_digest(torch.load(path, weights_only=True)) == before
    changed = dict(state, pattern=state["pattern"].clone())
    changed["pattern"][12345] = 0
    assert state_digest(changed) != before

    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    assert data[mid] == 0x5A  # the middle of the file is tensor payload
    data[mid] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch|damaged") as info:
        load_verified(path)
    assert str(path) in str(info.value)


def test_the_digest_is_a_fixed_format_so_older_checkpoints_still_verify():
    """Every checkpoint on disk carries this digest: the scheme (tags, length prefixes, key
    order, the integrity entry left out) must not change between versions."""
    import hashlib

    def chunk(tag: bytes, data: bytes) -> bytes:
        return tag + len(data).to_bytes(8, "little") + data

    state = {"a": torch.tensor([1, -2], dtype=torch.int8), "b": [3, ("x",)],
             "integrity": {"algo": "blake2b", "digest": "not hashed"}}
    expected = hashlib.blake2b(b"".join([
        chunk(b"D", b"2"),
        chunk(b"K", b"'a'"), chunk(b"T", b"torch.int8|(2,)"), chunk(b"B", bytes([1, 254])),
        chunk(b"K", b"'b'"), chunk(b"L", b"2"), chunk(b"V", b"3"), chunk(b"L", b"1"),
        chunk(b"V", b"'x'"),
    ])).hexdigest()
    assert state_digest(state) == expected
    nested = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                        "b": torch.tensor(1.5, dtype=torch.bfloat16)},
              "progress": {"step": 7, "lrs": [0.1, (2, "x")]}, "name": "run"}
    assert state_digest(nested) == (  # written by the scheme above; a change breaks old files
        "cbaed022c46caac272a3172310c77a78305cd5eca20d223179a8b42a6fd7511700e4de5defdaef571075228f"
        "656a2f2bb2ee40e7371256dc131d1250d1648982")


def test_the_checkpoint_directory_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    renames = Renames(monkeypatch, tmp_path)
    save_atomic(train_state(), tmp_path / "ckpt.pt")
    assert renames.renamed == ["ckpt.pt"]
    assert renames.unsynced() == []


@pytest.mark.parametrize("cut", ["zero", "ten", "half"])
def test_truncated_file_is_damaged(tmp_path, cut):
    path = tmp_path / "ckpt.pt"
    save_atomic(train_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: {"zero": 0, "ten": 10, "half": len(data) // 2}[cut]])
    with pytest.raises(CheckpointError, match="damaged") as info:
        load_verified(path)
    assert str(path) in str(info.value) and isinstance(info.value, UserError)


def test_missing_foreign_and_unreadable_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_verified(tmp_path / "nope.pt")
    torch.save({"weight": torch.ones(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match=r"foreign\.pt is not an ironloop checkpoint "
                       r"\(no integrity record\); pass a file written by ironloop$"):
        load_verified(tmp_path / "foreign.pt")
    (tmp_path / "dir.pt").mkdir()  # unreadable as a file: named, with what to check
    with pytest.raises(CheckpointError, match=r"could not read checkpoint .*dir\.pt: Is a dir"):
        load_verified(tmp_path / "dir.pt")


def test_each_load_failure_has_a_short_reason_for_the_fallback_warning(tmp_path, monkeypatch):
    def reason(path) -> str:
        with pytest.raises(ckio.LoadFailure) as e:
            ckio.load_checked(path, "cpu")
        return e.value.reason

    torch.save({"weight": torch.ones(2)}, tmp_path / "foreign.pt")
    assert reason(tmp_path / "foreign.pt") == "not an ironloop checkpoint"
    (tmp_path / "text.pt").write_text("hello world, a text file\nand more")
    assert reason(tmp_path / "text.pt") == ("not a file torch.save wrote: it starts with "
                                            "'hello world, a text file'")
    # torch's legacy format is a pickle (0x80): not foreign, cut short
    (tmp_path / "legacy.pt").write_bytes(b"\x80\x05")
    assert reason(tmp_path / "legacy.pt") == "EOFError"
    assert reason(tmp_path / "missing.pt") == "missing"

    def refused(*args, **kwargs):
        raise PermissionError()  # no strerror: named by its type

    monkeypatch.setattr(torch, "load", refused)
    assert reason(tmp_path / "foreign.pt") == "PermissionError"


def test_a_pickle_with_an_unsupported_operation_is_damaged_naming_it(tmp_path, monkeypatch):
    def bad(*args, **kwargs):
        raise pickle.UnpicklingError("Weights only load failed. Unsupported operand 149")

    monkeypatch.setattr(torch, "load", bad)
    (tmp_path / "x.pt").write_bytes(b"PK")
    with pytest.raises(CheckpointError) as e:
        load_verified(tmp_path / "x.pt")
    assert str(e.value) == (f"{tmp_path / 'x.pt'} is damaged or not a checkpoint (unreadable "
                            f"pickle data: Unsupported operand 149); resume from another "
                            f"checkpoint or start over")


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch, where):
    path = tmp_path / "ckpt.pt"
    first = train_state(step=1, seed=1)
    save_atomic(first, path)
    if where == "write":  # fails inside torch.save, which wraps the OSError in a RuntimeError
        real_open = open
        monkeypatch.setattr(ckio, "open", lambda *a, **k: FullDisk(real_open(*a, **k), 4096),
                            raising=False)
    else:
        def no_space(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "fsync", no_space)
    second = dict(train_state(step=2, seed=2), big=torch.randn(10_000))
    with pytest.raises(CheckpointError) as info:
        save_atomic(second, path)
    monkeypatch.undo()
    assert str(path) in str(info.value) and "No space left" in str(info.value)
    assert "intact" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert listing(tmp_path) == ["ckpt.pt"]  # no temp file left behind
    assert_same(first, load_verified(path))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_is_told_to_free_space_and_other_errors_to_check_the_disk(code):
    full = ckio.write_failed(Path("ckpt.pt"), OSError(code, os.strerror(code)))
    assert "free disk space or point run.dir at a disk with room" in str(full)
    other = ckio.write_failed(Path("ckpt.pt"), OSError(errno.EIO, os.strerror(errno.EIO)))
    assert "check that run.dir is writable and healthy" in str(other)


def test_a_write_failure_names_the_os_reason_once_without_its_errno_prefix():
    full = ckio.write_failed(Path("ckpt.pt"), OSError(errno.ENOSPC, "No space left on device"))
    assert str(full) == ("could not write checkpoint ckpt.pt: No space left on device. The "
                         "previous checkpoint there is intact; free disk space or point run.dir "
                         "at a disk with room, then resume.")
    bare = ckio.write_failed(Path("ckpt.pt"), OSError("the mount went away"))  # no strerror
    assert str(bare).startswith("could not write checkpoint ckpt.pt: the mount went away. ")


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_malicious_pickle_is_refused_without_running(tmp_path, writer):
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    payload = {"model": {"w": torch.ones(1)}, "x": Evil(marker), "integrity": {"digest": ""}}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(CheckpointError, match="refused") as info:
        load_verified(path)
    assert str(path) in str(info.value) and "trust" in str(info.value)
    assert not marker.exists()
    # Prove the payload is live: unsafe loading runs it.
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()


def test_strip_prefixes():
    sd = {"module._orig_mod.fc.weight": 1, "_orig_mod.module.x": 2, "fc.bias": 3, "modules.y": 4}
    assert strip_prefixes(sd) == {"fc.weight": 1, "x": 2, "fc.bias": 3, "modules.y": 4}


class Wrapper(nn.Module):  # stands in for DDP: its keys carry "module."
    def __init__(self, inner):
        super().__init__()
        self.module = inner


def net(width: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 2))


def test_load_model_state_across_wrappers():
    torch.manual_seed(0)
    src = net()
    prefixed = {f"module._orig_mod.{k}": v for k, v in src.state_dict().items()}
    plain = net()
    load_model_state(plain, prefixed, "ckpt.pt")
    wrapped = Wrapper(net())
    load_model_state(wrapped, src.state_dict(), "ckpt.pt")
    for target in (plain, wrapped.module):
        assert_same(dict(src.state_dict()), dict(target.state_dict()))


def test_load_model_state_reports_the_misfit():
    model = net(width=4)
    ckpt = {f"module.{k}": v for k, v in net(width=5).state_dict().items() if k != "2.bias"}
    ckpt.update({f"extra.{i}": torch.zeros(1) for i in range(11)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_model_state(model, ckpt, "runs/a/last.pt")
    msg = str(info.value)
    assert msg.startswith("checkpoint runs/a/last.pt does not fit this model")
    extra = ", ".join(f"extra.{i}" for i in range(8))
    assert msg == ("checkpoint runs/a/last.pt does not fit this model: missing: [2.bias]; "
                   f"unexpected: [{extra}, ... (+3 more)]; shape mismatch: [0.weight: ckpt "
                   "(8, 5) vs model (8, 4)]. Check that model.name and model.kwargs match the "
                   "run that wrote it.")
    assert_same(before, dict(model.state_dict()))  # nothing half-loaded



def test_a_long_reason_from_the_models_own_load_is_cut_to_one_short_line():
    model = net()
    reason = "the checkpoint's quantization scales were written for another bit width " * 4

    def refuse(*args, **kwargs):  # a user module's load hook, with a long complaint
        raise RuntimeError(reason)

    model.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(CheckpointError) as info:
        load_model_state(model, net().state_dict(), "runs/a/last.pt")
    msg = str(info.value)
    assert f"does not fit this model: {reason[:117]}..." in msg and reason[:118] not in msg


@pytest.mark.parametrize("length, shown", [(120, "x" * 120), (121, "x" * 117 + "...")])
def test_a_reason_of_up_to_120_characters_is_shown_whole(length, shown):
    from ironloop.state.io import _short

    assert _short(RuntimeError("x" * length)) == shown

def test_a_misfit_list_of_exactly_the_cap_is_shown_whole_with_no_more_marker():
    model = net()
    ckpt = {**model.state_dict(), **{f"extra.{i}": torch.zeros(1) for i in range(8)}}
    with pytest.raises(CheckpointError) as info:
        load_model_state(model, ckpt, "runs/a/last.pt")
    assert "unexpected: [extra.0, " in str(info.value) and "extra.7]" in str(info.value)
    assert "more)" not in str(info.value)


def test_a_reason_without_words_from_the_models_own_load_is_named_by_its_type():
    model = net()

    def refuse(*args, **kwargs):  # a user module's load hook that says nothing
        raise RuntimeError()

    model.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(CheckpointError, match="does not fit this model: RuntimeError. "):
        load_model_state(model, net().state_dict(), "runs/a/last.pt")


# ----------------------------------------------------------------------------- manager.py --
def test_retention_victims():
    assert retention_victims([5, 1, 3, 9, 7], 2) == [1, 3, 5]
    assert retention_victims([5, 1, 3], 10) == []
    assert retention_victims([2, 1], 0) == [1, 2]
    assert retention_victims([], 3) == []


def small_state(step: int) -> dict:
    return {"w": torch.full((3,), float(step)), "progress": {"step": step}}


def test_manager_rolls_links_and_keeps_best(tmp_path):
    mgr = FileWriter(tmp_path / "ckpt", keep_last=2)
    for step in range(1, 6):
        mgr.save(small_state(step), step, best=(step == 3))
    d = tmp_path / "ckpt"
    assert listing(d) == ["best.pt", "last.pt", "step-00000004.pt", "step-00000005.pt"]
    assert_same(small_state(5)["w"], load_verified(d / "last.pt")["w"])
    assert_same(small_state(3)["w"], load_verified(d / "best.pt")["w"])
    if sys.platform.startswith("linux"):
        assert os.stat(d / "last.pt").st_ino == os.stat(d / "step-00000005.pt").st_ino
        assert os.stat(d / "best.pt").st_ino != os.stat(d / "last.pt").st_ino
    mgr.save(dict(small_state(5), w=torch.zeros(3)), 5)  # same step again: replaced atomically
    assert_same(torch.zeros(3), load_verified(d / "step-00000005.pt")["w"])
    assert_same(torch.zeros(3), load_verified(d / "last.pt")["w"])
    assert_same(small_state(4)["w"], load_verified(d / "step-00000004.pt")["w"])


@pytest.mark.parametrize("keep_last", [0, 2])
def test_the_manager_fsyncs_the_directory_after_every_rename(tmp_path, monkeypatch, keep_last):
    mgr = FileWriter(tmp_path, keep_last=keep_last)
    renames = Renames(monkeypatch, tmp_path)
    mgr.save(small_state(1), 1, best=True)
    names = ["last.pt", "best.pt"] if keep_last == 0 else ["step-00000001.pt", "last.pt",
                                                            "best.pt"]
    assert renames.renamed == names
    assert renames.unsynced() == []


def test_manager_never_deletes_the_file_it_just_wrote(tmp_path):
    mgr = FileWriter(tmp_path, keep_last=2)
    for step in (4, 5, 3):  # the last save is older than the files there (a rewound run)
        mgr.save(small_state(step), step)
    assert listing(tmp_path) == ["last.pt", "step-00000003.pt", "step-00000004.pt",
                                 "step-00000005.pt"]
    assert load_verified(tmp_path / "step-00000003.pt")["progress"]["step"] == 3


def test_manager_keep_last_zero_writes_only_last(tmp_path):
    mgr = FileWriter(tmp_path, keep_last=0)
    mgr.save(small_state(1), 1, best=True)
    mgr.save(small_state(2), 2)
    assert listing(tmp_path) == ["best.pt", "last.pt"]
    assert load_verified(tmp_path / "last.pt")["progress"]["step"] == 2
    assert load_verified(tmp_path / "best.pt")["progress"]["step"] == 1


def test_a_failed_last_pt_link_or_copy_names_it_and_keeps_the_previous_one(tmp_path,
                                                                            monkeypatch):
    # No hard links here (os.link fails), and the copy then fills the disk.
    mgr = FileWriter(tmp_path, keep_last=2)
    mgr.save(small_state(1), 1)

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", fail)
    monkeypatch.setattr(shutil, "copyfileobj", fail)
    with pytest.raises(CheckpointError, match="free disk space") as info:
        mgr.save(small_state(2), 2)
    monkeypatch.undo()
    assert str(tmp_path / "last.pt") in str(info.value)
    assert load_verified(tmp_path / "last.pt")["progress"]["step"] == 1
    assert not [n for n in listing(tmp_path) if ".tmp-" in n]  # no temp file left behind


def test_without_hard_links_last_and_best_are_byte_copies_of_the_step_file(tmp_path,
                                                                           monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")  # e.g. a FUSE or SMB mount

    monkeypatch.setattr(os, "link", no_links)
    mgr = FileWriter(tmp_path, keep_last=2)
    mgr.save(small_state(1), 1, best=True)
    step_bytes = (tmp_path / "step-00000001.pt").read_bytes()
    assert (tmp_path / "last.pt").read_bytes() == step_bytes
    assert (tmp_path / "best.pt").read_bytes() == step_bytes


def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning_and_the_save_stands(
        tmp_path, monkeypatch):
    mgr = FileWriter(tmp_path, keep_last=1)
    mgr.save(small_state(1), 1)
    real_unlink = os.unlink

    def busy(path, *args, **kwargs):
        if Path(path).name == "step-00000001.pt":
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", busy)
    with pytest.warns(UserWarning) as said:
        mgr.save(small_state(2), 2)
    assert [str(w.message) for w in said] == [
        f"could not delete old checkpoint {tmp_path / 'step-00000001.pt'} (Device or resource "
        f"busy); delete it by hand if disk space runs short"]
    assert load_verified(tmp_path / "last.pt")["progress"]["step"] == 2


def test_a_directory_with_only_step_files_has_checkpoints(tmp_path):
    assert not has_checkpoints(tmp_path)
    save_atomic(small_state(3), tmp_path / "step-00000003.pt")  # a kill before last.pt moved on
    assert has_checkpoints(tmp_path)


def test_discard_after_deletes_newer_step_files_and_killed_writers_temp_files(tmp_path):
    mgr = FileWriter(tmp_path, keep_last=5)
    for step in (2, 4, 6):
        mgr.save(small_state(step), step)
    (tmp_path / ".step-00000008.pt.tmp-123-0").write_bytes(b"partial")  # a killed writer's
    assert mgr.discard_after(4) == [tmp_path / "step-00000006.pt"]
    assert listing(tmp_path) == ["last.pt", "step-00000002.pt", "step-00000004.pt"]


def test_async_snapshot_and_errors(tmp_path, monkeypatch):
    mgr = FileWriter(tmp_path, keep_last=3, async_write=True)
    gate, real_open = threading.Event(), open

    def gated_open(*a, **k):  # holds the background write until the trainer has moved on
        assert gate.wait(10)
        return real_open(*a, **k)

    monkeypatch.setattr(ckio, "open", gated_open, raising=False)
    state = small_state(1)
    mgr.save(state, 1)
    assert not (tmp_path / "step-00000001.pt").exists()  # save returned before writing
    state["w"].add_(100.0)  # the optimizer steps on while the write is pending
    state["progress"]["step"] = 99
    gate.set()
    mgr.save(small_state(2), 2)
    mgr.wait()
    one = load_verified(tmp_path / "step-00000001.pt")
    assert_same(small_state(1), {k: one[k] for k in ("w", "progress")})
    assert load_verified(tmp_path / "last.pt")["progress"]["step"] == 2

    monkeypatch.setattr(ckio, "open", lambda *a, **k: FullDisk(real_open(*a, **k), 0),
                        raising=False)
    mgr.save(small_state(3), 3)  # returns; the failure happens in the background
    with pytest.raises(CheckpointError, match="No space left"):
        mgr.wait()
    monkeypatch.undo()
    mgr.wait()  # the error was raised once, not forever
    assert load_verified(tmp_path / "last.pt")["progress"]["step"] == 2
    mgr.save(small_state(4), 4)
    mgr.close()
    assert load_verified(tmp_path / "last.pt")["progress"]["step"] == 4


def test_latest_valid_falls_back_past_damaged_files(tmp_path):
    mgr = FileWriter(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        mgr.save(small_state(step), step)
    warnings: list[str] = []
    path, state = latest_file(tmp_path, warnings.append)
    assert (path.name, state["progress"]["step"], warnings) == ("last.pt", 3, [])

    save_atomic(small_state(4), tmp_path / "step-00000004.pt")  # crash before last.pt moved on
    path, state = latest_file(tmp_path, warnings.append)
    assert (path.name, state["progress"]["step"], warnings) == ("step-00000004.pt", 4, [])
    os.unlink(tmp_path / "step-00000004.pt")

    half = (tmp_path / "last.pt").read_bytes()[:100]
    (tmp_path / ".tmp").write_bytes(half)
    os.replace(tmp_path / ".tmp", tmp_path / "last.pt")  # new inode: step-3 stays intact
    path, state = latest_file(tmp_path, warnings.append)
    assert (path.name, state["progress"]["step"]) == ("step-00000003.pt", 3)
    assert len(warnings) == 1 and str(tmp_path / "last.pt") in warnings[0]
    assert "damaged" in warnings[0] and "falling back" in warnings[0]

    (tmp_path / "step-00000003.pt").write_bytes(b"garbage")
    warnings.clear()
    path, state = latest_file(tmp_path, warnings.append)
    assert (path.name, state["progress"]["step"]) == ("step-00000002.pt", 2)
    assert len(warnings) == 2 and "step-00000003.pt" in warnings[1]


def test_an_unreadable_step_file_is_skipped_with_the_os_reason_in_the_warning(tmp_path):
    save_atomic(small_state(2), tmp_path / "step-00000002.pt")
    (tmp_path / "step-00000003.pt").mkdir()  # reading fails with EISDIR (EACCES, for non-root)
    warnings: list[str] = []
    path, state = latest_file(tmp_path, warnings.append)
    assert (path.name, state["progress"]["step"]) == ("step-00000002.pt", 2)
    assert warnings == [f"checkpoint {tmp_path / 'step-00000003.pt'} is damaged (Is a "
                        f"directory); falling back to an older one"]


def test_latest_valid_all_damaged_or_none(tmp_path):
    assert latest_file(tmp_path / "absent", print) is None
    assert latest_file(tmp_path, print) is None and not has_checkpoints(tmp_path)
    save_atomic(small_state(7), tmp_path / "best.pt")
    (tmp_path / ".last.pt.tmp-1-0").write_bytes(b"partial")
    assert latest_file(tmp_path, print) is None  # best.pt is never resumed from
    assert has_checkpoints(tmp_path)
    (tmp_path / "last.pt").write_bytes(b"")
    (tmp_path / "step-00000005.pt").write_bytes(b"PK\x03\x04 not really")
    warnings: list[str] = []
    with pytest.raises(CheckpointError) as info:
        latest_file(tmp_path, warnings.append)
    msg = str(info.value)
    assert "last.pt" in msg and "step-00000005.pt" in msg and "--overwrite" in msg
    assert "--resume" in msg and len(warnings) == 2


def test_async_save_reuses_its_snapshot_buffers_and_writes_each_state(tmp_path):
    """Issue 10: the second async save copies into the first one's CPU buffers (the stall is a
    memory copy, not an allocation), and each file still holds the state of its own step."""
    mgr = FileWriter(tmp_path, keep_last=3, async_write=True)
    state = small_state(1)
    mgr.save(state, 1)
    mgr.wait()
    buffer = mgr._staging["w"]
    state["w"].add_(100.0)  # the live tensors move on between checkpoints
    state["progress"]["step"] = 2
    mgr.save(state, 2)
    assert mgr._staging["w"] is buffer  # copied into, not reallocated
    state["w"].add_(100.0)  # and the pending write must not see this
    mgr.close()
    assert_same(small_state(1), {k: v for k, v in load_verified(tmp_path / "step-00000001.pt")
                                 .items() if k in ("w", "progress")})
    two = load_verified(tmp_path / "step-00000002.pt")
    assert torch.equal(two["w"], small_state(1)["w"] + 100.0)
    assert two["progress"]["step"] == 2


def test_a_foreign_files_reason_quotes_its_first_24_bytes_decoding_what_is_not_utf8(tmp_path):
    def reason(path) -> str:
        with pytest.raises(ckio.LoadFailure) as e:
            ckio.load_checked(path, "cpu")
        assert e.value.path == path  # the failure names the file it is about
        return e.value.reason

    (tmp_path / "long.pt").write_text("abcdefghijklmnopqrstuvwxyz0123456789")
    assert reason(tmp_path / "long.pt") == ("not a file torch.save wrote: it starts with "
                                            "'abcdefghijklmnopqrstuvwx'")
    (tmp_path / "binary.pt").write_bytes(b"hello \xff\xfe")  # not UTF-8: replaced, not an error
    assert reason(tmp_path / "binary.pt") == ("not a file torch.save wrote: it starts with "
                                              "'hello \ufffd\ufffd'")


class NotATensor:
    """What weights_only refuses to build: an object of a class of its own."""


def test_every_load_failure_names_its_file_and_a_short_reason(tmp_path):
    def failure(path) -> ckio.LoadFailure:
        with pytest.raises(ckio.LoadFailure) as e:
            ckio.load_checked(path, "cpu")
        return e.value

    state = {"weight": torch.ones(2)}
    save_atomic(state, tmp_path / "good.pt")
    saved = torch.load(tmp_path / "good.pt", weights_only=True)
    saved["weight"] += 1  # the digest no longer matches
    torch.save(saved, tmp_path / "changed.pt")
    torch.save({"weight": torch.ones(2)}, tmp_path / "foreign.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"weight": torch.ones(2), "code": NotATensor()}, tmp_path / "code.pt")
    for name, why in [("code.pt", "contains pickled code or non-tensor objects"),
                      ("changed.pt", "checksum mismatch"),
                      ("foreign.pt", "not an ironloop checkpoint"),
                      ("empty.pt", "empty file"), ("missing.pt", "missing")]:
        e = failure(tmp_path / name)
        assert (e.path, e.reason) == (tmp_path / name, why)
    assert str(failure(tmp_path / "changed.pt")) == (
        f"{tmp_path / 'changed.pt'} is damaged: checksum mismatch; the file changed after it was "
        "written (disk or copy error). Resume from another checkpoint.")
    assert str(failure(tmp_path / "code.pt")) == (
        f"refused to load {tmp_path / 'code.pt'}: it contains pickled code or objects that are "
        "not plain tensors/containers; ironloop only loads weights_only checkpoints. Only load "
        "files you trust, and re-save them as plain state dicts (tensors, dicts, lists, "
        "numbers).")


def test_a_truncated_zip_is_damaged_not_empty(tmp_path):
    path = tmp_path / "cut.pt"
    path.write_bytes(b"PK\x03\x04 truncated zip")  # torch's own format, cut short by a kill
    with pytest.raises(ckio.LoadFailure) as e:
        ckio.load_checked(path, "cpu")
    assert e.value.reason not in ("empty file", "") and not e.value.reason.startswith("not a file")


def test_a_negative_keep_last_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^keep_last must be >= 0, got -1$"):
        FileWriter(tmp_path, keep_last=-1)
    with pytest.raises(ValueError, match=r"^keep_last must be >= 0, got -2$"):
        retention_victims([1, 2], -2)


def test_every_file_damaged_is_one_error_listing_each_with_its_reason(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        latest_file(tmp_path, lambda msg: None)
    assert str(e.value) == (f"every checkpoint in {tmp_path} is damaged: {tmp_path / 'last.pt'} "
                            f"(empty file). Pass --overwrite to start over, or --resume PATH to "
                            f"pick a file (e.g. best.pt) yourself.")


def test_a_snapshot_copies_into_the_previous_one_only_where_shape_and_dtype_match():
    from ironloop.state.snapshot import snapshot

    w, ids = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2])
    first = snapshot({"w": w, "ids": ids, "list": [w], "pair": (ids, 3), "n": 5})
    assert first["w"] is not w and torch.equal(first["w"], w)  # a copy, not the tensor
    assert first["pair"][1] == 3 and isinstance(first["pair"], tuple) and first["n"] == 5
    second = snapshot({"w": w + 1, "ids": ids.double(), "list": [w.reshape(3, 2)],
                       "pair": (ids, 4), "n": 6}, first)
    assert second["w"] is first["w"] and torch.equal(second["w"], w + 1)  # reused
    assert second["ids"] is not first["ids"] and second["ids"].dtype == torch.float64
    assert second["list"][0] is not first["list"][0] and second["list"][0].shape == (3, 2)
    assert second["pair"] == (first["pair"][0], 4) and second["n"] == 6


def test_a_pinned_snapshot_of_cpu_tensors_is_a_plain_copy_with_nothing_to_wait_for():
    """Page-locked memory is for device-to-host copies only: CPU tensors are copied as before
    (into the last snapshot where they fit), and there is no copy on a stream to wait for."""
    from ironloop.state.snapshot import copies_done, snapshot

    w = torch.arange(4.0)
    first = snapshot({"w": w, "rng": [torch.tensor([1, 2])]}, pinned=True)
    assert first["w"] is not w and torch.equal(first["w"], w) and not first["w"].is_pinned()
    second = snapshot({"w": w + 1, "rng": [torch.tensor([3, 4])]}, first, pinned=True)
    assert second["w"] is first["w"] and second["w"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert second["rng"][0] is first["rng"][0] and second["rng"][0].tolist() == [3, 4]
    assert copies_done(second)() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_async_checkpoint_of_gpu_tensors_holds_their_values_at_the_save(tmp_path):
    """The save queues pinned copies and returns; the next step's update, queued behind them,
    does not reach the file, and the writer thread waits for the copies before it writes (a
    256 MB tensor: a copy that takes milliseconds). The guard's test checks the copies are
    queued without a host sync."""
    w = torch.randn(64 * 2**20, device="cuda")
    mgr = FileWriter(tmp_path, keep_last=2, async_write=True)
    for step in (1, 2):  # the second save copies into the first one's pinned buffers
        expected = w.cpu()
        mgr.save({"w": w}, step=step)
        w.add_(1.0)  # the update after the save
        mgr.wait()
        assert torch.equal(load_verified(tmp_path / "last.pt")["w"], expected)
    mgr.close()


def test_pickled_code_is_refused_even_by_a_torch_whose_load_trusts_by_default(tmp_path,
                                                                              monkeypatch):
    """torch.load trusts pickles by default before torch 2.6, and ironloop supports 2.4: every
    load asks for weights_only itself. (Here torch.load's default is made that old one.)"""
    import functools

    torch.save({"weight": torch.ones(2), "code": NotATensor()}, tmp_path / "code.pt")
    monkeypatch.setattr(torch, "load", functools.partial(torch.load, weights_only=False))
    with pytest.raises(ckio.LoadFailure) as e:
        ckio.load_checked(tmp_path / "code.pt", "cpu")
    assert e.value.reason == "contains pickled code or non-tensor objects"
