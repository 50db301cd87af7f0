"""One attempt of a SLURM job (engine/slurm.py): a time limit's warning that lands while the run
starts is not requeued again and again (``checkpoint.slurm_min_steps``), and a requeue SLURM did
itself (``scontrol requeue`` by hand) is told as a requeue, not as a scancel. The pure decisions
first, then ``after_stop`` against a ``scontrol`` on PATH that answers as the test cluster did;
tests/engine/test_slurm.py runs both on the real cluster."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ironloop.config import load_config
from ironloop.engine.slurm import Decision, EarlySignals, after_stop, decide, held_back
from ironloop.errors import Preempted, UserError

NOW = time.mktime(time.strptime("2026-11-26T17:00:00", "%Y-%m-%dT%H:%M:%S"))
LIMIT = Decision("time limit", True, "40 s to the time limit")


def test_a_job_slurm_requeued_during_the_attempt_is_a_requeue_not_a_scancel():
    # as `scontrol requeue` left it on the test cluster: COMPLETING, Reason=None, Restarts + 1
    requeued = {"JobState": "COMPLETING", "Reason": "None", "Restarts": "1"}
    assert decide(requeued, NOW, True, restarts=0) == Decision(
        "requeue", True, "the job is COMPLETING, requeued by SLURM: Restarts 0 -> 1")
    # the same count as at the attempt's start: a scancel of a job requeued earlier
    assert decide(requeued, NOW, True, restarts=1) == \
        Decision("scancel", False, "the job is COMPLETING")
    # a running job's count is the attempt's own, whatever it is
    running = {"JobState": "RUNNING", "EndTime": "2026-11-26T17:00:40", "Restarts": "3"}
    assert decide(running, NOW, True, restarts=0) == LIMIT


def test_an_attempt_that_trained_fewer_than_slurm_min_steps_is_not_requeued_saying_why():
    got = held_back(LIMIT, 1, 5, " (3 s after this attempt started)")
    assert (got.cause, got.requeue) == ("time limit", False)
    assert got.why == ("40 s to the time limit; no progress: this attempt trained 1 step, fewer "
                       "than checkpoint.slurm_min_steps=5")
    assert got.fix.startswith("the warning came during start-up (3 s after this attempt "
                              "started): ask for a time limit (--time) longer than the "
                              "signal's lead (--signal=USR1@T")
    assert "2 steps, fewer" in held_back(LIMIT, 2, 5).why
    # enough steps, the check off, or the steps not known: requeued as before
    for trained, least in ((5, 5), (1, 0), (None, 5)):
        assert held_back(LIMIT, trained, least) == LIMIT


def test_only_a_time_limit_is_held_back_a_preemption_or_a_refused_requeue_is_kept():
    preempted = Decision("preemption", True, "preempted at 2026-11-26T16:59:58")
    assert held_back(preempted, 1, 5) == preempted  # the scheduler's choice, not a loop
    off = Decision("time limit", False, "40 s; checkpoint.slurm_requeue=false")
    assert held_back(off, 1, 5) == off


def test_slurm_min_steps_is_a_config_key_that_refuses_a_negative_count():
    assert load_config(None, []).checkpoint.slurm_min_steps == 5
    assert load_config(None, ["checkpoint.slurm_min_steps=0"]).checkpoint.slurm_min_steps == 0
    with pytest.raises(UserError, match="checkpoint.slurm_min_steps"):
        load_config(None, ["checkpoint.slurm_min_steps=-1"])


def _scontrol(bin_dir: Path, show: str) -> Path:
    """A ``scontrol`` on PATH: ``show job`` prints ``show``; ``requeue`` is written down."""
    bin_dir.mkdir()
    calls = bin_dir / "requeues"
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"$2\" >> {calls}; "
                      f"exit 0; fi\necho '{show}'\n")
    script.chmod(0o755)
    return calls


def _stop(tmp_path: Path, monkeypatch, show: str, started: int | None, step: int,
          restarts: str | None = None, min_steps: int = 5) -> tuple[list[dict], bool]:
    """``after_stop`` of a saved SIGUSR1 stop at ``step`` in job 42, run.dir's events.jsonl
    holding this attempt's start at ``started``; the events, and whether scontrol requeue ran."""
    calls = _scontrol(tmp_path / "bin", show)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("RANK", raising=False)
    if restarts is None:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    if started is not None:  # an earlier attempt's start, then this one's
        rows = [{"event": "start", "step": 0}, {"event": "start", "step": started}]
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stop = Preempted("SIGUSR1", step, saved=True)
    stop.signalled_at = time.time()
    before = {sig: signal.getsignal(sig) for sig in EarlySignals.SIGNALS}
    try:
        after_stop(tmp_path, stop, requeue=True, min_steps=min_steps)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"].startswith("slurm")], calls.exists()


def _running(started_s_ago: float, left_s: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - started_s_ago))
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + left_s))
    return f"JobId=42 JobState=RUNNING StartTime={stamp} EndTime={end} PreemptTime=None"


def test_a_warning_during_start_up_exits_without_a_requeue_in_one_line_naming_the_lead(
        tmp_path, monkeypatch, capsys):
    got, requeued = _stop(tmp_path, monkeypatch, _running(5, 55), started=200, step=201)
    assert not requeued
    assert [(e["event"], e["cause"], e["requeue"], e["trained"]) for e in got] == \
        [("slurm_stop", "time limit", False, 1)]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("ironloop: SLURM job 42: time limit (")
    assert "no progress: this attempt trained 1 step, fewer than checkpoint.slurm_min_steps=5" \
        in out
    # when it came, from the scheduler's StartTime and EndTime (a second either way: the clock)
    assert "): not requeued; the warning came during start-up (" in out
    lead = out.split("during start-up (")[1].split(")")[0]
    after, before, limit = (int(w) for w in lead.split() if w.isdigit())
    assert abs(after - 5) <= 1 and abs(before - 55) <= 1 and abs(limit - 60) <= 1, lead
    assert "--signal=USR1@T" in out and out.endswith("which continues with --resume\n")


def test_an_attempt_that_trained_enough_steps_is_requeued_and_records_them(
        tmp_path, monkeypatch, capsys):
    got, requeued = _stop(tmp_path, monkeypatch, _running(30, 30), started=200, step=205)
    assert requeued
    assert [(e["event"], e.get("trained")) for e in got] == \
        [("slurm_stop", 5), ("slurm_requeue", None)]
    assert "requeued; it resumes from step 205" in capsys.readouterr().out


def test_a_run_dir_without_a_start_line_is_requeued_as_before(tmp_path, monkeypatch):
    got, requeued = _stop(tmp_path, monkeypatch, _running(5, 55), started=None, step=1)
    assert requeued and got[0]["trained"] is None


def test_a_requeue_by_hand_is_reported_as_a_requeue_and_not_requeued_again(
        tmp_path, monkeypatch, capsys):
    show = "JobId=42 JobState=COMPLETING Reason=None Restarts=3 EndTime=Unknown"
    got, requeued = _stop(tmp_path, monkeypatch, show, started=7, step=9, restarts="2")
    assert not requeued  # SLURM has put it back in the queue already
    assert [(e["event"], e["cause"], e["requeue"], e["restarts"]) for e in got] == \
        [("slurm_stop", "requeue", True, 3)]
    assert capsys.readouterr().out == (
        "ironloop: SLURM job 42: requeue (the job is COMPLETING, requeued by SLURM: Restarts 2 "
        "-> 3): requeued; it resumes from step 9\n")
