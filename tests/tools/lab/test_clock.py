"""tools.lab.clock in process: the CPU seconds, the load and what a clock reports of each part."""

from __future__ import annotations

from types import SimpleNamespace

from ironloop.tools.lab import clock as lab_clock
from ironloop.tools.lab.clock import Clock

# -- clock.py -------------------------------------------------------------------------------------

def test_cpu_seconds_add_this_process_and_its_waited_for_children(monkeypatch):
    times = SimpleNamespace(user=1.0, system=2.0, children_user=4.0, children_system=8.0)
    monkeypatch.setattr(lab_clock.os, "times", lambda: times)
    assert lab_clock.cpu_seconds() == 15.0


def test_the_load_is_the_1_minute_average_or_0_where_there_is_none(monkeypatch):
    monkeypatch.setattr(lab_clock.os, "getloadavg", lambda: (1.5, 2.5, 3.5))
    assert lab_clock.load() == 1.5

    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(lab_clock.os, "getloadavg", unavailable)
    assert lab_clock.load() == 0.0
    monkeypatch.delattr(lab_clock.os, "getloadavg")
    assert lab_clock.load() == 0.0


def test_a_clock_times_each_part_and_reports_the_load_range_and_totals(monkeypatch, capsys):
    loads = iter([0.5, 2.25, 1.0])
    monkeypatch.setattr(lab_clock, "load", lambda: next(loads))
    monkeypatch.setattr(lab_clock.os, "cpu_count", lambda: 16)
    ticks = iter([10.0, 12.5, 20.0, 20.25])
    cpus = iter([100.0, 103.0, 200.0, 200.5])
    monkeypatch.setattr(lab_clock.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(lab_clock, "cpu_seconds", lambda: next(cpus))
    clock = Clock()
    assert clock.rows == [] and clock.loads == [0.5] and clock.cores == 16
    with clock.part("1-baseline"):
        pass
    with clock.part("plots"):
        pass
    assert clock.rows == [("1-baseline", 2.5, 3.0), ("plots", 0.25, 0.5)]
    assert clock.loads == [0.5, 2.25, 1.0]
    assert capsys.readouterr().out == ("[lab] 1-baseline: 2.5 s wall, 3.0 s CPU (load 2.2 on 16 "
                                       "cores)\n[lab] plots: 0.2 s wall, 0.5 s CPU (load 1.0 on "
                                       "16 cores)\n")
    assert clock.under() == "16 cores, load average 0.5-2.2 while it ran"
    assert clock.table() == (["part", "wall s", "CPU s"],
                             [["1-baseline", "2.5", "3.0"], ["plots", "0.2", "0.5"],
                              ["total", "2.8", "3.5"]])


def test_a_clock_counts_one_core_where_the_count_is_unknown(monkeypatch):
    monkeypatch.setattr(lab_clock.os, "cpu_count", lambda: None)
    assert Clock().cores == 1
