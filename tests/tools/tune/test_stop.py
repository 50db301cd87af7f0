"""tools.tune.stop: the signals that stop a tune, their handlers, and the stale trial
directories."""

from __future__ import annotations

import os
import signal

import pytest

from ironloop.tools.tune import stop

# -- stop.py ------------------------------------------------------------------------------------


def test_a_signal_stop_names_the_signal_and_exits_as_a_shell_reports_it():
    e = stop.Stopped("SIGINT")
    assert (e.signal_name, e.exit_code) == ("SIGINT", 130)
    assert str(e) == ("tune stopped by SIGINT; nothing written (no tune.json, no tuned.yaml): "
                      "run it again to tune")
    assert stop.Stopped("SIGTERM").exit_code == 143
    with pytest.raises(stop.Stopped) as raised:
        stop._raise(signal.SIGTERM, None)
    assert raised.value.signal_name == "SIGTERM"


def test_the_tunes_handlers_raise_while_it_runs_and_the_previous_ones_come_back():
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    assert stop.SIGNALS == (signal.SIGINT, signal.SIGTERM)
    with stop.stop_on_signals():
        for sig in stop.SIGNALS:
            assert signal.getsignal(sig) is stop._raise
        received: list[str] = []
        stop.record_signals(received)  # a trial's loop: the signals are noted, not raised
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        assert received == ["SIGTERM", "SIGINT"]
    assert {sig: signal.getsignal(sig) for sig in stop.SIGNALS} == before


def test_only_the_main_thread_sets_signal_handlers():
    import threading

    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    seen = []

    def body():
        with stop.stop_on_signals():
            seen.append("in")
        stop.record_signals([])

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == ["in"]
    assert {sig: signal.getsignal(sig) for sig in stop.SIGNALS} == before


def test_stale_trial_directories_are_those_of_gone_processes_and_only_directories(
        tmp_path, monkeypatch):
    assert stop.trial_prefix() == f"ironloop-tune-{os.getpid()}-"
    gone = 4_000_000  # above any pid_max: never alive
    monkeypatch.setattr(stop, "alive", lambda pid: pid != gone)
    for name in (f"ironloop-tune-{gone}-a-b", f"ironloop-tune-{gone}-c", "ironloop-tune-12-live",
                 "ironloop-tune-x1-y"):
        (tmp_path / name).mkdir()
    (tmp_path / f"ironloop-tune-{gone}-file").write_text("")
    assert stop.clean_stale(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        f"ironloop-tune-{gone}-file", "ironloop-tune-12-live", "ironloop-tune-x1-y"])
    # no root: the temporary directory
    (tmp_path / f"ironloop-tune-{gone}-d").mkdir()
    monkeypatch.setattr(stop.tempfile, "gettempdir", lambda: str(tmp_path))
    assert stop.clean_stale() == 1 and not (tmp_path / f"ironloop-tune-{gone}-d").exists()
