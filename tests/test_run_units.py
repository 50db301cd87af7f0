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
from ironloop.state import dcp as sharded


class ShardRecorder(sharded.ShardedCheckpointManager):
    """Stands in for the sharded manager: records each save instead of writing shards."""

    def __init__(self):
        self.async_write, self.saves = False, []

    def save(self, state, model, optimizer, step, best=False):
        self.saves.append((state, model, optimizer, step, best))


class Seen(Callback):
    def __init__(self):
        self.checkpoints: list[dict] = []

    def on_checkpoint(self, run, metrics):
        self.checkpoints.append(metrics)


def _run(world: World, manager, log=None, callbacks=()) -> Run:
    module = SimpleNamespace(raw_model=torch.nn.Linear(2, 1), optimizer=object())
    progress = Progress()
    progress.step, progress.epoch = 7, 2
    run = Run(ironloop.Config(), world, None, module, progress, Meter(torch.device("cpu")),
              None, Outputs(log, manager, StepTimer(torch.device("cpu"), enabled=False)),
              None, None, SimpleNamespace(callbacks=list(callbacks)))
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
    (state, model, optimizer, step, best), = manager.saves
    assert state == {"progress": {"step": 7}, "loggers": {}, "guard": None}
    assert (model, optimizer, step, best) == (run.module.raw_model, run.module.optimizer, 7,
                                              True)
    (own,), = [offered]
    assert "ranks" not in own and own["samples"] == 0 and own["steps"] == 0
    assert run.meter.ranks == [{"rank": 0}, own]
    assert seen.checkpoints == []  # not rank 0
    assert run.outputs.last_saved == 0  # no logs to mark durable on this rank
