"""Shared fixtures: tiny deterministic data and a helper to run the real CLI."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ironloop
from ironloop.callbacks import Callback
from ironloop.data.loader import TensorData

# A `python -m ironloop` that a test starts imports the code this process imported: under mutmut
# that is its mutated copy (mutants/src), whose trampolines read the mutant's name from the
# environment the subprocess inherits, so the end-to-end tests see a mutant too (issue 45).
# Otherwise it is this checkout's src/, as the editable install's would be. Set per test
# (pytest_runtest_setup): not in mutmut's mapping run ("stats"), where a subprocess's trampoline
# would look for mutmut's config in the subprocess's directory and fail, and whose hits a
# subprocess could not report anyway.
_PYTHONPATH = os.environ.get("PYTHONPATH")
_WITH_SRC = os.pathsep.join(filter(None, [str(Path(ironloop.__file__).resolve().parents[1]),
                                          _PYTHONPATH]))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def blobs(n: int = 200, d: int = 8, c: int = 3, seed: int = 0) -> TensorData:
    """Gaussian blobs: learnable in a few steps, n chosen by the test (ragged or not)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(c, d, generator=g) * 2
    y = torch.randint(0, c, (n,), generator=g)
    x = torch.randn(n, d, generator=g) + centres[y]
    return TensorData(x, y)


