"""state/export.py: weights out as safetensors, written atomically or not at all."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ironloop.errors import UserError
from ironloop.state import export
from ironloop.state.export import export_run
from ironloop.state.io import save_atomic
from tests.conftest import REPO

# A file-size limit is a real write failure (EFBIG) without a full disk to fill: the process
# ignores SIGXFSZ, so the write returns the error as a full disk's would (ENOSPC).
FULL = """
import resource, signal, sys, torch
from pathlib import Path
from ironloop.errors import UserError
from ironloop.state.export import save_safetensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    save_safetensors({"w": torch.zeros(100_000)}, Path(sys.argv[1]) / "final.safetensors")
except UserError as e:
    print(e)
"""


def test_final_weights_that_cannot_be_written_are_one_line_and_leave_no_temp_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", FULL, str(tmp_path)], cwd=REPO, text=True,
                          capture_output=True, timeout=120, env={"PYTHONPATH": "src"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == (f"{tmp_path}/final.safetensors cannot be written (File too large "
                           f"(os error 27)); free space (or raise the quota) on {tmp_path} and "
                           f"try again: a run's checkpoints are intact, and --resume finishes "
                           f"it\n")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temp


def test_a_safetensors_io_error_names_the_oss_reason_in_full(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):  # safetensors' own error, as a full disk gives it
        raise RuntimeError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")

    monkeypatch.setattr(export, "save_file", full_disk)
    with pytest.raises(UserError, match=r"cannot be written \(No space left on device "
                                        r"\(os error 28\)\); free space"):
        export.save_safetensors({"w": torch.zeros(2)}, tmp_path / "final.safetensors")


def test_an_os_error_writing_safetensors_is_named_by_its_strerror_alone(tmp_path, monkeypatch):
    def quota(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(export, "save_file", quota)
    with pytest.raises(UserError) as e:
        export.save_safetensors({"w": torch.zeros(2)}, tmp_path / "final.safetensors")
    assert str(e.value).startswith(f"{tmp_path / 'final.safetensors'} cannot be written (Disk "
                                   f"quota exceeded); free space")


@pytest.mark.parametrize("which, has, other", [("best", "last.pt", "last"),
                                               ("last", "best.pt", "best")])
def test_export_of_a_checkpoint_the_run_lacks_names_the_which_it_has(tmp_path, which, has, other):
    (tmp_path / "checkpoints").mkdir()
    save_atomic({"model": {"w": torch.zeros(2)}, "progress": {"step": 1}},
                tmp_path / "checkpoints" / has)
    with pytest.raises(UserError, match=f"this run has {has}: pass --which {other}$"):
        export_run(tmp_path, tmp_path / "m.safetensors", which=which)


def _run(tmp_path, **states):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for name, state in states.items():
        save_atomic(state, tmp_path / "run" / "checkpoints" / f"{name}.pt")
    return tmp_path / "run"


def test_export_writes_the_checkpoints_own_weights_without_wrapper_prefixes(tmp_path):
    w, b = torch.arange(6.0).reshape(2, 3), torch.ones(2)
    run = _run(tmp_path, best={"model": {"module.w": w, "_orig_mod.b": b}},
               last={"model": {"w": w + 1, "b": b}})
    out = export_run(run, tmp_path / "m.safetensors")
    assert out == tmp_path / "m.safetensors"
    got = load_file(out)
    assert list(got) == ["b", "w"] and torch.equal(got["w"], w) and torch.equal(got["b"], b)
    export_run(run, tmp_path / "last.safetensors", which="last")
    assert torch.equal(load_file(tmp_path / "last.safetensors")["w"], w + 1)


def test_export_of_the_average_reads_the_last_checkpoint_without_its_count(tmp_path):
    avg = torch.full((2,), 0.5)
    run = _run(tmp_path, last={"model": {"w": torch.zeros(2)},
                               "average": {"module.w": avg, "n_averaged": torch.tensor(3)}},
               best={"model": {"w": torch.ones(2)}})
    export_run(run, tmp_path / "avg.safetensors", which="avg")
    got = load_file(tmp_path / "avg.safetensors")
    assert list(got) == ["w"] and torch.equal(got["w"], avg)
    plain = _run(tmp_path / "plain", last={"model": {"w": torch.zeros(2)}})
    with pytest.raises(UserError) as e:
        export_run(plain, tmp_path / "x.safetensors", which="avg")
    assert str(e.value) == (f"{plain / 'checkpoints' / 'last.pt'} holds no averaged weights: "
                            f"the run trained with average.kind=none; export --which best or "
                            f"--which last instead")


def test_export_never_replaces_a_file_unless_forced_nor_writes_into_a_directory(tmp_path):
    run = _run(tmp_path, best={"model": {"w": torch.ones(2)}})
    out = tmp_path / "m.safetensors"
    out.write_text("the user's")
    with pytest.raises(UserError) as e:
        export_run(run, out)
    assert str(e.value) == (f"--out {out} already exists; pass --force to replace it, or pick "
                            f"another name")
    assert out.read_text() == "the user's"
    export_run(run, out, force=True)
    assert torch.equal(load_file(out)["w"], torch.ones(2))
    with pytest.raises(UserError, match=r"is a directory; give a file name like "
                                        r"model\.safetensors$"):
        export_run(run, tmp_path, force=True)


def test_export_of_a_run_without_checkpoints_asks_whether_it_is_a_run_dir(tmp_path):
    with pytest.raises(UserError) as e:
        export_run(tmp_path, tmp_path / "m.safetensors")
    assert str(e.value) == (f"no {tmp_path / 'checkpoints' / 'best.pt'}; is it an ironloop "
                            f"run.dir with checkpoint.enabled=true?")


@pytest.mark.usefixtures("quick_lease")
def test_export_from_a_remote_fetches_its_newest_checkpoint_of_the_kind_asked(tmp_path):
    import uuid

    from ironloop.state.remote.mirror import Mirror
    from ironloop.state.remote.store import open_remote

    url = f"memory://export-{uuid.uuid4().hex}/prefix"
    store = open_remote(url)
    mirror = Mirror(store, tmp_path / "staging", keep_last=3, warn=pytest.fail)
    for step, best in [(1, True), (2, False)]:
        path = tmp_path / "ck" / f"step-{step:08d}.pt"
        path.parent.mkdir(exist_ok=True)
        save_atomic({"model": {"w": torch.full((2,), float(step))}}, path)
        mirror.push(step, {path.name: path}, "file", best)
        assert mirror.close() is not None and mirror.uploaded[-1] == step  # waits for it
    export_run(url, tmp_path / "best.safetensors")
    assert torch.equal(load_file(tmp_path / "best.safetensors")["w"], torch.ones(2))
    export_run(url, tmp_path / "last.safetensors", which="last")
    assert torch.equal(load_file(tmp_path / "last.safetensors")["w"], torch.full((2,), 2.0))
    with pytest.raises(UserError) as e:
        export_run(url, tmp_path / "avg.safetensors", which="avg")
    assert str(e.value) == ("export --which avg reads a local run directory; export best or "
                            "last from the remote, or copy the run's final_avg.safetensors")
    empty = f"memory://export-{uuid.uuid4().hex}/none"
    with pytest.raises(UserError, match=r"holds no complete best checkpoint; is it a "
                                        r"checkpoint\.remote URL\?$"):
        export_run(empty, tmp_path / "none.safetensors")


def test_the_average_of_a_sharded_checkpoint_points_at_the_runs_final_average(tmp_path):
    (tmp_path / "last.dcp").mkdir()
    with pytest.raises(UserError) as e:
        export._averaged(tmp_path / "last.dcp")
    assert str(e.value) == (f"{tmp_path / 'last.dcp'} is sharded (FSDP2): each rank holds its own "
                            f"shards of the average; use the run's final_avg.safetensors instead")


def test_export_from_a_remote_without_checkpoints_asks_whether_it_is_one(tmp_path):
    empty = f"file://{tmp_path}/empty"
    for which in ("last", "best"):
        with pytest.raises(UserError) as e:
            export_run(empty, tmp_path / "m.safetensors", which)
        assert str(e.value) == (f"{empty} holds no complete {which} checkpoint; is it a "
                                f"checkpoint.remote URL?")
