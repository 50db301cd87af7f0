"""Bad inputs of the third fault campaign, each one line and exit 2 from the CLI (or a
UserError from fit()), found before training where the config allows: rank variables set by
hand, a run.dir empty or with a component too long, SparseAdam on dense gradients, a store
that refuses the connection, remote_options a local store does not take, --resume's argument
empty, with --overwrite or a FIFO; from fit(): per-sample losses, a DataLoader without
batching, a list of validation sets, a dataset returning (x, y, w)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import ironloop
from ironloop.cli import main
from ironloop.errors import DataError, UserError
from tests.conftest import REPO, blobs, tiny_mlp

QUICK = ["train", str(REPO / "configs/digits.yaml"), "train.epochs=1", "log.progress=off"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
])
def test_rank_variables_set_by_hand_are_one_line_before_anything_trains(
        env, named, capsys, monkeypatch, tmp_path):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main([*QUICK, f"run.dir={tmp_path / 'run'}"]) == 2
    assert named in one_line(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("run_dir, said", [
    ("", "run.dir='': is empty"),
    ("{tmp}/" + "a" * 300, "component of 300 bytes"),
])
def test_a_run_dir_empty_or_with_a_too_long_name_is_refused(
        run_dir, said, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # empty: it trained into the current directory
    assert main([*QUICK, f"run.dir={run_dir.format(tmp=tmp_path)}"]) == 2
    assert said in one_line(capsys)
    assert os.listdir(tmp_path) == []


def test_sparse_adam_on_dense_gradients_is_refused_before_the_first_step(capsys, tmp_path):
    assert main([*QUICK, "optim.name=SparseAdam", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "SparseAdam" in one_line(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("remote, options, said", [
    ("ftp://127.0.0.1:9/x", None, "ConnectionRefusedError"),
    ("file://{tmp}/store", "{nonsense_kw: 5}", "nonsense_kw not a keyword of LocalFileSystem"),
])
def test_a_store_that_refuses_or_options_it_does_not_take_are_one_line(
        remote, options, said, capsys, tmp_path):
    args = [*QUICK, f"run.dir={tmp_path / 'run'}",
            f"checkpoint.remote={remote.format(tmp=tmp_path)}"]
    if options:
        args.append(f"checkpoint.remote_options={options}")
    assert main(args) == 2
    assert said in one_line(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, said", [
    (["--resume="], "--resume= names an empty path"),
    (["--overwrite", "--resume"], "--resume and --overwrite together"),
    (["--resume", "{tmp}/fifo"], "not a regular file or a folder"),
])
def test_resume_arguments_that_were_dropped_or_hung_are_refused(flags, said, capsys, tmp_path):
    os.mkfifo(tmp_path / "fifo")  # a read of it waited forever for a writer
    run_dir = tmp_path / "run"
    assert main([*QUICK, f"run.dir={run_dir}", *[f.format(tmp=tmp_path) for f in flags]]) == 2
    assert said in one_line(capsys)
    assert not (run_dir / "metrics.jsonl").exists()


def conf(tmp_path) -> dict:
    return {"run.dir": str(tmp_path / "run"), "log.progress": "off", "train.epochs": 1}


class Weighted(Dataset):
    """(x, y, w): a sample weight the default step would ignore."""

    def __init__(self):
        self.data = blobs(n=64)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, y, torch.tensor(0.5)


def per_sample(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("train, val, loss_fn, error, said", [
    (blobs(n=64), None, per_sample, UserError, r"loss_fn returned a Tensor\[64\]"),
    (DataLoader(blobs(n=64), batch_size=None), None, None, UserError, "batch_size=None"),
    (blobs(n=64), [blobs(n=16), blobs(n=16)], None, UserError, "a list of datasets"),
    (Weighted(), None, None, DataError, "a batch holds 3 items"),
], ids=["per-sample-loss", "loader-without-batches", "list-of-val-sets", "x-y-w"])
def test_fit_refuses_inputs_it_would_misread(train, val, loss_fn, error, said, tmp_path):
    with pytest.raises(error, match=said):
        ironloop.fit(tiny_mlp(), train, val, conf(tmp_path), loss_fn=loss_fn)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # nothing was trained
