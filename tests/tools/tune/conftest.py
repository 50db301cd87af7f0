"""The tune tests' fixtures: a fake clock for the modules under test, no CUDA, a logged fake
run_trial, and the signal handlers put back after each test (a trial's clock sets them)."""

from __future__ import annotations

import signal
import types

import pytest
import torch

from ironloop.tools.tune import output, stop, trials, tuner as tuner_mod
from tests.tools.tune.helpers import FakeClock, mk


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    for module in (tuner_mod, trials, output):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=fake))
    return fake


@pytest.fixture(autouse=True)
def _signal_handlers():
    """A trial's clock sets the signals' handlers (record_signals): put back the test run's."""
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def trial_log(clock, monkeypatch):
    """run_trial replaced: each call is logged as (overrides, plan, deadline) and answered by
    ``trial_log.answer(overrides)`` (a Measure, or an exception to raise); it costs
    ``trial_log.cost`` seconds of the fake clock."""
    log = types.SimpleNamespace(calls=[], subjects=[], cost=1.0,
                                answer=lambda overrides: mk(100.0))

    def run_trial(subj, overrides, plan, deadline):
        log.calls.append((dict(overrides), plan, deadline))
        log.subjects.append(subj)
        clock.now += log.cost
        answer = log.answer(overrides)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(tuner_mod, "run_trial", run_trial)
    return log