class StopAt(Callback):
    """Ends the run after ``step`` (saved there, as train.max_steps would): the interruption."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run, metrics: dict) -> None:
        if run.step >= self.step:
            run.stop()


def tiny_mlp(d: int = 8, c: int = 3, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(d, 16), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(16, c))


def plateau_recorder(seen: list) -> type:
    """A ReduceLROnPlateau class that records every metric the loop steps it with."""

    class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics):  # records what the loop passes
            seen.append(metrics)
            super().step(metrics)

    return Plateau


def cfg(tmp_path: Path, **overrides) -> dict:
    """A fast config for fit(): dotted keys, run.dir under tmp_path."""
    base = {"run.dir": str(tmp_path / "run"), "train.epochs": 2, "train.batch_size": 32,
            "log.every_steps": 1, "log.progress": "off", "checkpoint.keep_last": 0}
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return base


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m ironloop ...` as a user would, capturing output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ironloop", *args], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def logged_step(run_dir: Path) -> int:
    """The newest step in run_dir/metrics.jsonl while a process is writing it (0 before the
    first line, or while the last line is half written)."""
    try:
        # Only the file's tail: the kill tests poll this every few milliseconds while the run
        # they wait on needs the CPU, and reading the whole log each time cost several percent
        # of a core by the end of a run.
        with (run_dir / "metrics.jsonl").open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, ValueError, IndexError):  # JSONDecodeError is a ValueError
        return 0


#: How long a kill test waits for a run to reach the point where it is killed. A run gets there in
#: seconds; one still short of it after this long is hung (issue 45: stop 52's CI waited on one
#: for an hour, until its limit ended the run with no test named).
HANG_S = 300.0


def wait_running(proc, reached, what: str, output=lambda: "", every: float = 0.005) -> None:
    """Poll until ``reached()`` is true or ``proc`` (a Popen or a tests/forked.py Child) ends,
    every ``every`` seconds (waiting on the files the run writes, not on a clock). A run still
    short of it after HANG_S is hung: a forked Child gets SIGABRT first (its faulthandler writes
    every thread's stack into its output), then it is SIGKILLed, and the test fails
    naming ``what`` with ``output()``'s tail."""
    deadline = time.monotonic() + HANG_S
    while proc.poll() is None and not reached():
        if time.monotonic() > deadline:
            if getattr(proc, "dumps_on_abort", False):  # its faulthandler writes every stack
                proc.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            proc.kill()
            proc.wait(timeout=60)
            pytest.fail(f"no {what} after {HANG_S:.0f} s: the run hung\n{output()[-6000:]}")
        time.sleep(every)


def piped_stderr(proc: subprocess.Popen):
    """``output`` for wait_running of a run whose stderr is a pipe: what it wrote once it is
    dead (bounded: a killed run's loader workers can hold the pipe a few seconds longer)."""
    def read() -> str:
        try:
            return proc.communicate(timeout=30)[1] or ""
        except (subprocess.TimeoutExpired, ValueError) as e:
            return f"(its stderr could not be read: {e!r})"
    return read


def train_or_kill(cmd: list[str], run_dir: Path, cwd: Path, env: dict,
                  kill_at: int | None = None) -> None:
    """Run ``cmd`` (an ``ironloop train`` into run_dir) to its end, or, with ``kill_at``,
    SIGKILL it once metrics.jsonl holds that step (waiting on the file, not on a clock)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if kill_at is not None:
        wait_running(proc, lambda: logged_step(run_dir) >= kill_at, f"step {kill_at}",
                     piped_stderr(proc))
        assert proc.poll() is None, f"finished before step {kill_at}: {proc.stderr.read()}"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        return
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


@pytest.fixture
def quick_lease(monkeypatch):
    """A remote prefix's claim waits SETTLE_S (0.5 s) for a concurrent claim to land before it
    reads its lease back: in-process runs claim one at a time, so the wait only adds up (about
    a second a test in the remote tests). The race itself is tested with the real wait."""
    from ironloop.state.remote import lease as remote_lease

    monkeypatch.setattr(remote_lease, "SETTLE_S", 0.01)


@pytest.fixture(scope="module")
def cpu_alone():
    """Tests whose outcome rests on measured speed (tune's trials) or on a timed sequence of
    signals (SLURM's preemption grace time and time limits) take turns, across the test
    workers: under --dist loadfile test_tune.py and test_slurm.py can run at the same time on
    two workers, and side by side each made the other fail (CI of stop 48: tune
    found no faster micro-batch, the low-priority job was never preempted). An exclusive lock
    on one file in the temp directory, held for the whole module (before its module fixtures:
    the SLURM cluster's jobs start there); other files run beside either as before."""
    with (Path(tempfile.gettempdir()) / "ironloop-tests-cpu-alone.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def shared_dir() -> Path:
    return SHARED


def chromium() -> str | None:
    """A Chromium for the report tests: $IRONLOOP_CHROMIUM, else Debian's `chromium` on PATH."""
    import shutil

    return os.environ.get("IRONLOOP_CHROMIUM") or shutil.which("chromium") \
        or shutil.which("chromium-browser")


def open_in_browser(path: Path | str, width: int, wait_until: str = "load") -> dict:
    """Render an HTML file (or a URL) in headless Chromium (Playwright, with the system's
    browser: no download) at ``width`` px; what a reader would notice. Skips when there is no
    browser. ``wait_until="networkidle"`` also waits for what the page's scripts fetch."""
    return open_all_in_browser([(path, width)], wait_until)[0]


def open_all_in_browser(targets: list[tuple[Path | str, int]], wait_until: str = "load") -> list:
    """``open_in_browser`` for each (file or URL, width), in one browser: a launch is seconds."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install playwright)")
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium: apt-get install chromium, or set IRONLOOP_CHROMIUM")
    results = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            for path, width in targets:
                errors: list[str] = []
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.on("console", lambda m, errors=errors: errors.append(m.text)
                        if m.type == "error" else None)
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto(path if isinstance(path, str) else path.resolve().as_uri(),
                          wait_until=wait_until)
                seen = page.evaluate("""() => ({
                    images: [...document.images].map(i => ({name: i.alt, ok: i.complete
                                                            && i.naturalWidth > 0})),
                    overflow: document.documentElement.scrollWidth - window.innerWidth,
                    text: document.body.innerText})""")
                page.close()
                results.append({**seen, "errors": errors})
        finally:
            browser.close()
    return results


def pytest_runtest_setup(item) -> None:
    """PYTHONPATH for the subprocesses this test (and its fixtures) start: see _WITH_SRC."""
    path = _PYTHONPATH if os.environ.get("MUTANT_UNDER_TEST") == "stats" else _WITH_SRC
    if path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = path


#: Seconds per test file (setup, call and teardown of its tests, module fixtures included), as
#: the reports reach this process: under xdist, the controller, from every worker.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The ten slowest test files, and the sum over all files: the suite's time is about that
    sum over the workers, so this is where to look first when it grows (issue 45)."""
    if len(_FILE_SECONDS) < 2:
        return
    top = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]
    terminalreporter.write_sep("-", f"the ten slowest test files of {len(_FILE_SECONDS)} "
                                    f"(seconds, module fixtures included; all files: "
                                    f"{sum(_FILE_SECONDS.values()):.0f} s)")
    for path, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")

