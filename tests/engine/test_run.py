"""engine/run.py's Run, in this process: what one save writes and hands on, on rank 0 and on a
rank without the logs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import ironloop
from ironloop.callbacks import Callback
from ironloop.engine import run as run_mod
from ironloop.engine.progress import Meter, Progress
from ironloop.engine.run import Outputs, Run
from ironloop.engine.timing import StepTimer
from ironloop.parallel.world import World
from ironloop.state.run_dir import RunDir


class ShardRecorder:
    """Stands in for the checkpointer under FSDP2 (every rank writes its shards): records each
    save instead of writing shards."""

    writes, async_write = True, False

    def __init__(self):
        self.saves = []

    def save(self, state, step, best=False):
        self.saves.append((state, step, best))

    def close(self):
        pass


class Seen(Callback):
    def __init__(self):
        self.checkpoints: list[dict] = []

    def on_checkpoint(self, run, metrics):
        self.checkpoints.append(metrics)


def _run(world: World, manager, log=None, callbacks=()) -> Run:
    module = SimpleNamespace(raw_model=torch.nn.Linear(2, 1), optimizer=object())
    progress = Progress()
    progress.step, progress.epoch = 7, 2
    outputs = Outputs(RunDir("run"), manager, StepTimer(torch.device("cpu"), enabled=False),
                      log=log)
    run = Run(cfg=ironloop.Config(), world=world, data=None, module=module, progress=progress,
              meter=Meter(torch.device("cpu")), tracker=None, outputs=outputs, guard=None,
              cadence=None, hooks=SimpleNamespace(callbacks=list(callbacks)))
    run.state_dict = lambda: {"progress": {"step": progress.step}}  # type: ignore[method-assign]
    return run


def test_a_rank_without_the_logs_saves_its_shards_with_no_tracker_ids(monkeypatch):
    """Under FSDP every rank saves its shards, but only rank 0 has the logs: another rank's
    checkpoint state says no W&B / MLflow ids, and it tells no callback (rank 0 does). Before
    that, every rank's meter is gathered (without the ranks a previous gather left)."""
    offered: list[dict] = []

    def gather(own, world):  # the two ranks' all_gather_object
        offered.append(own)
        return [{"rank": 0}, own]

    monkeypatch.setattr(run_mod, "gather_objects", gather)
    manager, seen = ShardRecorder(), Seen()
    run = _run(World(rank=1, size=2), manager, log=None, callbacks=[seen])
    run.meter.ranks = [{"stale": True}]
    run.save(best=True)
    (state, step, best), = manager.saves
    assert state == {"progress": {"step": 7}}  # Run.state_dict's, handed on whole
    assert (step, best) == (7, True)
    (own,), = [offered]
    assert "ranks" not in own and own["samples"] == 0 and own["steps"] == 0
    assert run.meter.ranks == [{"rank": 0}, own]
    assert seen.checkpoints == []  # not rank 0
    assert run.outputs.last_saved == 0  # no logs to mark durable on this rank


class FileRecorder:
    """Stands in for rank 0's checkpointer (one file a save): records each save."""

    def __init__(self, async_write: bool, writes: bool = True):
        self.async_write, self.writes, self.saves = async_write, writes, []

    def save(self, state, step, best=False):
        self.saves.append((state, step, best))


class LogRecorder:
    """Stands in for rank 0's RunLog: the trackers' ids, and the steps made durable."""

    def __init__(self):
        self.durable_steps: list[int] = []

    def ids(self):
        return {"wandb": "abc123"}

    def durable(self, step):
        self.durable_steps.append(step)


def test_rank_0_saves_with_the_trackers_ids_and_marks_the_logs_durable_up_to_the_file_on_disk():
    """A blocking write is on disk when save returns: the trackers get the rows up to this
    step. An async write is on disk only once the next save returns: up to the previous one.
    The callbacks hear of each checkpoint, with its step, epoch and whether it is the best."""
    for async_write, durable, is_best in ((False, 7, True), (True, 3, False)):
        manager, log, seen = FileRecorder(async_write), LogRecorder(), Seen()
        run = _run(World(), manager, log=log, callbacks=[seen])
        run.outputs.last_saved = 3
        run.save(best=is_best)
        (state, step, best), = manager.saves
        assert state == {"progress": {"step": 7}}
        assert (step, best) == (7, is_best)
        assert (log.durable_steps, run.outputs.last_saved) == ([durable], 7)
        assert seen.checkpoints == [{"step": 7, "epoch": 2, "best": is_best}]


class ReporterRecorder:
    """Stands in for the guard's reporter: its checkpointed state, and the saves it was told
    of (each moves its in-memory rollback point)."""

    def __init__(self):
        self.told: list = []

    def state_dict(self):
        return {"skip": [4]}

    def saved(self, run):
        self.told.append(run.progress.step)


def test_a_save_puts_the_guard_s_state_in_the_checkpoint_and_moves_its_rollback_point(
        monkeypatch):
    manager, reporter = FileRecorder(False), ReporterRecorder()
    run = _run(World(), manager, log=LogRecorder())
    run.guard = SimpleNamespace(reporter=reporter)
    run.save(best=False)
    assert reporter.told == [7]
    # the whole checkpoint dict is Run.state_dict's: the guard's part and the trackers' ids
    monkeypatch.setattr(run_mod, "collect_state",
                        lambda config, model, parts, **values: {**parts, **values})
    m = run.module
    m.scheduler = m.scaler = m.carry = m.average = None
    m.schedule_steps, m.lr = 0, 0.1
    run.tracker = None
    run.data = SimpleNamespace(source=SimpleNamespace(state_dict=lambda: {}))
    state = Run.state_dict(run)
    assert state["guard"] is reporter and state["loggers"] == {"wandb": "abc123"}


def test_without_checkpoints_a_save_writes_nothing_and_tells_no_callback_but_the_guard():
    log, seen, reporter = LogRecorder(), Seen(), ReporterRecorder()
    run = _run(World(), FileRecorder(False, writes=False), log=log, callbacks=[seen])
    run.guard = SimpleNamespace(reporter=reporter)
    run.save(best=True)
    assert (log.durable_steps, seen.checkpoints, run.outputs.last_saved) == ([], [], 0)
    assert reporter.told == [7]  # the in-memory rollback point moves all the same
