"""Nothing a user has is lost (issue 29): a wrong --resume directory, a resume of a run that
cannot be resumed, another run's checkpoint, a rewind, a refused foreign directory (twice).
The lock and orphaned workers: tests/state/test_lock_orphans.py; signals and workers:
test_preempt_workers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ironloop.cli import main
from tests.engine.test_preempt import ARGS, events

FAST = [*ARGS, "train.epochs=1", "train.max_steps=6", "checkpoint.every_steps=2"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a directory): byte-for-byte state."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ironloop: error: "), err
    return err[0]


def test_resume_from_a_directory_without_a_checkpoint_is_refused_and_the_run_stays_intact(
        tmp_path, capsys):
    run_dir, wrong = tmp_path / "r1", tmp_path / "empty_dir"
    assert main(["train", *FAST, f"run.dir={run_dir}"]) == 0
    wrong.mkdir()
    (wrong / "notes.txt").write_text("not a run\n")
    before, before_wrong = snapshot(run_dir), snapshot(wrong)
    assert any(k.startswith("checkpoints/step-") for k in before)
    capsys.readouterr()
    assert main(["train", *FAST, "train.max_steps=8", f"run.dir={run_dir}",
                 "--resume", str(wrong)]) == 2
    line = one_error_line(capsys)
    assert str(wrong) in line and "no checkpoint" in line
    assert snapshot(run_dir) == before and snapshot(wrong) == before_wrong


def test_a_bare_resume_of_a_finished_run_without_checkpoints_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert main(["train", *FAST, "checkpoint.enabled=false", f"run.dir={run_dir}"]) == 0
    before = snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", *FAST, "checkpoint.enabled=false", f"run.dir={run_dir}",
                 "--resume"]) == 2
    assert "checkpoint.enabled=false" in one_error_line(capsys)
    assert snapshot(run_dir) == before


def test_a_resume_from_another_runs_checkpoint_never_deletes_this_runs_newer_ones(
        tmp_path, capsys):
    mine, other = tmp_path / "mine", tmp_path / "other"
    keep = [*FAST, "checkpoint.keep_last=5"]
    assert main(["train", *keep, f"run.dir={mine}"]) == 0  # checkpoints up to step 6
    assert main(["train", *keep, f"run.dir={other}"]) == 0
    before = snapshot(mine)
    capsys.readouterr()
    step2 = other / "checkpoints" / "step-00000002.pt"
    assert main(["train", *keep, f"run.dir={mine}", "--resume", str(step2)]) == 2
    line = one_error_line(capsys)
    assert str(step2) in line and "step 6" in line
    assert snapshot(mine) == before


def test_a_rewind_to_an_older_checkpoint_of_the_same_run_drops_the_newer_ones(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert main(["train", *FAST, f"run.dir={run_dir}", "checkpoint.keep_last=5"]) == 0
    step2 = run_dir / "checkpoints" / "step-00000002.pt"
    assert main(["train", *FAST, f"run.dir={run_dir}", "checkpoint.keep_last=5",
                 "--resume", str(step2)]) == 0  # the user asked for this rewind
    out = capsys.readouterr().out
    assert "step-00000006.pt: it is past the step this run resumed from" in out
    assert [e["step"] for e in events(run_dir) if e["event"] == "resume"] == [2]


@pytest.mark.parametrize("resume", [False, True])
def test_a_refused_foreign_directory_is_unchanged_after_two_attempts(tmp_path, capsys, resume):
    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("lr: 0.1\n")
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    (run_dir / "doctor.json").write_text('{"mine": true}\n')
    before = snapshot(run_dir)
    flags = ["--resume"] if resume else []
    for attempt in (1, 2):  # the first refused attempt must not make the second one succeed
        # the preflight doctor on: it writes doctor.json, after the run.dir checks only
        assert main(["train", *FAST, "doctor.preflight=true", f"run.dir={run_dir}",
                     *flags]) == 2, attempt
        capsys.readouterr()
        assert snapshot(run_dir) == before, attempt


def test_a_refused_run_dir_that_did_not_exist_is_not_left_behind(tmp_path, capsys):
    run_dir = tmp_path / "new" / "run"
    assert main(["train", *FAST, f"run.dir={run_dir}", "--resume", str(tmp_path)]) == 2
    one_error_line(capsys)
    assert not (tmp_path / "new").exists()
