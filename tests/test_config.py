"""Config: types, dotted overrides, and one clear line per mistake (exit 2, no traceback)."""

from __future__ import annotations

import pytest
import yaml

from ironloop.cli import main
from ironloop.config import Config, load_config
from ironloop.errors import ConfigError
from tests.conftest import REPO, run_cli


def test_overrides_are_typed_and_nested():
    c = load_config(REPO / "configs" / "digits.yaml",
                    ["optim.lr=3e-4", "train.epochs=3", "model.kwargs.hidden=[32, 16]",
                     "checkpoint.async=true", "clip.max_norm=0"])
    assert c.optim.lr == 3e-4 and isinstance(c.optim.lr, float)
    assert c.train.epochs == 3 and c.model.kwargs == {"hidden": [32, 16]}
    assert c.checkpoint.async_write is True and c.clip.max_norm == 0.0


def test_to_dict_round_trips():
    c = load_config(None, ["optim.lr=0.01", "checkpoint.async=true"])
    assert Config.from_dict(c.to_dict()) == c
    assert c.to_dict()["checkpoint"]["async"] is True


def test_yaml_float_without_dot_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n")  # YAML 1.1 reads this as a string
    assert load_config(path).optim.lr == 1e-3


@pytest.mark.parametrize("override, key, hint", [
    ("optim.lrr=0.1", "optim.lrr", "known keys in 'optim'"),
    ("bogus.key=1", "bogus.key", "section one of"),
    ("train.epochs=abc", "train.epochs", "expected an integer"),
    ("train.batch_size=1.5", "train.batch_size", "expected an integer"),
    ("optim.eps=0", "optim.eps", "must be > 0"),
    ("optim.lr=-1e-3", "optim.lr", "must be >= 0"),  # 0 is accepted: it freezes the weights
    ("train.accumulation_steps=0", "train.accumulation_steps", "must be >= 1"),
    ("schedule.name=linear", "schedule.name", "constant, warmup_cosine, onecycle"),
    ("optim.name=lion", "optim.name", "adamw, adam, sgd"),
    ("train.precision=fp8", "train.precision", "fp32, fp16, bf16, auto"),
    ("data.val_fraction=1.5", "data.val_fraction", "[0, 1)"),
    ("log.tensorboard=maybe", "log.tensorboard", "true or false"),
])
def test_each_config_error_names_the_key(override, key, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in str(e.value) and hint in str(e.value)


@pytest.mark.parametrize("override, key", [
    ("model.name=resnet9000", "model.name"),
    ("data.name=imagenet", "data.name"),
])
def test_unknown_model_and_dataset_list_the_choices(override, key, capsys, tmp_path):
    code = main(["train", str(REPO / "configs" / "digits.yaml"), override,
                 f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == 2 and key in err
    assert ("small_cnn" in err) if key == "model.name" else ("digits" in err and "mnist1d" in err)


def test_missing_config_file_and_bad_override_form(capsys, tmp_path):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["train", str(REPO / "configs" / "digits.yaml"), "optim.lr"]) == 2
    assert "dotted.key=value" in capsys.readouterr().err


def test_cli_bad_config_exits_2_with_one_line_and_no_traceback(tmp_path):
    res = run_cli("train", "configs/digits.yaml", "train.accumulation_steps=0",
                  f"run.dir={tmp_path / 'r'}")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.accumulation_steps" in lines[0]


def test_shipped_configs_are_valid():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        Config.from_dict(raw)  # raises on any unknown or mistyped key


def test_help_lists_every_key(capsys):
    assert main(["train", "help"]) == 0
    out = capsys.readouterr().out
    for key in ("run.dir", "train.accumulation_steps", "checkpoint.async", "schedule.T_0"):
        assert key in out
    # each key's allowed values (issue 44: schedule.name and optim.name gave none)
    lines = {line.split(" = ")[0]: line for line in out.splitlines()}
    assert "(one of: constant | warmup_cosine | onecycle | cosine" in lines["schedule.name"]
    assert "adamw | adam | sgd, or a torch.optim class" in lines["optim.name"]
    assert "(one of: norm | value)" in lines["clip.mode"]


def test_every_default_train_help_prints_is_an_override_the_parser_takes():
    # `ironloop train help` showed `optim.fused = None`, which the parser refuses
    from ironloop.config import describe, load_config

    overrides = [line.split("  # ")[0].replace(" = ", "=", 1) for line in describe().splitlines()]
    assert "optim.fused=null" in overrides
    optim = [o for o in overrides if o.startswith("optim.")]
    assert load_config(None, optim).optim.fused is None  # each taken as printed
