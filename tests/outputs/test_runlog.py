"""outputs/runlog.py: the run's JSONL files, what a resume or a rollback keeps of them, and
which rows reach the trackers."""

from __future__ import annotations

import errno
import json

import pytest

from ironloop.errors import UserError
from ironloop.outputs import durable, runlog
from ironloop.outputs.runlog import RunLog


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path, key, values, torn=False):
    text = "".join(json.dumps({key: v, "time": float(v)}) + "\n" for v in values)
    path.write_text(text + ('{"step": 9' if torn else ""))


def test_truncate_keeps_the_lines_up_to_last_and_says_how_far_the_file_went(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, "step", [1, 2, 3, 4, 5], torn=True)
    assert runlog.truncate_jsonl(path, "step", 3) == 5
    assert [r["step"] for r in lines(path)] == [1, 2, 3]  # 3 itself stays; the torn line goes
    assert path.read_text().endswith("}\n")
    assert runlog.truncate_jsonl(path, "step", 3) == 3  # nothing past it any more


def test_truncate_of_a_missing_file_or_rows_without_the_key(tmp_path):
    assert runlog.truncate_jsonl(tmp_path / "none.jsonl", "step", 3) == 0
    assert not (tmp_path / "none.jsonl").exists()
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "start"}\n{"step": 4}\n')
    assert runlog.truncate_jsonl(path, "step", 0) == 4
    assert lines(path) == [{"event": "start"}]  # no key counts as 0: kept


def test_the_last_time_is_that_of_the_last_complete_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert runlog._last_time(path) is None
    write_rows(path, "step", [1, 2], torn=True)
    assert runlog._last_time(path) == 2.0
    path.write_text('{"step": 1}\n')
    assert runlog._last_time(path) is None


class Store:
    """A tracker behind the run log: what reaches it."""

    name = "store"

    def __init__(self):
        self.rows, self.calls = [], []

    def write(self, kind, row):
        self.rows.append((kind, row["step"]))

    def durable(self, step):
        self.calls.append(("durable", step))

    def rewind(self, step):
        self.calls.append(("rewind", step))

    def confirmed(self):
        return 7

    def ids(self):
        return {"store": "id-1"}

    def close(self):
        self.calls.append(("close",))


def test_every_file_but_events_goes_to_the_trackers(tmp_path):
    store = Store()
    log = RunLog(tmp_path, False, loggers=[store])
    for name in ("metrics", "epochs", "events", "evals", "scalars"):
        log.write(name, {"step": 1, "name": name})
    assert store.rows == [("metrics", 1), ("epochs", 1), ("evals", 1), ("scalars", 1)]
    assert lines(tmp_path / "events.jsonl") == [{"step": 1, "name": "events"}]
    assert log.ids() == {"store": "id-1"}
    log.durable(4)
    assert store.calls == [("durable", 4)]
    assert durable.read_marks(tmp_path) == {"store": 7}
    log.close()
    assert store.calls[-1] == ("close",)


def test_a_run_log_without_trackers_writes_no_marks(tmp_path):
    log = RunLog(tmp_path, False)
    log.write("metrics", {"step": 1})
    log.durable(1)
    log.close()
    assert not (tmp_path / durable.MARKS).exists()
    assert log.loggers == [] and log.ids() == {}


def test_a_resume_drops_what_the_killed_process_logged_past_its_checkpoint(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", "step", [1, 2, 3, 4, 5, 6])
    write_rows(tmp_path / "evals.jsonl", "step", [2, 4, 6])
    write_rows(tmp_path / "scalars.jsonl", "step", [3, 6])
    write_rows(tmp_path / "epochs.jsonl", "epoch", [1, 2, 3])
    log = RunLog(tmp_path, False, resume_step=4, resume_epoch=1)
    assert log.last_logged_step == 6 and log.last_logged_time == 6.0
    log.write("metrics", {"step": 5})
    log.close()
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in lines(tmp_path / "evals.jsonl")] == [2, 4]
    assert [r["step"] for r in lines(tmp_path / "scalars.jsonl")] == [3]
    assert [r["epoch"] for r in lines(tmp_path / "epochs.jsonl")] == [1]


