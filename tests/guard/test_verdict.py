"""guard/verdict.py, in process and without a training run: the device verdict's state, its
spike test and the masked step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ironloop.config import Config
from ironloop.guard.verdict import device_verdicts, finite

F64 = torch.float64


# --- the device verdict -----------------------------------------------------------------------


def test_finite_agrees_with_isfinite_on_every_kind_of_float_value():
    # the verdict's cheaper test: the extremes, subnormals, signed zeros, infinities and NaN
    for dtype in (torch.float16, torch.bfloat16, torch.float32, F64):
        info = torch.finfo(dtype)
        values = torch.tensor([0.0, -0.0, 1.0, -2.5, info.max, -info.max, info.tiny,
                               info.tiny / 4, info.eps, math.inf, -math.inf, math.nan],
                              dtype=dtype)
        assert torch.equal(finite(values), torch.isfinite(values)), dtype
        for v in values:  # 0-dim, as the verdict judges them
            assert torch.equal(finite(v), torch.isfinite(v)), (dtype, v)
        assert not bool(finite(values.new_tensor(info.max) * 2))  # an overflow is infinite


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
