"""The guard's parts one at a time, in-process and without a training run: the reporter's
rollback target, settle bookkeeping and messages, the device verdict's state, the fault knobs."""

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
from ironloop.state.io import save_atomic

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
    100 + p; samples 100 and 108 have non-finite inputs."""

    def __init__(self, global_batch: int = 4, usable: int = 64):
        self.global_batch, self.usable, self.skips = global_batch, usable, []

    def indices(self, start: int, end: int) -> list[int]:
        return [100 + p for p in range(start, end)]

    def nonfinite_inputs(self, samples: list[int]) -> list[int]:
        return [i for i in samples if i in (100, 108)]

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
    guard.start(Run(), meter(), 0, None, world or World(), (False, False), torch.nn.Linear(1, 1))
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
    guard.device.pending = ["stale"]
    guard.start(run, meter(3.0, samples=40), 16, log, World(), (False, False),
                torch.nn.Linear(1, 1))
    d = guard.device
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
    target, source = guard._target()
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
    guard.start(run, meter(), 0, None, World(), (False, False), torch.nn.Linear(1, 1))
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
    target, _ = guard._target()  # waits for the copies, then reads them
    assert torch.equal(target["w"], before.cpu())


@pytest.mark.parametrize("from_files, resumed, sharded, snapshots", [
    (False, False, False, True), (False, True, False, True), (True, False, False, True),
    (True, True, False, False), (False, False, True, False)])
def test_the_memory_snapshot_is_taken_unless_a_checkpoint_file_or_sharding_replaces_it(
        tmp_path, monkeypatch, from_files, resumed, sharded, snapshots):
    monkeypatch.setattr(rep, "_sharded", lambda model: sharded)
    guard = reporter(tmp_path, from_files=from_files)
    guard.start(Run(), meter(), 0, None, World(), (resumed, False), torch.nn.Linear(1, 1))
    assert (guard.snapshot is not None) == snapshots
    guard.snapshot = None
    guard.saved(Run())
    assert (guard.snapshot is not None) == (not from_files)


def test_a_resume_drops_only_the_guard_lines_past_the_checkpoints_count(tmp_path):
    (tmp_path / "guard.jsonl").write_text("".join(f'{{"n": {n}}}\n' for n in (1, 2, 3)))
    guard = reporter(tmp_path)
    guard.policy.logged = 2
    guard.start(Run(), meter(), 0, None, World(), (True, False), torch.nn.Linear(1, 1))
    guard.close()
    assert [r["n"] for r in lines(tmp_path)] == [1, 2, 3]  # not asked to resume: appended to
    guard.start(Run(), meter(), 0, None, World(), (True, True), torch.nn.Linear(1, 1))
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
    pend(guard.device, [(1.0, 1.0, 8, 4), (1.0, 1.0, 16, 8)])
    assert guard.settle(meter(samples=8), progress, Data(), None, World(), Run()) == (2, [])
    assert (guard.policy.consecutive, guard.policy.pending, guard.policy.good) == (0, [], 2)
    assert (guard.device.pending, guard.device.offsets, guard.device.samples) == ([], [24], [8])


def test_bad_steps_settled_late_get_their_own_numbers_lines_and_leave_the_meters_counts(
        tmp_path, capsys):
    """Steps 11-13 settle at once (the host counted 13): the 2nd and 3rd attempts were bad,
    so the bad ones are both step 12 (a bad attempt is no step); windows of 2 x 4 samples."""
    guard = started(tmp_path, accumulation=2)
    capsys.readouterr()
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))  # [1]: no grads
    model[0].weight.grad, model[0].bias.grad = torch.full((1, 1), math.nan), torch.zeros(1)
    m = meter()
    pend(guard.device, [(8.0, 1.0, 8, 4), (math.nan, 2.0, 16, 8), (4.0, math.inf, 24, 12)])
    progress = SimpleNamespace(step=13, epoch=2, offset=24)
    assert guard.settle(m, progress, Data(), model, World(), Run()) == (3, [1, 2])
    assert m.forgot == [(8, 2)]  # the bad windows' local samples, and two steps
    first, second = lines(tmp_path)
    assert first == {"n": 1, "event": "bad_step", "step": 12, "epoch": 3,
                     "reason": "nonfinite_loss", "loss": "nan", "grad_norm": 2.0,
                     "consecutive": 1, "samples": list(range(108, 116)),
                     "nonfinite_grads": None, "inputs_nonfinite": True,
                     "nonfinite_input_samples": [108]}
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
        "warning: guard: step 12 skipped (nonfinite_grad: loss 0.5, grad_norm inf); 2 bad in "
        "a row, 8 samples listed in guard.jsonl"]
    assert guard.device.offsets == [24] and guard.device.pending == []


def test_a_bad_window_reported_by_another_rank_has_no_local_details(tmp_path, capsys):
    guard = started(tmp_path, world=World(rank=1, size=2))
    guard.file = open(tmp_path / "guard.jsonl", "a")  # noqa: SIM115 - to see what it writes
    pend(guard.device, [(3.0, 1.0, 1, 1)])  # finite and bad: a spike; a 1-sample window
    guard.device.pending[0] = guard.device.pending[0]._replace(ok=torch.tensor(False))
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
    guard.start(run, meter(), 0, log, World(), (False, False), torch.nn.Linear(1, 1))
    guard.wait = lambda: waited.append(1)
    guard.policy.good = 7  # the guard's own knowledge outlives the rollback
    run.w = torch.tensor([9.0, 9.0])
    progress.step, progress.offset = 8, 12
    pend(guard.device, [(math.nan, 1.0, 4, 2), (math.nan, 1.0, 8, 4)])
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
                                   "lr_factor": 0.25,
                                   "samples_added": list(range(100, 108)),
                                   "skipped_samples": 8}
    assert capsys.readouterr().out.splitlines()[-1] == (
        "warning: guard: rolled back from step 7 to step 5 (memory snapshot); LR factor now "
        "0.25, 8 samples added to the skip list (8 in all)")
    assert (guard.device.pending, guard.device.offsets) == ([], [12])


@pytest.mark.parametrize("usable, stops", [(4, False), (3, True)])
def test_a_rollback_that_leaves_less_than_one_batch_stops_the_run(tmp_path, usable, stops):
    guard = started(tmp_path, "guard.max_bad_steps=1")
    data = Data(global_batch=4)
    data.set_skip = lambda skip: setattr(data, "usable", usable)
    pend(guard.device, [(math.nan, 1.0, 4, 2)])
    with pytest.raises(GuardStop if stops else RolledBack) as e:
        guard.settle(meter(), SimpleNamespace(step=1, epoch=0, offset=4), data,
                     torch.nn.Linear(1, 1), World(), Run())
    if stops:
        assert str(e.value).startswith(
            "the guard stopped the run at step 1: 4 training samples are on the skip list and "
            "fewer than one batch is left (the data itself is bad: NaN or inf inputs or "
            "targets?); recent bad steps: step 1 (nonfinite_loss). Try a lower optim.lr, ")


def test_the_stop_names_the_step_the_limits_the_last_8_bad_steps_and_the_advice(tmp_path):
    guard = started(tmp_path, "guard.max_bad_steps=2", "guard.max_rollbacks=1",
                    advice="Try a lower optim.lr, clip.max_norm=1.0")
    waited = []
    guard.wait = lambda: waited.append(1)
    g = guard.policy
    g.rollbacks, g.bad_steps = 1, 11
    g.events = [[s, "nonfinite_loss"] for s in range(1, 10)]
    pend(guard.device, [(math.nan, 1.0, 4, 2), (1.0, math.nan, 8, 4)])
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
    state, source = guard._target()
    assert state["progress"] == {"step": 4} and source == "checkpoints/step-4.pt"
    out = capsys.readouterr().out
    if said is None:
        assert out == ""
    else:
        assert out.startswith(f"warning: checkpoint {ckpt / 'last.pt'} {said}")
        assert out.endswith("; falling back to an older one\n")


# --- the fault knobs ------------------------------------------------------------------------

def test_the_fault_knobs_act_only_at_the_steps_they_name():
    from ironloop.config import FaultConfig
    from ironloop.guard.faults import Faults

    off = Faults(FaultConfig())
    assert off.steps == frozenset() and not off.poisons_steps
    step_fn = lambda model, batch: (torch.tensor(1.0), {})  # noqa: E731
    assert off.wrap_step(step_fn, SimpleNamespace(step=0), None) is step_fn
    for step in (1, 5):  # optimizer steps count from 1
        off.at_step(step)  # nothing happens
    on = Faults(FaultConfig(crash_at_step=7, oom_at_step=5, nan_at_step=[2, 3]))
    assert on.steps == frozenset({5, 7}) and on.poisons_steps
    on.at_step(4)
    with pytest.raises(torch.OutOfMemoryError, match=r"^injected by fault.oom_at_step=5$"):
        on.at_step(5)
    progress, streak = SimpleNamespace(step=0), SimpleNamespace(consecutive=0)
    wrapped = on.wrap_step(step_fn, progress, streak)
    assert (wrapped.step_fn, wrapped.steps) == (step_fn, {2, 3})
    assert wrapped.progress is progress and wrapped.streak is streak


def test_a_poisoned_step_is_nan_on_its_first_training_attempt_only_and_again_after_a_rollback():
    from ironloop.guard.faults import PoisonLoss

    model = torch.nn.Linear(1, 1)
    progress, streak = SimpleNamespace(step=0), SimpleNamespace(consecutive=0)
    poisoned = PoisonLoss(lambda m, b: (torch.tensor(2.0), {"acc": 1.0}, 4), {2, 4}, progress,
                          streak)

    def attempt() -> float:
        loss, metrics, weight = poisoned(model, None)
        assert (metrics, weight) == ({"acc": 1.0}, 4)  # the rest passes through
        return float(loss)

    assert attempt() == 2.0          # step 1
    progress.step = 1
    model.eval()
    assert attempt() == 2.0          # an evaluation forward is never poisoned
    model.train()
    assert attempt() != attempt()    # step 2: NaN, then the retry is clean
    assert poisoned.fired == {2}
    progress.step = 3
    streak.consecutive = 0
    assert attempt() != attempt()    # step 4
    progress.step = 1                # a rollback to step 1: both are first attempts again
    assert attempt() != attempt() and poisoned.fired == {2}


def test_a_run_of_bad_attempts_stands_for_that_many_consecutive_steps():
    from ironloop.guard.faults import PoisonLoss

    model = torch.nn.Linear(1, 1)
    progress, streak = SimpleNamespace(step=4), SimpleNamespace(consecutive=0)
    poisoned = PoisonLoss(lambda m, b: (torch.tensor(1.0), {}), {5, 6, 7}, progress, streak)
    nan = []
    for _ in range(4):
        loss, _ = poisoned(model, None)
        bad = bool(torch.isnan(loss))
        nan.append(bad)
        streak.consecutive = streak.consecutive + 1 if bad else 0
    assert nan == [True, True, True, False] and poisoned.fired == {5, 6, 7}
    without = PoisonLoss(lambda m, b: (torch.tensor(1.0), {}), {5, 6}, SimpleNamespace(step=4),
                         None)  # no guard: no streak to read
    assert torch.isnan(without(model, None)[0]) and not torch.isnan(without(model, None)[0])


def test_fault_nan_sample_refusals_name_the_knob_and_the_way_out():
    from ironloop.data.loader import TensorData
    from ironloop.errors import ConfigError
    from ironloop.guard.faults import poison_sample

    data = TensorData(torch.ones(3, 2), torch.arange(3))
    assert poison_sample(data, -1) is data
    with pytest.raises(ConfigError, match=r"^fault.nan_sample=3: the training split has 3 "
                                          r"samples; pick an index below that$"):
        poison_sample(data, 3)
    with pytest.raises(ConfigError, match=r"^fault.nan_sample=1: the inputs are torch.int64, "
                                          r"which cannot hold a NaN; use fault.nan_at_step "
                                          r"instead$"):
        poison_sample(TensorData(torch.ones(3, 2, dtype=torch.int64), torch.arange(3)), 1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(ConfigError, match=r"^fault.nan_sample=0 needs a map-style training "
                                          r"split; this one is a stream: use "
                                          r"fault.nan_at_step instead$"):
        poison_sample(Stream(), 0)


def test_poisoning_in_memory_data_keeps_its_one_slice_batches_and_leaves_the_original_alone():
    from ironloop.data.loader import TensorData
    from ironloop.guard.faults import poison_sample

    data = TensorData(torch.ones(3, 2), torch.arange(3))
    poisoned = poison_sample(data, 2)
    assert type(poisoned) is TensorData and poisoned.y is data.y
    assert torch.isnan(poisoned.x[2]).all() and torch.equal(poisoned.x[:2], torch.ones(2, 2))
    assert torch.equal(data.x, torch.ones(3, 2))


def test_a_poisoned_sample_keeps_its_container_type_and_float_inputs():
    from ironloop.guard.faults import poison_sample

    class Samples(torch.utils.data.Dataset):
        def __init__(self, make):
            self.make = make

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return self.make(i)

    as_list = poison_sample(Samples(lambda i: [torch.tensor([i, i]), i]), 1)
    sample = as_list[1]
    assert type(sample) is list and torch.isnan(sample[0]).all() and sample[1] == 1
    assert as_list[0][0].tolist() == [0, 0]
    bare = poison_sample(Samples(lambda i: torch.tensor([i, 2])), 0)[0]  # int64 in
    assert bare.dtype == torch.float32 and torch.isnan(bare).all()


# --- the device verdict -----------------------------------------------------------------------

def test_only_an_optimizer_whose_every_group_is_fused_takes_the_device_flag():
    from ironloop.guard.verdict import takes_found_inf

    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    assert takes_found_inf(torch.optim.AdamW([a], fused=True))
    assert not takes_found_inf(torch.optim.AdamW([a]))
    mixed = torch.optim.AdamW([a], fused=True)
    mixed.add_param_group({"params": [b], "fused": False})  # e.g. a resumed non-fused group
    assert not takes_found_inf(mixed)
    assert not takes_found_inf(torch.optim.RMSprop([a]))  # no found_inf support at all


def test_the_verdict_judges_the_windows_loss_summed_over_ranks_and_gradscalers_own_skips(
        monkeypatch):
    from ironloop.guard import verdict as v

    judge = v.StepJudge(torch.device("cpu"), F64)
    one, two = SimpleNamespace(distributed=False), SimpleNamespace(distributed=True)
    t = lambda x: torch.tensor(x, dtype=F64)  # noqa: E731
    assert bool(judge.verdict(t(5.0), t(1.0), t(2.0), 4, None, one))
    assert not bool(judge.verdict(t(math.nan), t(1.0), t(2.0), 4, None, one))
    assert not bool(judge.verdict(t(5.0), t(1.0), t(math.inf), 4, None, one))
    # fp16: inf grads with GradScaler's flag up are its skip, not a guard-bad step
    assert bool(judge.verdict(t(5.0), t(1.0), t(math.inf), 4, torch.tensor(1.0), one))
    assert not bool(judge.verdict(t(5.0), t(1.0), t(math.inf), 4, torch.tensor(0.0), one))
    assert not bool(judge.verdict(t(math.nan), t(1.0), t(2.0), 4, torch.tensor(1.0), one))
    assert not bool(judge.verdict(t(5.0), t(1.0), t(math.nan), 4, torch.tensor(0.0), one))
    summed = []

    def all_reduce_sum(x, world):
        summed.append(float(x))
        return x + math.nan  # another rank's window was NaN

    monkeypatch.setattr(v, "all_reduce_sum", all_reduce_sum)
    assert not bool(judge.verdict(t(5.0), t(1.0), t(2.0), 4, None, two))
    assert summed == [4.0]  # the window's own loss, not the running total


def test_the_spike_statistic_reads_the_windows_mean_loss_per_sample():
    from ironloop.guard.verdict import StepJudge

    judge = StepJudge(torch.device("cpu"), F64, spike_factor=3, spike_window=2,
                      spike_warmup=0)
    world, zero = SimpleNamespace(distributed=False), torch.zeros((), dtype=F64)
    for total, samples in ((8.0, 4), (2.0, 1)):
        judge.verdict(torch.tensor(total, dtype=F64), zero, torch.tensor(1.0), samples, None,
                      world)
    judge.verdict(torch.tensor(math.nan, dtype=F64), zero, torch.tensor(1.0), 2, None, world)
    state = judge.state_dict()
    assert state == {"good": 2, "losses": [2.0, 2.0], "norms": [1.0, 1.0]}
    empty = StepJudge(torch.device("cpu"), F64, spike_factor=3, spike_window=2,
                      spike_warmup=0)
    empty.verdict(torch.tensor(3.0, dtype=F64), zero, torch.tensor(1.0), 0, None, world)
    assert empty.state_dict()["losses"] == [3.0]  # no sample: the sum itself, not a 0-division


def test_the_spike_ring_wraps_and_its_state_is_the_newest_window_oldest_first():
    from ironloop.guard.verdict import StepJudge

    judge = StepJudge(torch.device("cpu"), F64, spike_factor=1000, spike_window=3,
                      spike_warmup=1)
    world, zero = SimpleNamespace(distributed=False), torch.zeros((), dtype=F64)
    seen = []
    for i in range(1, 7):
        judge.verdict(torch.tensor(float(i), dtype=F64), zero, torch.tensor(10.0 + i), 1,
                      None, world)
        seen.append(judge.state_dict())
    assert [s["losses"] for s in seen] == [[], [2.0], [2.0, 3.0], [2.0, 3.0, 4.0],
                                           [3.0, 4.0, 5.0], [4.0, 5.0, 6.0]]
    assert seen[-1] == {"good": 6, "losses": [4.0, 5.0, 6.0], "norms": [14.0, 15.0, 16.0]}
    again = StepJudge(torch.device("cpu"), F64, spike_factor=1000, spike_window=3,
                      spike_warmup=1)
    again.load_state_dict({"good": 9, "losses": [1.0, 4.0, 5.0, 6.0],
                           "norms": [11.0, 14.0, 15.0, 16.0]})  # a longer window: the newest
    assert again.state_dict() == {"good": 9, "losses": [4.0, 5.0, 6.0],
                                  "norms": [14.0, 15.0, 16.0]}
    assert int(again.filled) == 3 and again.filled.dtype == again.good.dtype == torch.long
    again.load_state_dict({})  # no statistics saved: an empty window
    assert again.state_dict() == {"good": 0, "losses": [], "norms": []}
    assert not again.ring.any()


def test_a_masked_step_without_a_scaler_skips_a_bad_update_and_leaves_no_flag_behind():
    from ironloop.guard.verdict import StepJudge, masked_step

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5, fused=True)
    judge = StepJudge(torch.device("cpu"), torch.float32)
    for ok, after in ((False, [1.0, 1.0]), (True, [0.5, 0.5])):
        p.grad = torch.ones(2)
        flag = torch.tensor(ok)
        masked_step(opt, None, flag, judge.found_inf(flag))
        assert p.detach().tolist() == after
        assert not hasattr(opt, "found_inf")


def test_a_masked_step_keeps_the_loss_scale_on_a_guard_bad_step_and_updates_it_otherwise():
    from ironloop.guard.verdict import StepJudge, masked_step

    class Scaler:  # the GradScaler parts masked_step uses; its update halves the scale
        def __init__(self):
            self._scale, self._growth_tracker = torch.tensor(1024.0), torch.tensor(3)

        def _found_inf_per_device(self, optimizer):
            return {"cpu": torch.tensor(0.0)}

        def update(self):
            self._scale.mul_(0.5)
            self._growth_tracker.zero_()

    judge = StepJudge(torch.device("cpu"), torch.float32)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5, fused=True)
    for ok, scale, tracker, after in ((False, 1024.0, 3, 1.0), (True, 512.0, 0, 0.5)):
        scaler, flag = Scaler(), torch.tensor(ok)
        p.grad = torch.ones(2)
        masked_step(opt, scaler, flag, judge.found_inf(flag))
        assert (float(scaler._scale), int(scaler._growth_tracker)) == (scale, tracker)
        assert p.detach().tolist() == [after, after]
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_check_reverts_a_bad_windows_loss_and_tokens_and_keeps_what_the_settle_needs():
    from ironloop.config import GuardConfig

    d = device_verdicts(GuardConfig(), torch.device("cpu"), F64)
    m = SimpleNamespace(loss_sum=torch.tensor(2.0, dtype=F64),
                        tokens=torch.zeros((), dtype=F64), samples=10)
    d.rebase(m, 8)
    m.loss_sum, m.samples = torch.tensor(5.0, dtype=F64), 14
    m.tokens = torch.tensor(100.0, dtype=F64)  # this window's step reported tokens
    ok = d.check(m, torch.tensor(1.0), 16, None, SimpleNamespace(distributed=False))
    assert bool(ok) and float(m.loss_sum) == 5.0 and float(m.tokens) == 100.0
    m.loss_sum, m.samples = m.loss_sum + math.nan, 18
    m.tokens = m.tokens + 30
    bad = d.check(m, torch.tensor(1.0), 24, None, SimpleNamespace(distributed=False))
    assert not bool(bad)
    assert float(m.loss_sum) == 5.0 and float(m.tokens) == 100.0  # the bad window reverted
    assert [bool(p.ok) for p in d.pending] == [True, False]
    assert [float(p.before) for p in d.pending] == [2.0, 5.0]
    assert math.isnan(float(d.pending[1].total))
    assert d.offsets == [8, 16, 24] and d.samples == [10, 14, 18]
    tokens = m.tokens
    m.loss_sum = m.loss_sum + math.nan  # a bad window whose step reported no tokens
    d.check(m, torch.tensor(1.0), 32, None, SimpleNamespace(distributed=False))
    assert m.tokens is tokens and float(m.loss_sum) == 5.0


def test_the_loop_settles_eagerly_when_asked_to_or_when_the_pending_list_is_full():
    from ironloop.config import GuardConfig
    from ironloop.guard import verdict as v

    d = v.device_verdicts(GuardConfig(), torch.device("cpu"), torch.float32)
    fused = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, fused=True)
    d.start(fused, False)
    assert d.masks and not d.always and not d.eager
    d.pending = [None] * (v.MAX_PENDING - 1)
    assert not d.eager
    d.pending.append(None)
    assert d.eager and v.MAX_PENDING == 4096
    d.start(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), True)
    d.pending = []
    assert not d.masks and d.always and d.eager
    d.start(fused, False)
    d.known_bad = True  # a verdict read before step() said bad
    assert d.eager
    d.rebase(SimpleNamespace(loss_sum=torch.zeros(()), tokens=torch.zeros(()), samples=0), 0)
    assert not d.known_bad and not d.eager  # settled


def test_the_device_half_takes_the_configs_limits_and_spike_settings():
    conf = Config().with_overrides(["guard.max_bad_steps=4", "guard.max_rollbacks=2",
                                    "guard.lr_backoff=0.25", "guard.spike_factor=5",
                                    "guard.spike_window=7", "guard.spike_warmup=9"]).guard
    d = device_verdicts(conf, torch.device("cpu"), F64)
    g = d.policy
    assert (g.max_bad_steps, g.max_rollbacks, g.lr_backoff) == (4, 2, 0.25)
    assert (g.spike_factor, g.spike_window, g.spike_warmup) == (5, 7, 9)
    assert (d.judge.factor, d.judge.window, d.judge.warmup) == (5, 7, 9)
    assert d.judge.ring.shape == (2, 7) and d.judge.ring.dtype == F64
    assert (d.masks, d.always, d.known_bad, d.pending) == (False, False, False, [])


def test_forgetting_an_unscale_drops_only_that_optimizers_gradscaler_state():
    from ironloop.guard.verdict import forget_unscale

    a, b = object(), object()
    scaler = SimpleNamespace(_per_optimizer_states={id(a): {"stage": 1}, id(b): {"stage": 1}})
    forget_unscale(a, scaler)
    assert scaler._per_optimizer_states == {id(b): {"stage": 1}}
    forget_unscale(a, scaler)  # nothing left to forget
    forget_unscale(a, None)    # fp32 / bf16: no scaler


def test_the_device_spike_test_waits_for_a_full_window_and_floors_sigma_at_1e_12():
    from ironloop.guard.verdict import StepJudge

    world, zero = SimpleNamespace(distributed=False), torch.zeros((), dtype=F64)
    judge = StepJudge(torch.device("cpu"), F64, spike_factor=2, spike_window=3, spike_warmup=0)

    def ok(loss: float, norm: float = 0.0) -> bool:
        return bool(judge.verdict(torch.tensor(loss, dtype=F64), zero,
                                  torch.tensor(norm, dtype=F64), 1, None, world))

    assert ok(0.0) and ok(0.0)
    assert ok(50.0, 50.0)  # 2 of 3 good steps: nothing is judged yet, and it joins the window
    judge.load_state_dict({"good": 3, "losses": [0.0] * 3, "norms": [0.0] * 3})
    assert not ok(2.1e-12)  # the window just filled: judged from this step on
    assert ok(1e-12) and ok(0.0, 2e-12)  # sigma 0 and 1% of 0: the 1e-12 floor, x 2
    assert not ok(2.1e-12) and not ok(0.0, 2.1e-12)


def test_check_hands_the_spike_test_the_windows_mean_loss_over_its_samples():
    conf = Config().with_overrides(["guard.spike_factor=4", "guard.spike_window=2",
                                    "guard.spike_warmup=0"]).guard
    d = device_verdicts(conf, torch.device("cpu"), F64)
    m = SimpleNamespace(loss_sum=torch.zeros((), dtype=F64), tokens=torch.zeros((), dtype=F64),
                        samples=0)
    d.rebase(m, 8)
    m.loss_sum = torch.tensor(16.0, dtype=F64)  # 8 samples, epoch offsets 8 to 16
    d.check(m, torch.tensor(1.0), 16, None, SimpleNamespace(distributed=False))
    assert d.judge.state_dict()["losses"] == [2.0]
