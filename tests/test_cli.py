"""The real CLI end to end: outputs, the 64x1 vs 16x4 equivalence, and the run-dir guard."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from ironloop.cli import main
from tests.conftest import REPO, run_cli

FAST = ["train.epochs=2", "log.progress=off"]
DIGITS = str(REPO / "configs" / "digits.yaml")

# One test below and the fixture start `python -m ironloop` as a user would; the others call
# cli.main (what that command runs) in this process: no interpreter start each.


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli") / "digits"
    res = run_cli("train", "configs/digits.yaml", f"run.dir={run_dir}", *FAST)
    assert res.returncode == 0, res.stderr
    return run_dir, res


def test_train_writes_every_output(digits_run):
    run_dir, res = digits_run
    for name in ("config.yaml", "metrics.jsonl", "epochs.jsonl", "final.safetensors",
                 "results.json", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (run_dir / name).exists(), name
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "epoch", "loss", "lr", "grad_norm", "clipped", "samples_per_s"} <= set(
        metrics[0])
    epochs = [json.loads(x) for x in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert {"epoch", "train_loss", "val_loss", "val_acc", "lr", "seconds"} <= set(epochs[0])
    results = json.loads((run_dir / "results.json").read_text())
    assert {"best_val_acc", "test_acc", "test_loss", "steps", "seconds"} <= set(results)
    assert results["steps"] == epochs[-1]["step"]
    assert "epoch 2/2" in res.stdout  # not a TTY: plain epoch lines, no progress bar
    assert "\r" not in res.stdout + res.stderr


def test_accumulation_equivalence_through_the_cli(tmp_path):
    # run.threads=1: with two intra-op threads a batch of 64 and four of 16 split their matmul
    # reductions differently, and Adam magnifies that rounding where a gradient is near zero
    # (0.7% on one bias after 46 steps); torch's thread count otherwise depends on the machine
    # and on what an earlier test in this process set
    common = [DIGITS, "model.name=mlp", "train.epochs=2", "log.progress=off",
              "checkpoint.enabled=false", "run.threads=1"]
    assert main(["train", *common, f"run.dir={tmp_path / 'a'}", "train.batch_size=64"]) == 0
    assert main(["train", *common, f"run.dir={tmp_path / 'b'}", "train.batch_size=16",
                 "train.accumulation_steps=4"]) == 0
    wa = load_file(tmp_path / "a" / "final.safetensors")
    wb = load_file(tmp_path / "b" / "final.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    steps = [json.loads((tmp_path / d / "results.json").read_text())["steps"] for d in "ab"]
    assert steps[0] == steps[1] == 2 * 23  # ceil(1438 / 64) optimizer steps per epoch


def test_existing_run_dir_is_refused_without_resume_or_overwrite(digits_run, capsys):
    run_dir, _ = digits_run
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    code = main(["train", DIGITS, f"run.dir={run_dir}", *FAST])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--resume" in err and "--overwrite" in err
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before


def test_overwrite_keeps_files_the_user_put_in_run_dir(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    args = ["train", DIGITS, f"run.dir={run_dir}", "train.epochs=1", "log.progress=off"]
    assert main(args) == 0
    assert main([*args, "--overwrite"]) == 0
    assert (run_dir / "notes.txt").read_text() == "mine"
    assert len((run_dir / "epochs.jsonl").read_text().splitlines()) == 1


def test_python_dash_m_and_help():
    res = run_cli("--help")
    assert res.returncode == 0 and "train" in res.stdout and "export" in res.stdout


def test_report_renders_a_real_run(digits_run, tmp_path, capsys):
    run_dir, _ = digits_run
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    for name in ("loss.png", "accuracy.png", "lr.png", "grad_norm.png", "grad_norm_hist.png",
                 "report.md", "report.html"):
        assert (tmp_path / "rep" / name).stat().st_size > 0, name
    assert "best val acc" in (tmp_path / "rep" / "report.md").read_text()
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


# --- flags and overrides in any order, --version, run.dir errors (issue 13) ---

from pathlib import Path  # noqa: E402

from ironloop import cli  # noqa: E402


def test_train_argv_puts_positionals_first_and_keeps_resume_paths(tmp_path):
    ckpt = tmp_path / "last.pt"
    ckpt.write_bytes(b"")
    assert cli.train_argv(["c.yaml", "--overwrite", "a.b=1", "c.d=2"]) == \
        ["c.yaml", "a.b=1", "c.d=2", "--overwrite"]
    assert cli.train_argv(["c.yaml", "--resume", "a.b=1", "c.d=2"]) == \
        ["c.yaml", "a.b=1", "c.d=2", "--resume"]
    assert cli.train_argv(["c.yaml", "--resume", str(ckpt), "a.b=1"]) == \
        ["c.yaml", "a.b=1", f"--resume={ckpt}"]
    assert cli.train_argv(["--resume", "c.yaml", "a.b=1"]) == ["c.yaml", "a.b=1", "--resume"]


def test_overrides_after_flags_and_several_after_resume(tmp_path, capsys):
    run_dir = tmp_path / "r"
    args = ["train", "configs/digits.yaml", "--overwrite", f"run.dir={run_dir}",
            "model.name=mlp", "train.epochs=1", "train.max_steps=3", "log.progress=off"]
    assert cli.main(args) == 0
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 3
    assert cli.main(["train", "configs/digits.yaml", "--resume", f"run.dir={run_dir}",
                     "model.name=mlp", "train.epochs=1", "train.max_steps=5", "log.progress=off",
                     "--allow-config-change"]) == 0
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 5
    assert "train.max_steps: 3 -> 5" in capsys.readouterr().out


def test_a_run_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = cli.main(["train", "configs/digits.yaml", f"run.dir={blocker / 'run'}",
                     "train.max_steps=1", "log.progress=off"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"run.dir {blocker / 'run'} cannot be created or written" in err


def test_version_and_train_help_name_the_same_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip().startswith("ironloop 0.")
    assert cli.main(["train", "help"]) == 0
    assert "train.max_steps = 0" in capsys.readouterr().out
    src = Path(cli.__file__).parent
    for path in src.rglob("*.py"):  # every docstring and help text names `ironloop train help`
        assert "--help-config" not in path.read_text(), path


@pytest.mark.parametrize("command", ["train", "doctor", "tune"])
def test_help_in_place_of_the_config_lists_the_keys_for_every_command_that_takes_one(
        command, capsys):
    # `ironloop doctor help` read "help" as a config file and failed (issue 57)
    assert cli.main([command, "help"]) == 0
    out = capsys.readouterr().out
    assert "train.max_steps = 0" in out and "optim.fused = null" in out


def test_every_command_has_a_help_description_and_no_override_list_is_required():
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        # `ironloop report --help` printed only its usage: no line on what the command does
        assert p.description and len(p.description) > 40, f"ironloop {name}: no description"
        for action in p._actions:
            if action.dest == "overrides":  # the CLI page marked them "required"
                assert not action.required and action.help, f"ironloop {name}: {action}"
    args = cli.parser().parse_args(["doctor", "c.yaml"])
    assert args.overrides == []
