"""scripts/gpu-check (issue 46): its dry run goes end to end on a CPU and reports every part,
a part that crashes or hangs is recorded without stopping the others, and ``-m gpu`` selects
every test that needs CUDA.

CUDA is hidden from the runs here, so these tests mean the same on a GPU machine.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ("story", "syncs", "peers", "resume", "cuda_tests", "rollback", "overhead")


def gpu_check(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([str(REPO / "scripts" / "gpu-check"), "--dry-run", "--out", str(out),
                           *args], capture_output=True, text=True, env=env, timeout=2400)


@pytest.mark.slow
def test_the_dry_run_reports_every_part_and_row_naming_the_device(tmp_path):
    done = gpu_check(tmp_path)
    log = (tmp_path / "gpu-check.log").read_text() if (tmp_path / "gpu-check.log").exists() \
        else ""
    assert done.returncode == 0, done.stdout[-3000:] + log[-5000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    rows, text = report["rows"], (tmp_path / "gpu-check.md").read_text()
    assert report["dry_run"] and set(report["parts"]) == set(PARTS)
    for part in PARTS:
        mine = [r for r in rows if r["part"] == part]
        assert mine, f"no row for {part}"
        assert all(r["device"] == "cpu" for r in mine), mine
        assert all(r["status"] == "ok" or r["status"].startswith("skipped") for r in mine), mine
        assert all(f"| {r['row']} | cpu | {r['status']} |" in text for r in mine), part
    by_row = {(r["part"], r["row"]): r for r in rows}
    # every step of the seed's story that a CPU can run was measured
    story = [r for r in rows if r["part"] == "story"]
    assert len(story) == 6 and story[0]["row"] == "fp32, num_workers=0"
    assert all(r["figures"]["images_per_s"] > 0 for r in story if r["status"] == "ok")
    assert [r["status"] for r in story].count("ok") == 5  # fp16 needs CUDA
    assert "picked" in story[-1]["figures"]
    # the sync check ran its arming over plain steps; CUDA's verdict is the one skipped
    syncs = [r for r in rows if r["part"] == "syncs"]
    assert len(syncs) == 4 and all(r["figures"]["plain_steps_checked"] > 0 for r in syncs)
    assert all(r["status"].startswith("skipped: no CUDA") for r in syncs)
    # every loop trained both models and was timed (a dry run's differences of two tiny
    # timings can come out negative on a loaded CPU: numbers, not their signs), and the
    # verdict rows name ironloop against each peer
    for model in ("resnet50", "char_gpt"):
        for loop in ("hand", "ironloop", "Lightning", "Accelerate"):
            row = by_row[("peers", f"{model}: {loop}")]
            assert isinstance(row["figures"]["ms_per_step"], float), row
        verdict = next(r for r in rows if r["part"] == "peers"
                       and r["row"].startswith(f"{model}: verdict"))
        assert {"ironloop / hand", "ironloop / Lightning", "ironloop / Accelerate"} <= \
            set(verdict["figures"])
    # the kill -9 landed mid-epoch, after a checkpoint, and the resume matched (CPU: exact)
    (resume,) = [r for r in rows if r["part"] == "resume"]
    assert resume["figures"]["resumed_from_step"] < resume["figures"]["killed_at_step"]
    assert resume["figures"]["bit_exact"] is True
    # the rollback point's copies were timed both ways and the pinned one equals the state
    (rollback,) = [r for r in rows if r["part"] == "rollback"]
    assert rollback["figures"]["equal"] is True and rollback["figures"]["tensors"] > 0
    assert rollback["figures"]["pageable_ms"] > 0 and rollback["figures"]["pinned_landed_ms"] > 0
    tests = {r["row"] for r in rows if r["part"] == "cuda_tests"}
    assert "test_prefetch::test_cuda_batches_arrive_on_the_device_equal_to_the_host_ones" \
        in tests and len(tests) >= 5


@pytest.mark.slow
def test_a_part_that_hangs_or_crashes_is_recorded_and_the_next_still_runs(tmp_path):
    # The hang costs its cap plus the grace, so it is the part with the smallest share
    # (rollback: 15 of 450, a cap of 3 s at --budget 100), and the crash the part after it in
    # RUN_ORDER (peers: 140 of 450, a cap of 31 s): the crash comes after torch's import, which
    # takes over 10 s on a loaded 2-core machine (a cap of 5 s plus the grace made a crash read
    # "killed at its cap").
    done = gpu_check(tmp_path, "--only", "rollback", "peers", "--budget", "100",
                     env={"GPU_CHECK_FAULT": "rollback:hang,peers:crash"})
    assert done.returncode == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    status = {r["part"]: r["status"] for r in report["rows"]}
    assert status == {"rollback": status["rollback"], "peers": status["peers"]}
    assert status["rollback"].startswith("failed: killed at its")
    assert status["peers"].startswith("failed: exited 1")  # it ran after the killed one
    assert "peers crashes on purpose" in (tmp_path / "gpu-check.log").read_text()
    assert "failed: killed at its" in (tmp_path / "gpu-check.md").read_text()


def _decorators(fn: ast.FunctionDef) -> list[str]:
    return [ast.unparse(d) for d in fn.decorator_list]


def test_every_test_that_needs_cuda_is_marked_gpu():
    """gpu-check's part 5 runs ``pytest -m gpu``: a CUDA test without the mark never runs."""
    unmarked = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        if "cuda.is_available" not in text:  # no such skip in it: no need to parse it
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                marks = _decorators(node)
                needs_cuda = any("skipif" in d and "cuda.is_available" in d for d in marks)
                if needs_cuda and "pytest.mark.gpu" not in marks:
                    unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"skip without CUDA but lack @pytest.mark.gpu: {unmarked}"
