"""Bad inputs that used to crash with a raw exception (issue 29, item 6) end in one line naming
the bad thing and the fix: exit 2 from the CLI, a UserError subclass from fit()."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import ironloop
from ironloop.callbacks import Callback
from ironloop.cli import main
from ironloop.errors import CheckpointError, ConfigError, DataError, UserError
from ironloop.outputs import console
from ironloop.state.io import load_verified
from tests.conftest import blobs, tiny_mlp
from tests.engine.test_preempt import ARGS

FAST = [*ARGS, "train.epochs=1", "train.max_steps=3"]

FACTORIES = '''
import torch
from torch import nn

def empty_train():
    x, y = torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)
    return torch.utils.data.TensorDataset(x, y), None

def blobs_no_classes():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    return {"train": torch.utils.data.TensorDataset(x, y), "val": None}

def model_with_default(input_shape, num_classes=4):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))

def model_with_a_bug(input_shape, num_classes=4):
    return nn.Linear(input_shape[0], num_classes, bogus=1)  # a TypeError inside the factory

def flat_output(input_shape, num_classes=4):
    return nn.Sequential(nn.Linear(input_shape[0], 1), nn.Flatten(0))  # (N,), not (N, C)
'''


def conf(tmp_path, **kw) -> dict:
    return {"run.dir": str(tmp_path / "run"), "log.progress": "off", "train.epochs": 1,
            "doctor.preflight": False, **kw}


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ironloop: error: "), err
    return err[0]


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_data_factory_returning_an_empty_training_set_is_one_line(factories, capsys):
    assert main(["train", *FAST, "data.name=my_factories:empty_train",
                 f"run.dir={factories / 'run'}"]) == 2
    assert "empty training split" in one_line(capsys)


def test_a_model_factory_keeps_its_own_num_classes_default_when_the_data_gives_none(
        factories, capsys):
    assert main(["train", *FAST, "data.name=my_factories:blobs_no_classes",
                 "model.name=my_factories:model_with_default",
                 f"run.dir={factories / 'run'}"]) == 0, capsys.readouterr().err


def test_an_error_inside_a_model_factory_is_the_factorys_own(factories, capsys):
    assert main(["train", *FAST, "data.name=my_factories:blobs_no_classes",
                 "model.name=my_factories:model_with_a_bug",
                 f"run.dir={factories / 'run'}"]) == 2
    line = one_line(capsys)
    assert "raised TypeError" in line and "bogus" in line and "rejected" not in line, line


def test_a_model_with_flat_output_for_a_classification_loss_is_one_line(factories, capsys):
    assert main(["train", *FAST, "data.name=my_factories:blobs_no_classes",
                 "model.name=my_factories:flat_output", f"run.dir={factories / 'run'}"]) == 2
    assert "does not fit the loss" in one_line(capsys)
    model = nn.Sequential(nn.Linear(8, 1), nn.Flatten(0))
    with pytest.raises(UserError, match=r"output Tensor\[32\].*does not fit the loss"):
        ironloop.fit(model, blobs(n=64), None, conf(factories, **{"train.batch_size": 32}))
    # the failed runs logged no step: the corrected rerun in the same run.dir is accepted
    assert main(["train", *FAST, "data.name=my_factories:blobs_no_classes",
                 "model.name=my_factories:model_with_default",
                 f"run.dir={factories / 'run'}"]) == 0, capsys.readouterr().err


def test_an_unknown_early_stop_metric_is_refused_before_any_training(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *FAST, "early_stop.metric=val_bogus", f"run.dir={run_dir}"]) == 2
    line = one_line(capsys)
    assert "early_stop.metric='val_bogus'" in line and "val_acc" in line
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert main(["train", *FAST, "early_stop.metric=val_acc", f"run.dir={run_dir}"]) == 0


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run:\n  dir: caf\xe9\n".encode("latin-1"))
    assert main(["train", str(bad)]) == 2
    line = one_line(capsys)
    assert str(bad) in line and "UTF-8" in line


class Strings(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return f"text {i}", i % 2


def test_string_batches_are_one_line(tmp_path):
    with pytest.raises(DataError, match="a batch is a str"):
        ironloop.fit(tiny_mlp(), Strings(), None, conf(tmp_path, **{"train.batch_size": 4}))


def test_fit_without_training_data_is_one_line(tmp_path):
    with pytest.raises(DataError, match="train_data is None"):
        ironloop.fit(tiny_mlp(), None, None, conf(tmp_path))


def test_fit_with_a_function_as_the_model_is_one_line(tmp_path):
    with pytest.raises(UserError, match="model must be a torch.nn.Module, not function"):
        ironloop.fit(lambda x: x, blobs(), None, conf(tmp_path))


def test_inputs_and_targets_of_different_lengths_are_one_line(tmp_path):
    with pytest.raises(DataError, match="inputs hold 10 samples and the targets 9"):
        ironloop.fit(tiny_mlp(), (torch.randn(10, 8), torch.zeros(9, dtype=torch.long)), None,
                     conf(tmp_path))


def test_a_step_fn_returning_a_bare_loss_is_one_line_naming_the_form_to_return(tmp_path):
    def bare(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    with pytest.raises(UserError, match=r"^step_fn returned Tensor\[\] float32; return \(loss, "
                                        r"\{name: scalar tensor\}\) or \(loss, \{...\}, weight\)"):
        ironloop.fit(tiny_mlp(), blobs(), None, conf(tmp_path), step_fn=bare)


def test_a_models_own_runtime_error_keeps_its_message_and_is_not_called_a_shape_misfit(
        tmp_path):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")  # not about inputs

    with pytest.raises(RuntimeError, match="CUDNN_STATUS_INTERNAL_ERROR") as info:
        ironloop.fit(Broken(), blobs(), None, conf(tmp_path))
    assert type(info.value) is RuntimeError


def test_integer_inputs_into_a_float_model_are_one_line(tmp_path):
    x, y = torch.randint(0, 5, (32, 8)), torch.randint(0, 3, (32,))
    with pytest.raises(DataError, match=r"inputs are Tensor\[\d+, 8\] int64.*\.float\(\)"):
        ironloop.fit(tiny_mlp(), (x, y), None, conf(tmp_path))


def test_the_bad_inputs_raise_user_errors_not_config_errors_by_accident():
    # the hierarchy the CLI relies on: each class here is a UserError (exit 2, one line)
    assert issubclass(DataError, UserError) and issubclass(ConfigError, UserError)


class BlockTheMarks(Callback):
    """After the first checkpoint, trackers.json cannot be replaced any more: a real OSError
    from the filesystem on the trackers' next hand-over, as a full disk gives one."""

    def on_checkpoint(self, run, info) -> None:
        marks = Path(run.cfg.run.dir) / "trackers.json"
        if marks.is_file():
            marks.unlink()
            marks.mkdir()
            (marks / "keep").write_text("")  # a non-empty directory: os.replace fails


