"""engine/settle.py: a settle puts the host's step count and LR schedule where a guard that read
every step's verdict would have them, and says when a settle is due."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ironloop.engine.cadence import Cadence
from ironloop.engine.settle import LateSettle, _mark


class Module:
    """What a settle reads of the TrainModule: its optimizer, scheduler and schedule step."""

    def __init__(self, schedule_on: str = "step"):
        self.raw_model = torch.nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.raw_model.parameters(), lr=1.0)
        # LR 1/(1 + n) after n scheduler steps: every position has its own LR
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda n: 1 / (1 + n))
        self.schedule_on, self.lr_factor, self.lr = schedule_on, 1.0, 1.0
        self.stepped_at: list[int] = []  # the step each schedule step was told (its hold)

    def step_schedule(self, step: int) -> None:
        self.stepped_at.append(step)
        if self.schedule_on == "step":
            self.optimizer.step()  # no gradients: changes nothing, but comes first
            self.scheduler.step()

    def train_steps(self, progress, n: int) -> None:
        """n optimizer steps as the host counts them, bad ones included."""
        for _ in range(n):
            self.step_schedule(progress.step)
            progress.step += 1


class Reporter:
    """The guard's reporter: the verdicts of the steps since the last settle."""

    def __init__(self, settled=(0, [])):
        self.settled, self.verdicts = settled, SimpleNamespace(eager=False)
        self.policy = SimpleNamespace(totals=lambda: {"bad_steps": 2})
        self.loaded, self.closed = "never", False

    def settle(self, meter, progress, data, model, world, owner):
        return self.settled

    def load_state_dict(self, state):
        self.loaded = state

    def close(self):
        self.closed = True


def settle(late, module, progress):
    return late.settle(module, progress, None, None, None, None)


def test_bad_steps_take_back_the_step_count_and_their_schedule_positions():
    module, progress = Module(), SimpleNamespace(step=10)
    late = LateSettle(Reporter())
    late.begin(module, progress)
    module.train_steps(progress, 5)  # the host counted 5 steps; the 2nd and 4th were bad
    late.reporter.settled = (5, [1, 3])
    module.stepped_at.clear()
    assert settle(late, module, progress) is False  # the latest step was good
    assert module.stepped_at == [10, 11, 12]  # replayed at the good steps' own positions
    assert progress.step == 13
    assert module.scheduler.last_epoch == 3
    assert module.optimizer.param_groups[0]["lr"] == pytest.approx(1 / 4)
    assert module.lr == pytest.approx(1 / 3)  # the LR the last good step used
    # the next settle starts from here: two more steps, the last of them bad
    module.train_steps(progress, 2)
    late.reporter.settled = (2, [1])
    assert settle(late, module, progress) is True
    assert progress.step == 14 and module.scheduler.last_epoch == 4


def test_without_a_bad_step_a_settle_changes_nothing_but_the_mark():
    module, progress = Module(), SimpleNamespace(step=0)
    late = LateSettle(Reporter())
    late.begin(module, progress)
    module.train_steps(progress, 3)
    late.reporter.settled = (3, [])
    assert settle(late, module, progress) is False
    assert progress.step == 3 and module.scheduler.last_epoch == 3
    assert late.mark is not None and late.mark.step == 3


def test_a_settle_before_any_mark_corrects_nothing():
    module, progress = Module(), SimpleNamespace(step=4)
    late = LateSettle(Reporter((1, [0])))
    assert settle(late, module, progress) is True  # bad, but no mark to count from
    assert progress.step == 4
    assert late.mark is not None and late.mark.step == 4


def test_a_schedule_that_steps_at_evaluations_is_not_replayed():
    module, progress = Module(schedule_on="eval"), SimpleNamespace(step=0)
    mark = _mark(module, progress)
    assert mark.schedule is None and mark.lrs == []
    late = LateSettle(Reporter())
    late.begin(module, progress)
    progress.step = 4
    late.reporter.settled = (4, [0, 1])
    settle(late, module, progress)
    assert progress.step == 2 and module.scheduler.last_epoch == 0


def test_the_mark_of_a_step_schedule_holds_its_state_and_the_groups_lrs():
    module, progress = Module(), SimpleNamespace(step=7)
    module.train_steps(progress, 1)
    mark = _mark(module, progress)
    assert mark.step == 8 and mark.schedule is not None and mark.schedule["last_epoch"] == 1
    assert mark.lrs == [pytest.approx(0.5)]
    module.scheduler = None
    assert _mark(module, progress).schedule is None and _mark(module, progress).lrs == []


def test_a_settle_is_due_before_anything_that_needs_exact_numbers():
    late = LateSettle(Reporter())
    cadence = Cadence(log_every=5, eval_every=0, checkpoint_every=7, total_steps=20,
                      validates=False, fault_steps=frozenset({9}))
    assert [s for s in range(1, 25) if late.due(s, cadence)] == \
        [5, 7, 9, 10, 14, 15, 20, 21, 22, 23, 24]
    late.reporter.verdicts.eager = True  # a callback's on_step_end: every step
    assert all(late.due(s, cadence) for s in range(1, 25))


def test_a_checkpoint_follows_every_step_path_evaluation_and_checkpoint_every_steps():
    cadence = Cadence(log_every=5, eval_every=4, checkpoint_every=6, total_steps=20,
                      validates=True)
    assert [s for s in range(1, 13) if cadence.evaluates(s)] == [4, 8, 12]
    assert [s for s in range(1, 13) if cadence.saves(s)] == [4, 6, 8, 12]
    only_evals = Cadence(log_every=5, eval_every=3, checkpoint_every=0, total_steps=9,
                         validates=True)
    assert [s for s in range(1, 10) if only_evals.saves(s)] == [3, 6, 9]
    neither = Cadence(log_every=5, eval_every=0, checkpoint_every=0, total_steps=9,
                      validates=False)
    assert not any(neither.saves(s) or neither.evaluates(s) for s in range(1, 10))


def test_the_guards_state_totals_and_close_go_to_its_reporter():
    late = LateSettle(Reporter())
    late.load_state_dict(None)
    assert late.reporter.loaded is None
    assert late.totals() == {"bad_steps": 2}
    late.close()
    assert late.reporter.closed
