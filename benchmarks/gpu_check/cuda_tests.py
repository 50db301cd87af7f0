"""Part 5, the CUDA-only tests: ``pytest -m gpu`` on the test files that hold such tests.

Only those files are collected (the rest of the suite imports packages the device machine may
lack). Every test that skips without CUDA carries the ``gpu`` mark (tests/e2e/test_gpu_check.py
checks that), so ``-m gpu`` runs them all. One row per test, from pytest's JUnit XML; without
CUDA they are all skipped, and the rows say so.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_check.shared import Part

REPO = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def outcome(case: ET.Element) -> str:
    for tag, word in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
        found = case.find(tag)
        if found is not None:
            why = (found.get("message") or "").splitlines()
            return f"{word}: {why[0][:300] if why else tag}"
    return "ok"


def main() -> None:
    part = Part("cuda_tests", __doc__.splitlines()[0])
    files = gpu_test_files()
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *files]
        start = time.time()
        try:
            done = subprocess.run(cmd, cwd=REPO, timeout=max(5.0, part.left() - 3),
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            part.write("pytest -m gpu", f"failed: still running at the part's cap "
                                        f"({time.time() - start:.0f} s)")
            return
        print(done.stdout[-6000:], done.stderr[-3000:], file=sys.stderr)
        if not xml.exists():
            part.write("pytest -m gpu", f"failed: pytest exited {done.returncode} with no "
                                        f"report: {done.stderr.strip()[-300:]}")
            return
        cases = ET.parse(xml).getroot().iter("testcase")
        for case in cases:
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            status = outcome(case)
            if status.startswith("skipped") and not part.cuda:
                status = "skipped: no CUDA"
            part.write(name, status, seconds=round(float(case.get("time", 0)), 2))
        part.write("pytest -m gpu", "ok" if done.returncode in (0, 5) else
                   f"failed: pytest exited {done.returncode}", files=" ".join(files),
                   exit_code=done.returncode)


if __name__ == "__main__":
    main()