def test_a_tracker_hand_over_that_cannot_be_written_is_one_line_and_leaves_no_temp_file(
        tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=r"could not write .*trackers.json.*--resume"):
        ironloop.fit(tiny_mlp(), blobs(n=128), None,
                     conf(tmp_path, **{"log.tensorboard": True, "checkpoint.every_steps": 2,
                                       "train.batch_size": 16, "log.every_steps": 1}),
                     callbacks=[BlockTheMarks()])
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]
    assert (run_dir / "checkpoints" / "last.pt").exists()


def test_resuming_past_the_runs_length_says_that_nothing_is_trained():
    plan = console.RunPlan(10, 23, 3, window=64)
    at = SimpleNamespace(step=69, epoch=3, offset=0)
    line = console.resume_line({"from": "last.pt", "step": 69, "steps_redone": 0}, at, plan, [])
    assert "at step 69/10" in line and "Nothing to train" in line and "train.max_steps" in line
    fresh = console.resume_line({"from": "last.pt", "step": 5, "steps_redone": 0}, at, plan, [])
    assert "Nothing to train" not in fresh


def test_an_empty_validation_split_is_warned_about(tmp_path, capsys):
    empty = (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    ironloop.fit(tiny_mlp(), blobs(n=32), empty, conf(tmp_path))
    assert "validation split is empty" in capsys.readouterr().out


def test_a_text_file_named_like_a_checkpoint_says_what_it_is(tmp_path):
    text = tmp_path / "last.pt"
    text.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(CheckpointError, match="not a file torch.save wrote: it starts with "
                                              "'hello, this is not a che"):
        load_verified(text)


def test_the_guard_stop_advice_fits_the_run():
    from ironloop.guard.reporter import advice

    quiet = advice(1.0, "fp32")  # clipping on already, and no fp16 to move off
    assert quiet == "Try a lower optim.lr"  # the one fix left, said in full
    loud = advice(0.0, "fp16")
    assert "clip.max_norm=1.0" in loud and "bf16 instead of fp16" in loud


def test_all_nan_training_data_stops_in_one_line_instead_of_ending_with_0_steps(tmp_path):
    x, y = torch.full((200, 8), float("nan")), torch.randint(0, 3, (200,))
    with pytest.raises(UserError, match="skip list and fewer than one batch is left") as e:
        ironloop.fit(tiny_mlp(), (x, y), None, conf(tmp_path, **{"train.batch_size": 64}))
    assert "\n" not in str(e.value)


def test_consecutive_nan_at_steps_are_one_incident_one_rollback_each_step_named(tmp_path,
                                                                              capsys):
    import json

    result = ironloop.fit(tiny_mlp(), blobs(n=256), None,
                          conf(tmp_path, **{"fault.nan_at_step": [3, 4, 5],
                                            "train.batch_size": 16, "guard.max_bad_steps": 3,
                                            "guard.max_rollbacks": 3}))
    rows = [json.loads(line) for line in (tmp_path / "run" / "guard.jsonl").read_text()
            .splitlines()]
    # the knob fires once per listed step: the replay after the rollback is clean
    assert [r["event"] for r in rows] == ["bad_step"] * 3 + ["rollback"], rows
    assert [r["injected_at_step"] for r in rows[:3]] == [3, 4, 5]
    out = capsys.readouterr().out
    for listed in (3, 4, 5):  # every warning names its own listed step, not "step 3" thrice
        assert f"injected by fault.nan_at_step's step {listed}:" in out
    r = result.results
    assert (r["bad_steps"], r["rollbacks"], r["skipped_samples"]) == (3, 1, 48)
