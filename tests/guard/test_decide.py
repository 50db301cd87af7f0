"""guard/decide.py's GuardPolicy: pure decisions (bad steps, spikes, rollbacks), the LR factor and
the skip list it leads to."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch.optim import lr_scheduler

from ironloop.data.loader import EpochSampler
from ironloop.guard.decide import GuardPolicy
from ironloop.guard.reporter import lr_scaled

# --- GuardPolicy: pure decisions ------------------------------------------------------------------

def test_nonfinite_loss_or_grad_is_bad_and_only_bad_steps_ask_for_the_window():
    g = GuardPolicy(max_bad_steps=3)
    asked = []
    window = lambda: asked.append(1) or [7, 8]  # noqa: E731
    assert g.observe(1, 0.5, 1.0, window) is None
    assert g.observe(2, float("nan"), 1.0, window) == "nonfinite_loss"
    assert g.observe(2, 0.5, float("inf"), window) == "nonfinite_grad"
    assert len(asked) == 2 and g.bad_steps == 2 and g.consecutive == 2
    assert g.pending == [[7, 8], [7, 8]] and g.events == [[2, "nonfinite_loss"],
                                                        [2, "nonfinite_grad"]]
    assert g.observe(2, 0.4, 1.0, window) is None  # a good step ends the run of bad ones
    assert g.consecutive == 0 and g.pending == [] and g.bad_steps == 2


def test_rollback_after_max_bad_steps_then_stop_after_max_rollbacks():
    g = GuardPolicy(max_bad_steps=2, max_rollbacks=2, lr_backoff=0.5)
    for rollback in (1, 2):
        g.observe(5, math.nan, 1.0, lambda r=rollback: [r, 10])
        assert not g.must_roll_back
        g.observe(5, math.nan, 1.0, lambda r=rollback: [r, 11])
        assert g.must_roll_back and not g.must_stop
        added = g.roll_back()
        assert added == ([1, 10, 11] if rollback == 1 else [2])
        assert g.lr_factor == 0.5 ** rollback and g.consecutive == 0
    assert g.skip == [1, 2, 10, 11] and g.totals() == {"bad_steps": 4, "rollbacks": 2,
                                                       "skipped_samples": 4}
    g.observe(9, math.nan, 1.0)
    g.observe(9, math.nan, 1.0)
    assert g.must_stop  # a third trigger with max_rollbacks=2 used up


def test_spike_detection_skips_warmup_and_never_learns_bad_values():
    g = GuardPolicy(max_bad_steps=100, spike_factor=6, spike_window=20, spike_warmup=5)
    for i in range(5):  # warm-up: huge values, kept out of the statistic
        assert g.observe(i, 100.0, 100.0) is None
    assert g.losses == []
    rng = random.Random(0)
    for i in range(20):
        assert g.observe(i, 1.0 + 0.01 * rng.random(), 2.0 + 0.01 * rng.random()) is None
    assert len(g.losses) == 20
    assert g.observe(30, 5.0, 2.0) == "spike"          # the loss jumps
    assert g.observe(31, 1.0, 50.0) == "spike"         # the grad norm jumps
    assert max(g.losses) < 1.02 and max(g.norms) < 2.02  # the spikes stayed out
    assert g.observe(32, 1.01, 2.0) is None


def test_a_history_of_exact_zeros_does_not_turn_rounding_noise_into_spikes():
    # a loss that reached exactly 0 (a margin loss, separable data) with a zero grad norm:
    # sigma and the median's 1% are both 0, so the spike test keeps a tiny absolute floor
    g = GuardPolicy(max_bad_steps=100, spike_factor=6, spike_window=4, spike_warmup=0)
    for i in range(4):
        assert g.observe(i, 0.0, 0.0) is None
    assert g.observe(4, 1e-14, 1e-14) is None
    assert g.observe(5, 1.0, 0.0) == "spike"


def test_spike_factor_zero_turns_spike_detection_off_even_with_a_window_from_a_checkpoint():
    g = GuardPolicy(max_bad_steps=100, spike_factor=0, spike_window=3, spike_warmup=0)
    g.load_state_dict({"losses": [1.0, 1.0, 1.0], "norms": [2.0, 2.0, 2.0]})
    assert g.classify(50.0, 90.0) is None
    assert GuardPolicy(spike_factor=0.5, spike_window=3, spike_warmup=0).classify(1.0, 2.0) \
        is None  # the window is empty until it is full
    on = GuardPolicy(spike_factor=0.5, spike_window=3, spike_warmup=0)
    on.load_state_dict({"losses": [1.0, 1.0, 1.0], "norms": [2.0, 2.0, 2.0]})
    assert on.classify(50.0, 2.0) == "spike"


def test_state_dict_round_trip_gives_the_same_decisions():
    a = GuardPolicy(max_bad_steps=2, spike_factor=3, spike_window=4, spike_warmup=0)
    for i, v in enumerate([1.0, 1.1, 0.9, 1.0, math.nan]):
        a.observe(i, v, 1.0, lambda i=i: [i])
    b = GuardPolicy(max_bad_steps=2, spike_factor=3, spike_window=4, spike_warmup=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # plain values only
    assert b.state_dict() == a.state_dict()
    for v in (9.0, math.nan, 1.0):
        assert a.observe(7, v, 1.0) == b.observe(7, v, 1.0)
    assert a.state_dict() == b.state_dict()


def test_the_policys_defaults_are_the_guard_configs():
    from ironloop.config import GuardConfig

    g, conf = GuardPolicy(), GuardConfig()
    assert (g.max_bad_steps, g.max_rollbacks, g.lr_backoff, g.spike_factor, g.spike_window,
            g.spike_warmup) == (conf.max_bad_steps, conf.max_rollbacks, conf.lr_backoff,
                                conf.spike_factor, conf.spike_window, conf.spike_warmup)
    assert g.state_dict() == {"consecutive": 0, "bad_steps": 0, "rollbacks": 0,
                              "input_rollbacks": 0, "lr_factor": 1.0, "skip": [],
                              "pending": [], "events": [],
                              "good": 0, "losses": [], "norms": [], "logged": 0,
                              "bad_inputs": [], "rolled_from": []}


def test_the_stop_message_remembers_the_last_20_bad_steps():
    g = GuardPolicy(max_bad_steps=100)
    for step in range(1, 26):
        g.observe(step, math.nan, 1.0)
    assert g.events == [[s, "nonfinite_loss"] for s in range(6, 26)]
    assert g.bad_steps == 25 and g.consecutive == 25


def test_the_spike_window_starts_after_exactly_spike_warmup_good_steps_and_is_judged_once_full():
    g = GuardPolicy(max_bad_steps=100, spike_factor=2, spike_window=3, spike_warmup=2)
    for _ in range(2):
        g.record_good(1.0, 1.0)
    assert g.losses == [] and g.good == 2
    g.record_good(1.0, 1.0)  # the third good step is the window's first
    g.record_good(1.0, 1.0)
    assert (g.losses, g.norms) == ([1.0, 1.0], [1.0, 1.0])
    assert g.classify(50.0, 1.0) is None  # 2 of 3: not judged yet
    g.record_good(1.0, 1.0)
    assert g.classify(50.0, 1.0) == "spike" and g.classify(1.0, 50.0) == "spike"
    g.record_good(1.0, 7.0)
    assert g.norms == [1.0, 1.0, 7.0]  # the newest spike_window kept
    g.record_good()  # the hook's: no host values to learn from
    assert (g.good, len(g.losses)) == (7, 3)


def test_a_partial_state_loads_what_it_has_and_keeps_the_rest():
    g = GuardPolicy()
    g.rollbacks, g.skip = 2, [4]
    pending = ([1, 2], (3,))
    g.load_state_dict({"pending": pending, "logged": 5})
    assert (g.rollbacks, g.skip, g.logged, g.pending) == (2, [4], 5, [[1, 2], [3]])
    pending[0].append(9)  # a copy: the checkpoint's lists stay the checkpoint's
    assert g.pending == [[1, 2], [3]]


def test_a_spike_is_strictly_above_a_threshold_floored_at_1e_12():
    from ironloop.guard.decide import _spikes

    # history 1, 2, 3: median 2, MAD 1; factor 0 puts the threshold at the median itself
    assert not _spikes(2.0, [1.0, 3.0, 2.0], 0.0) and _spikes(2.0 + 1e-9, [1.0, 3.0, 2.0], 0.0)
    # all zeros: sigma and 1% of the median are 0, the floor 1e-12 is left
    assert not _spikes(1e-12, [0.0] * 3, 1.0) and _spikes(1.5e-12, [0.0] * 3, 1.0)


# --- LR factor and skip list -----------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=20),  # computes from the current LR
    lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=10),
    lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=30),
])
def test_lr_factor_composes_with_any_schedule_and_the_schedule_never_sees_it(make):
    w = [torch.nn.Parameter(torch.zeros(2))]
    plain, guarded = torch.optim.SGD(w, lr=0.01), torch.optim.SGD(w, lr=0.01)
    s_plain, s_guarded = make(plain), make(guarded)
    for _ in range(15):
        plain.step()
        with lr_scaled(guarded, 0.25):
            guarded.step()
            used = guarded.param_groups[0]["lr"]
        assert used == pytest.approx(0.25 * plain.param_groups[0]["lr"], rel=1e-12)
        assert guarded.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
        s_plain.step()
        s_guarded.step()
    assert s_guarded.state_dict() == s_plain.state_dict()


def test_skip_list_filters_the_permutation_and_keeps_the_prefix():
    s = EpochSampler(100, 8, seed=3, shuffle=True)
    s.set_epoch(2)
    full = s.permutation().tolist()
    late = full[50:53]  # samples served after position 50
    s.set_skip(late)
    perm = s.permutation().tolist()
    assert not set(late) & set(perm) and len(perm) == 97 and s.usable == 97
    assert perm[:50] == full[:50]  # an offset before them still means the same samples
    assert [i for b in s for i in b] == perm  # and the batches serve exactly that order
    again = EpochSampler(100, 8, seed=3, shuffle=True)
    again.set_epoch(2)
    again.set_skip(reversed(late))
    assert again.permutation().tolist() == perm  # a pure function of (seed, epoch, skip)


def test_a_rollback_the_inputs_explain_skips_only_them_and_keeps_the_lr():
    g = GuardPolicy(max_bad_steps=1, max_rollbacks=0, lr_backoff=0.5)
    g.observe(5, math.nan, 1.0, lambda: [7, 8, 9])
    assert g.roll_back(inputs=[8]) == [8]
    assert (g.skip, g.lr_factor, g.rollbacks, g.input_rollbacks) == ([8], 1.0, 1, 1)
    assert not g.must_stop and g.consecutive == 0  # max_rollbacks=0 is not spent on it
    g.observe(6, math.nan, 1.0, lambda: [1, 2])  # a bad step the inputs do not explain
    assert g.must_stop  # ... and this one is: max_rollbacks=0
    assert g.roll_back() == [1, 2] and (g.lr_factor, g.rollbacks) == (0.5, 2)
