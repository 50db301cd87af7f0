"""guard/reporter.py one part at a time, in-process and without a training run: the reporter's
start and state, settle bookkeeping and messages, the rollback target (the device verdict:
test_verdict.py; the fault knobs: test_faults.py)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from ironloop.config import Config
from ironloop.guard import reporter as rep
from ironloop.guard.reporter import GuardReporter, GuardStop, RolledBack
from ironloop.guard.verdict import Pending, device_verdicts
from ironloop.parallel.world import World
from ironloop.state.checkpointer import Checkpointer
from ironloop.state.io import save_atomic
from ironloop.state.run_dir import RunDir

F64 = torch.float64


def reporter(tmp_path, *overrides: str, from_files: bool = False,
             accumulation: int = 1, advice: str = "") -> GuardReporter:
    conf = Config().with_overrides([*overrides]).guard
    verdicts = device_verdicts(conf, torch.device("cpu"), torch.float64)
    return GuardReporter(conf, tmp_path, verdicts, from_files, accumulation, advice)


class Run:
    """The run as the reporter sees it (``owner``): a state_dict it snapshots and puts back."""

    def __init__(self, progress=None):
        self.w, self.progress = torch.tensor([1.0, 2.0]), progress

    def state_dict(self) -> dict:
        return {"w": self.w, "step": 0 if self.progress is None else self.progress.step}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]
        if self.progress is not None:
            self.progress.step = state["step"]


class Data:
    """A training BatchSource's bad-path parts: position p of the epoch's order is sample
    100 + p; the samples ``nonfinite`` names have non-finite inputs (none by default: a bad
    step the inputs do not explain)."""

    def __init__(self, global_batch: int = 4, usable: int = 64,
                 nonfinite: tuple[int, ...] = ()):
        self.global_batch, self.usable, self.skips = global_batch, usable, []
        self.nonfinite = nonfinite

    def indices(self, start: int, end: int) -> list[int]:
        return [100 + p for p in range(start, end)]

    def nonfinite_inputs(self, samples: list[int]) -> list[int]:
        return [i for i in samples if i in self.nonfinite]

    def set_skip(self, skip) -> None:
        self.skips.append(list(skip))
        self.usable = 64 - len(skip)


def meter(loss_sum: float = 0.0, samples: int = 0):
    forgot = []
    return SimpleNamespace(loss_sum=torch.tensor(loss_sum, dtype=F64), tokens=None,
                           samples=samples, forgot=forgot,
                           forget=lambda n, k: forgot.append((n, k)))


def started(tmp_path, *overrides: str, world: World | None = None, **kw) -> GuardReporter:
    guard = reporter(tmp_path, *overrides, **kw)
    guard.start(Run(), meter(), 0, None, world or World(), (False, False))
    return guard


def pend(d, windows: list[tuple[float, float, int, int]]) -> None:
    """Pending verdicts for windows of (loss sum, grad norm, epoch offset, local samples)
    after each; ok is whether both are finite."""
    before = torch.zeros((), dtype=F64)
    for loss, norm, offset, samples in windows:
        total = before + loss
        d.pending.append(Pending(torch.tensor(math.isfinite(loss) and math.isfinite(norm)),
                                 total, before, torch.tensor(norm)))
        d.offsets.append(offset)
        d.samples.append(samples)
        before = total if math.isfinite(loss) else before


def lines(tmp_path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (tmp_path / "guard.jsonl").read_text().splitlines()]


# --- start, snapshot, state -----------------------------------------------------------------

def test_start_baselines_the_verdicts_opens_guard_jsonl_and_snapshots_the_run(tmp_path):
    guard, run, log = reporter(tmp_path), Run(), object()
    guard.verdicts.pending = ["stale"]
    guard.start(run, meter(3.0, samples=40), 16, log, World(), (False, False))
    d = guard.verdicts
    assert (d.pending, d.offsets, d.samples, float(d._before)) == ([], [16], [40], 3.0)
    assert guard.log is log and guard.is_main and guard.file is not None
    assert guard.file.name == str(tmp_path / "guard.jsonl") and guard.file.mode == "a"
    assert guard.snapshot is not None and guard.snapshot["w"].tolist() == [1.0, 2.0]
    run.w.add_(1)  # training goes on: the snapshot is a copy
    assert guard.snapshot["w"].tolist() == [1.0, 2.0]
    run.w = torch.tensor([5.0, 5.0])
    guard.saved(run)  # a checkpoint: the in-memory rollback point moves with it
    assert guard.snapshot["w"].tolist() == [5.0, 5.0]
    guard.close()
    assert guard.file is None
    guard.close()  # twice: nothing left to close


def test_only_rank_0_writes_guard_jsonl_and_says_what_it_does(tmp_path, capsys):
    guard = started(tmp_path, world=World(rank=1, size=2))
    assert not guard.is_main and guard.file is None
    guard._write({"event": "x"})
    guard._say("hello")
    assert guard.policy.logged == 1  # counted on every rank: it is part of the checkpoint
    assert not (tmp_path / "guard.jsonl").exists() and capsys.readouterr().out == ""
    main = started(tmp_path)
    main._write({"event": "x"})
    main._say("hello")
    assert lines(tmp_path) == [{"n": 1, "event": "x"}]
    assert capsys.readouterr().out == "warning: guard: hello\n"


def test_the_rollback_point_moves_into_its_own_tensors_and_a_rollback_gets_a_fresh_copy(
        tmp_path):
    """A save point copies into the last snapshot's tensors (its page-locked memory on a GPU is
    allocated once); what a rollback loads is a copy, so the snapshot survives the rollback."""
    run = Run()
    guard = started(tmp_path)
    kept = guard.snapshot["w"]
    run.w = torch.tensor([7.0, 8.0])
    guard.saved(run)
    assert guard.snapshot["w"] is kept and kept.tolist() == [7.0, 8.0]
    target, source = guard._target(0, World())
    assert source == "memory snapshot" and target["w"].tolist() == [7.0, 8.0]
    assert target["w"] is not kept
    target["w"].add_(1)  # the rollback's load may keep and then train the tensors it gets
    assert kept.tolist() == [7.0, 8.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rollback_point_of_a_gpu_run_is_pinned_queued_without_a_sync_and_exact(tmp_path):
    """On a GPU the snapshot's copies go to page-locked memory, queued on the stream: taking
    one is no host sync, the training step queued after it cannot change it, and the rollback
    waits for the copies before reading them."""
    run = Run()
    run.w = torch.randn(64 * 2**20, device="cuda")  # 256 MB: a copy that takes milliseconds
    guard = reporter(tmp_path)
    guard.start(run, meter(), 0, None, World(), (False, False))
    kept = guard.snapshot["w"]
    assert kept.is_pinned() and torch.equal(kept.cuda(), run.w)
    before = run.w.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        guard.saved(run)  # into the same pinned tensors: no allocation, no host sync
        run.w.mul_(-1.0)  # the next step's update, queued behind the copy
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.snapshot["w"] is kept
    target, _ = guard._target(0, World())  # waits for the copies, then reads them
    assert torch.equal(target["w"], before.cpu())


@pytest.mark.parametrize("from_files, resumed, sharded, snapshots", [
    (False, False, False, True), (False, True, False, True), (True, False, False, True),
    (True, True, False, False), (False, False, True, False)])
def test_the_memory_snapshot_is_taken_unless_a_checkpoint_file_or_sharding_replaces_it(
        tmp_path, from_files, resumed, sharded, snapshots):
    guard = reporter(tmp_path, from_files=from_files)
    guard.checkpoints = Checkpointer(RunDir(tmp_path))
    guard.checkpoints.sharded = sharded  # as for an FSDP2 model: the checkpointer's fact
    guard.start(Run(), meter(), 0, None, World(), (resumed, False))
    assert (guard.snapshot is not None) == snapshots
    guard.snapshot = None
    guard.saved(Run())  # FSDP2's rollbacks go to its checkpoints' shards: never a snapshot
    assert (guard.snapshot is not None) == (not from_files and not sharded)


def test_a_resume_drops_only_the_guard_lines_past_the_checkpoints_count(tmp_path):
    (tmp_path / "guard.jsonl").write_text("".join(f'{{"n": {n}}}\n' for n in (1, 2, 3)))
    guard = reporter(tmp_path)
    guard.policy.logged = 2
    guard.start(Run(), meter(), 0, None, World(), (True, False))
    guard.close()
    assert [r["n"] for r in lines(tmp_path)] == [1, 2, 3]  # not asked to resume: appended to
    guard.start(Run(), meter(), 0, None, World(), (True, True))
    guard._write({"event": "bad_step"})
    assert [r["n"] for r in lines(tmp_path)] == [1, 2, 3]  # the third is the new line


def test_the_guards_state_holds_the_device_statistics_only_with_spike_detection_on(tmp_path):
    off = reporter(tmp_path)
    off.policy.good, off.policy.losses = 5, [1.0]
    assert off.state_dict() == off.policy.state_dict()  # the device's empty window unused
    on = reporter(tmp_path, "guard.spike_factor=4", "guard.spike_window=2")
    on.policy.good, on.policy.losses = 5, [1.0]
    assert (on.state_dict()["good"], on.state_dict()["losses"]) == (0, [])


# --- settling -------------------------------------------------------------------------------

def test_a_settle_with_nothing_pending_reads_nothing_and_a_good_one_ends_the_bad_run(tmp_path):
    guard = started(tmp_path)
    progress = SimpleNamespace(step=9, epoch=0, offset=24)
    assert guard.settle(meter(), progress, Data(), None, World(), Run()) == (0, [])
    guard.policy.consecutive, guard.policy.pending = 2, [[1], [2]]
    pend(guard.verdicts, [(1.0, 1.0, 8, 4), (1.0, 1.0, 16, 8)])
    assert guard.settle(meter(samples=8), progress, Data(), None, World(), Run()) == (2, [])
    assert (guard.policy.consecutive, guard.policy.pending, guard.policy.good) == (0, [], 2)
    assert (guard.verdicts.pending, guard.verdicts.offsets, guard.verdicts.samples) == \
        ([], [24], [8])


def test_bad_steps_settled_late_get_their_own_numbers_lines_and_leave_the_meters_counts(
        tmp_path, capsys):
    """Steps 11-13 settle at once (the host counted 13): the 2nd and 3rd attempts were bad,
    so the bad ones are both step 12 (a bad attempt is no step); windows of 2 x 4 samples."""
    guard = started(tmp_path, accumulation=2)
    capsys.readouterr()
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))  # [1]: no grads
    model[0].weight.grad, model[0].bias.grad = torch.full((1, 1), math.nan), torch.zeros(1)
    m = meter()
    pend(guard.verdicts, [(8.0, 1.0, 8, 4), (math.nan, 2.0, 16, 8), (4.0, math.inf, 24, 12)])
    progress = SimpleNamespace(step=13, epoch=2, offset=24)
    assert guard.settle(m, progress, Data(), model, World(), Run()) == (3, [1, 2])
    assert m.forgot == [(8, 2)]  # the bad windows' local samples, and two steps
    first, second = lines(tmp_path)
    assert first == {"n": 1, "event": "bad_step", "step": 12, "epoch": 3,
                     "reason": "nonfinite_loss", "loss": "nan", "grad_norm": 2.0,
                     "consecutive": 1, "samples": list(range(108, 116)),
                     "nonfinite_grads": None, "inputs_nonfinite": False,
                     "nonfinite_input_samples": []}
    assert second == {"n": 2, "event": "bad_step", "step": 12, "epoch": 3,
                      "reason": "nonfinite_grad", "loss": 0.5, "grad_norm": "inf",
                      "consecutive": 2, "samples": list(range(116, 124)),
                      "nonfinite_grads": ["0.weight"], "inputs_nonfinite": False,
                      "nonfinite_input_samples": []}
    assert guard.policy.events == [[12, "nonfinite_loss"], [12, "nonfinite_grad"]]
    assert (guard.policy.good, guard.policy.bad_steps) == (1, 2)
    assert capsys.readouterr().out.splitlines() == [
        "warning: guard: step 12 skipped (nonfinite_loss: loss nan, grad_norm 2.0); 1 bad in "
        "a row, 8 samples listed in guard.jsonl",
        "warning: guard: step 12, attempt 2, skipped (nonfinite_grad: loss 0.5, grad_norm inf); "
        "2 bad in a row, 8 samples listed in guard.jsonl"]
    assert guard.verdicts.offsets == [24] and guard.verdicts.pending == []


def test_a_bad_window_reported_by_another_rank_has_no_local_details(tmp_path, capsys):
    guard = started(tmp_path, world=World(rank=1, size=2))
    guard.file = open(tmp_path / "guard.jsonl", "a")  # noqa: SIM115 - to see what it writes
    pend(guard.verdicts, [(3.0, 1.0, 1, 1)])  # finite and bad: a spike; a 1-sample window
    guard.verdicts.pending[0] = guard.verdicts.pending[0]._replace(ok=torch.tensor(False))
    world = SimpleNamespace(distributed=False, is_main=False)
    guard.settle(meter(), SimpleNamespace(step=1, epoch=0, offset=1), Data(), None, world,
                 Run())
    guard.close()
    (line,) = lines(tmp_path)
    assert line == {"n": 1, "event": "bad_step", "step": 1, "epoch": 1, "reason": "spike",
                    "loss": 3.0, "grad_norm": 1.0, "consecutive": 1}
    assert capsys.readouterr().out == ""


def test_a_due_rollback_restores_the_run_skips_the_windows_and_rewinds_the_logs(
        tmp_path, capsys):
    guard = reporter(tmp_path, "guard.max_bad_steps=2", "guard.lr_backoff=0.25")
    progress = SimpleNamespace(step=5, epoch=1, offset=20)
    run, rewound, waited = Run(progress), [], []
    log = SimpleNamespace(rewind=lambda step, epoch: rewound.append((step, epoch)))
    guard.start(run, meter(), 0, log, World(), (False, False))
    guard.checkpoints = SimpleNamespace(wait=lambda: waited.append(1))  # the run's checkpointer
    guard.policy.good = 7  # the guard's own knowledge outlives the rollback
    run.w = torch.tensor([9.0, 9.0])
    progress.step, progress.offset = 8, 12
    pend(guard.verdicts, [(math.nan, 1.0, 4, 2), (math.nan, 1.0, 8, 4)])
    data = Data()
    capsys.readouterr()
    with pytest.raises(RolledBack):
        guard.settle(meter(), progress, data, torch.nn.Linear(1, 1), World(), run)
    assert run.w.tolist() == [1.0, 2.0] and progress.step == 5 and waited == [1]
    assert guard.policy.good == 7 and guard.policy.lr_factor == 0.25
    assert data.skips == [[100, 101, 102, 103, 104, 105, 106, 107]]
    assert rewound == [(5, 1)]
    assert lines(tmp_path)[-1] == {"n": 3, "event": "rollback", "step": 7, "from_step": 7,
                                   "to_step": 5, "epoch": 2, "source": "memory snapshot",
                                   "cause": "bad_steps", "lr_factor": 0.25,
                                   "samples_added": list(range(100, 108)),
                                   "skipped_samples": 8}
    assert capsys.readouterr().out.splitlines()[-1] == (
        "warning: guard: rolled back from step 7 to step 5 (memory snapshot); LR factor now "
        "0.25, 8 samples added to the skip list (8 in all)")
    assert (guard.verdicts.pending, guard.verdicts.offsets) == ([], [12])


@pytest.mark.parametrize("usable, stops", [(4, False), (3, True)])
def test_a_rollback_that_leaves_less_than_one_batch_stops_the_run(tmp_path, usable, stops):
    guard = started(tmp_path, "guard.max_bad_steps=1")
    data = Data(global_batch=4)
    data.set_skip = lambda skip: setattr(data, "usable", usable)
    pend(guard.verdicts, [(math.nan, 1.0, 4, 2)])
    with pytest.raises(GuardStop if stops else RolledBack) as e:
        guard.settle(meter(), SimpleNamespace(step=1, epoch=0, offset=4), data,
                     torch.nn.Linear(1, 1), World(), Run())
    if stops:
        assert str(e.value).startswith(
            "the guard stopped the run at step 1: 4 training samples are on the skip list and "
            "fewer than one batch is left (the data itself is bad: NaN or inf inputs or "
            "targets?); recent bad steps: step 1 (nonfinite_loss). Check the training data for "
            "NaN or inf inputs or targets, and inspect the samples")


def test_the_stop_names_the_step_the_limits_the_last_8_bad_steps_and_the_advice(tmp_path):
    guard = started(tmp_path, "guard.max_bad_steps=2", "guard.max_rollbacks=1",
                    advice="Try a lower optim.lr, clip.max_norm=1.0")
    waited = []
    guard.checkpoints = SimpleNamespace(wait=lambda: waited.append(1))  # the run's checkpointer
    g = guard.policy
    g.rollbacks, g.bad_steps = 1, 11
    g.events = [[s, "nonfinite_loss"] for s in range(1, 10)]
    pend(guard.verdicts, [(math.nan, 1.0, 4, 2), (1.0, math.nan, 8, 4)])
    with pytest.raises(GuardStop) as e:
        guard.settle(meter(), SimpleNamespace(step=30, epoch=0, offset=8), Data(),
                     torch.nn.Linear(1, 1), World(), Run())
    recent = ", ".join([*(f"step {s} (nonfinite_loss)" for s in range(4, 10)),
                        "step 29 (nonfinite_loss)", "step 29 (nonfinite_grad)"])
    msg = (f"the guard stopped the run at step 29: 2 bad step(s) in a row again after 1 "
           f"rollback(s) (guard.max_rollbacks=1); recent bad steps: {recent}. Try a lower "
           f"optim.lr, clip.max_norm=1.0, and inspect the samples listed in "
           f"{tmp_path / 'guard.jsonl'}; every checkpoint in {tmp_path / 'checkpoints'} is "
           f"intact")
    assert str(e.value) == msg and e.value.exit_code == 3 and waited == [1]
    assert lines(tmp_path)[-1] == {"n": 3, "event": "stop", "step": 29, "rollbacks": 1,
                                   "bad_steps": 13, "message": msg}


def test_a_reporter_without_advice_suggests_a_lower_learning_rate(tmp_path):
    guard = started(tmp_path)
    with pytest.raises(GuardStop, match=r"\. Try a lower optim.lr, and inspect the samples"):
        guard.stop(3, World())


def test_the_stop_advice_names_each_fix_the_run_lacks():
    assert rep.advice(None, "fp32") == "Try a lower optim.lr, clip.max_norm=1.0"
    assert rep.advice(0.0, "fp16") == ("Try a lower optim.lr, clip.max_norm=1.0, "
                                       "train.precision=bf16 instead of fp16")
    assert rep.advice(1.0, "bf16") == "Try a lower optim.lr"
    assert rep.advice(2.5, "fp16") == ("Try a lower optim.lr, a tighter clip.max_norm than "
                                       "2.5, train.precision=bf16 instead of fp16")


def test_guard_jsonl_numbers_are_strict_json():
    assert rep._num(1.5) == 1.5 and rep._num(0.0) == 0.0
    assert [rep._num(x) for x in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]


def test_the_lr_factor_of_one_leaves_the_param_groups_alone():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1}, {"params": [], "lr": 0.3}])
    with rep.lr_scaled(opt, 0.5):
        assert [g["lr"] for g in opt.param_groups] == [0.05, 0.15]
    with rep.lr_scaled(opt, 1.0):
        assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]
    with pytest.raises(ValueError), rep.lr_scaled(opt, 0.5):
        raise ValueError  # a failed step still puts the schedule's LR back
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3]


# --- the rollback target --------------------------------------------------------------------

@pytest.mark.parametrize("is_main, said", [(True, "is damaged ("), (False, None)])
def test_a_rollback_skips_a_damaged_last_checkpoint_and_only_rank_0_warns_of_it(
        tmp_path, capsys, is_main, said):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    save_atomic({"progress": {"step": 4}, "model": {}}, ckpt / "step-4.pt")
    (ckpt / "last.pt").write_bytes(b"not a checkpoint")
    guard = reporter(tmp_path, from_files=True)
    guard.is_main = is_main
    guard.checkpoints = Checkpointer(RunDir(tmp_path))  # what a rollback loads through
    state, source = guard._target(0, World())
    assert state["progress"] == {"step": 4} and source == "checkpoints/step-4.pt"
    out = capsys.readouterr().out
    if said is None:
        assert out == ""
    else:
        assert out.startswith(f"warning: checkpoint {ckpt / 'last.pt'} {said}")
        assert out.endswith("; falling back to an older one\n")


