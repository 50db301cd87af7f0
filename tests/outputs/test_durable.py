"""outputs/durable.py: a tracker gets a row only once a checkpoint covers its step, and a resume
sends exactly what it lacks. The trackers here record what reaches them; the real trackers'
files are read back after SIGKILLs in tests/outputs/test_loggers.py."""

from __future__ import annotations

import json

from ironloop.outputs import durable
from ironloop.outputs.loggers import Logger


class Store(Logger):
    """A tracker whose store is a list; ``asynchronous`` ones land in it only at flush()."""

    name = "store"

    def __init__(self, asynchronous=False, held=None):
        self.asynchronous, self.rows, self.queued, self._held = asynchronous, [], [], held

    def write_rows(self, rows):
        (self.queued if self.asynchronous else self.rows).extend(rows)

    def flush(self):
        self.rows += self.queued
        self.queued = []

    def held_steps(self):
        return self._held


def row(step, kind="metrics"):
    return kind, {"step": step, "loss": 1.0 / step}


def steps(store):
    return [r["step"] for _, r in store.rows]


def test_rows_wait_for_the_checkpoint_that_covers_them():
    store = Store()
    d = durable.Durable(store, 0)
    for s in range(1, 8):
        d.write(*row(s))
    assert steps(store) == []
    d.durable(5)
    assert steps(store) == [1, 2, 3, 4, 5] and d.confirmed == 5
    d.rewind(6)  # a guard rollback to step 6: step 7 will be redone
    d.finish(failing=False)
    assert steps(store) == [1, 2, 3, 4, 5, 6]


def test_a_failing_close_keeps_what_no_checkpoint_covers():
    store = Store()
    d = durable.Durable(store, 0)
    for s in range(1, 5):
        d.write(*row(s))
    d.durable(2)
    d.finish(failing=True)
    assert steps(store) == [1, 2]


def test_an_asynchronous_tracker_is_confirmed_one_hand_over_later():
    store = Store(asynchronous=True)
    d = durable.Durable(store, 0)
    for s in range(1, 7):
        d.write(*row(s))
    d.durable(3)
    assert steps(store) == [] and d.confirmed == 0  # queued, not yet in the store
    d.durable(6)
    assert steps(store) == [1, 2, 3] and d.confirmed == 3
    d.finish(failing=False)
    assert steps(store) == [1, 2, 3, 4, 5, 6] and d.confirmed == 6


def test_a_failing_close_of_an_asynchronous_tracker_waits_for_what_it_was_sent():
    store = Store(asynchronous=True)
    d = durable.Durable(store, 0)
    for s in range(1, 6):
        d.write(*row(s))
    d.durable(3)
    assert steps(store) == [] and d.confirmed == 0
    d.finish(failing=True)  # the hand-over at step 3 is flushed; 4 and 5 are the resume's
    assert steps(store) == [1, 2, 3] and d.confirmed == 3 and store.queued == []


def test_without_checkpoints_rows_go_straight_through():
    store = Store()
    durable.Durable(store, 0, passthrough=True).write(*row(1))
    assert steps(store) == [1]


def test_catch_up_sends_what_each_tracker_lacks_up_to_the_checkpoint(tmp_path):
    for kind, rows in (("metrics", range(1, 11)), ("epochs", (5, 10))):
        (tmp_path / f"{kind}.jsonl").write_text(
            "".join(json.dumps({"step": s, "x": s}) + "\n" for s in rows))
    told = Store(held={"metrics": 4, "epochs": 0})  # its own files say: metrics up to 4
    marked = Store()  # can only go by what it confirmed (trackers.json)
    trackers = [durable.Durable(told, 0), durable.Durable(marked, 6)]
    durable.catch_up(trackers, tmp_path, 8)
    assert [(k, r["step"]) for k, r in told.rows] == \
        [("metrics", s) for s in range(5, 9)] + [("epochs", 5)]
    assert [(k, r["step"]) for k, r in marked.rows] == [("metrics", 7), ("metrics", 8)]


def test_marks_round_trip_and_tolerate_a_missing_file(tmp_path):
    assert durable.read_marks(tmp_path) == {}
    durable.write_marks(tmp_path, {"tensorboard": 12, "wandb": None})
    assert durable.read_marks(tmp_path) == {"tensorboard": 12}


def test_with_async_checkpoint_writes_a_tracker_gets_every_row_a_save_on_disk_covers(
        tmp_path, monkeypatch, recwarn):
    # An async save is on disk once the next save returns, so each save hands the tracker the
    # rows up to the previous one; the first save of a run hands over those up to its start.
    import ironloop
    from ironloop.outputs import loggers
    from tests.conftest import blobs, cfg, tiny_mlp

    store = Store()
    monkeypatch.setattr(loggers, "build",
                        lambda *a: [loggers.Guarded(durable.Durable(store, 0))])
    ironloop.fit(tiny_mlp(), blobs(), None,
                 cfg(tmp_path, **{"checkpoint.async": True}, checkpoint__every_steps=2))
    assert not [w for w in recwarn if "logging failed" in str(w.message)]
    assert sorted({r["step"] for kind, r in store.rows if kind == "metrics"}) == \
        list(range(1, 15))


def test_a_resumed_run_log_hands_its_trackers_what_they_lack_up_to_the_resume_step(tmp_path):
    from ironloop.outputs.loggers import Guarded
    from ironloop.outputs.runlog import RunLog

    # killed after logging step 10, resumed from the checkpoint at step 8
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 11)))
    store = Store(held={"metrics": 4})  # its own files hold up to step 4
    log = RunLog(tmp_path, False, resume_step=8, loggers=[Guarded(durable.Durable(store, 4))])
    log.catch_up(8)
    assert steps(store) == [5, 6, 7, 8]
    assert durable.read_marks(tmp_path) == {"store": 8}
    log.close()


def test_catch_up_sends_every_row_of_a_kind_the_tracker_holds_nothing_of(tmp_path):
    for kind, rows in (("metrics", (1, 2, 3)), ("epochs", (1, 3))):  # one-step epochs
        (tmp_path / f"{kind}.jsonl").write_text(
            "".join(json.dumps({"step": s}) + "\n" for s in rows))
    fresh = Store(held={"metrics": 1})  # its files name no epochs: it holds none of them
    durable.catch_up([durable.Durable(fresh, 0)], tmp_path, 3)
    assert [(k, r["step"]) for k, r in fresh.rows] == \
        [("metrics", 2), ("metrics", 3), ("epochs", 1), ("epochs", 3)]  # step 1's too


def test_catch_up_skips_a_row_without_a_step(tmp_path):
    (tmp_path / "scalars.jsonl").write_text('{"x": 1}\n{"step": 2, "x": 2}\n')
    store = Store(held={})
    durable.catch_up([durable.Durable(store, 0)], tmp_path, 5)
    assert store.rows == [("scalars", {"step": 2, "x": 2})]