def test_a_fresh_run_log_appends_and_knows_no_earlier_process(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", "step", [1, 2])
    log = RunLog(tmp_path, False)
    assert log.last_logged_step == 0 and log.last_logged_time is None
    log.write("metrics", {"step": 3})
    log.close()
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_rollback_rewinds_the_files_and_the_trackers_then_goes_on_appending(tmp_path):
    store = Store()
    log = RunLog(tmp_path, False, loggers=[store])
    for step in range(1, 6):
        log.write("metrics", {"step": step})
        log.write("evals", {"step": step})
    log.write("epochs", {"epoch": 1, "step": 3})
    log.write("epochs", {"epoch": 2, "step": 5})
    log.rewind(3, 1)
    assert store.calls == [("rewind", 3)]
    log.write("metrics", {"step": 4, "again": True})
    log.close()
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert lines(tmp_path / "metrics.jsonl")[-1] == {"step": 4, "again": True}
    assert [r["step"] for r in lines(tmp_path / "evals.jsonl")] == [1, 2, 3]
    assert [r["epoch"] for r in lines(tmp_path / "epochs.jsonl")] == [1]


def test_tensorboard_is_added_once_and_told_the_resume_step(tmp_path, monkeypatch):
    from ironloop.outputs import loggers

    class TB(loggers.Logger):
        name = "tensorboard"

        def __init__(self, run_dir, confirmed):
            self.args = (run_dir, confirmed)

    monkeypatch.setattr(loggers, "TensorBoard", TB)
    log = RunLog(tmp_path, True, resume_step=3)
    (tb,) = log.loggers
    assert tb.name == "tensorboard" and tb.inner.inner.args == (tmp_path, 3)
    log.close()
    assert RunLog(tmp_path, False).loggers == []
    mine = Store()
    mine.name = "tensorboard"
    assert RunLog(tmp_path, True, loggers=[mine]).loggers == [mine]


class Full:
    """A file whose write takes part of the line, then finds the disk full."""

    def __init__(self, f):
        self.f, self.calls = f, 0

    def fileno(self):
        return self.f.fileno()

    def write(self, data):
        self.calls += 1
        if self.calls == 1:
            return self.f.write(data[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.f.close()


def test_a_full_disk_cuts_the_torn_line_and_says_what_to_do(tmp_path):
    store = Store()
    log = RunLog(tmp_path, False, loggers=[store])
    log.write("metrics", {"step": 1})
    log._files["metrics"] = Full(log._files["metrics"])
    with pytest.raises(UserError) as e:
        log.write("metrics", {"step": 2, "loss": 0.5})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert str(e.value).startswith(f"could not write {tmp_path / 'metrics.jsonl'}: No space "
                                   f"left on device. The logs end at their last complete line")
    assert store.rows == [("metrics", 1)]  # the failed row reaches no tracker


def test_a_partial_write_is_finished(tmp_path):
    class Partial(Full):
        def write(self, data):
            self.calls += 1
            return self.f.write(data[:3])

    log = RunLog(tmp_path, False)
    log._files["events"] = Partial(log._files["events"])
    log.write("events", {"step": 1, "event": "start"})
    log.close()
    assert lines(tmp_path / "events.jsonl") == [{"step": 1, "event": "start"}]


def test_marks_that_cannot_be_written_stop_the_run_like_a_log_line(tmp_path, monkeypatch):
    def no_room(run_dir, marks):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(durable, "write_marks", no_room)
    log = RunLog(tmp_path, False, loggers=[Store()])
    with pytest.raises(UserError, match=f"could not write {tmp_path / durable.MARKS}: Disk quota"):
        log.durable(1)
