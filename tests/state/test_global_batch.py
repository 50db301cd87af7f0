"""The global batch is the run's contract: the accumulation steps a start on another number of
ranks re-derives, the refusal when it does not divide, and the drift check that refuses a
changed global batch that no key names (the same keys on another number of ranks)."""

from __future__ import annotations

import pytest

from ironloop.config import Config
from ironloop.errors import ConfigError
from ironloop.outputs.console import world_change
from ironloop.state import drift
from ironloop.state.global_batch import accumulation_for, keep, target


def checkpoint(batch: int, accumulation: int, world: int, given: int = 0) -> dict:
    train = {"batch_size": batch, "accumulation_steps": accumulation, "global_batch_size": given}
    return {"config": {"train": train}, "world_size": world}


def test_a_resume_on_fewer_ranks_accumulates_what_the_lost_ranks_computed():
    cfg = Config().with_overrides({"train.batch_size": 32})
    # 2 ranks x 32 -> 1 rank x 32: two micro-batches per step keep the 64
    assert keep(cfg, 1, checkpoint(32, 1, 2)).train.accumulation_steps == 2
    # 1 x 32 x 2 (a resume of that resume) -> back on 2 ranks: one micro-batch again
    assert keep(cfg.with_overrides({"train.accumulation_steps": 2}), 2,
                checkpoint(32, 2, 1)).train.accumulation_steps == 1
    # 8 x 32 -> 4 x 16: accumulation 4
    small = cfg.with_overrides({"train.batch_size": 16})
    assert keep(small, 4, checkpoint(32, 1, 8)).train.accumulation_steps == 4


def test_nothing_is_re_derived_on_the_same_ranks_or_when_the_product_already_holds():
    cfg = Config().with_overrides({"train.batch_size": 32})
    assert keep(cfg, 2, checkpoint(32, 1, 2)) is cfg
    assert keep(cfg, 2, checkpoint(16, 2, 2)) is cfg  # a key change: the drift check's to judge
    assert keep(cfg.with_overrides({"train.batch_size": 64}), 1, checkpoint(32, 1, 2)) \
        .train.accumulation_steps == 1  # 2 x 32 -> 1 x 64
    assert keep(cfg, 1, None) is cfg  # a fresh start keeps its own product
    assert target(0, {"config": {"train": {"batch_size": 8}}}, 1) == 0  # no world size: old


def test_global_batch_size_sets_the_accumulation_at_a_fresh_start_too():
    cfg = Config().with_overrides({"train.batch_size": 16, "train.global_batch_size": 128})
    assert keep(cfg, 2, None).train.accumulation_steps == 4
    # the checkpoint's own global_batch_size is its contract, whatever its product says
    assert target(0, checkpoint(16, 4, 2, given=128), 4) == 128


def test_a_global_batch_that_does_not_divide_is_refused_naming_what_would():
    with pytest.raises(ConfigError) as e:
        accumulation_for(48, 1, 1, 64)
    msg = str(e.value)
    assert "global batch of 64" in msg and "train.batch_size=48 x 1 rank(s)" in msg
    assert "train.batch_size one of ..., 2, 4, 8, 16, 32, 64 on 1 rank(s)" in msg
    assert "--allow-config-change" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"run with 1, 2 rank\(s\) at train.batch_size=32;"):
        accumulation_for(32, 1, 3, 64)  # 3 ranks: no per-rank batch divides 64
    with pytest.raises(ConfigError, match=r"one of \.\.\., 4, 5, 8, 10, 20, 40 on 2 rank\(s\) "
                                          r"or 1, 5 rank\(s\) at train.batch_size=16;"):
        accumulation_for(16, 1, 2, 80)  # 80 / 32 = 2.5


def test_the_drift_check_refuses_the_same_keys_on_another_number_of_ranks():
    old = {"train": {"batch_size": 32, "accumulation_steps": 1}}
    with pytest.raises(ConfigError, match=r"global batch .*: 64 -> 32"):
        drift.check(old, old, allow=False, worlds=(2, 1))
    said: list[str] = []
    assert drift.check(old, old, allow=True, say=said.append, worlds=(2, 1)) == \
        [(drift.GLOBAL, 64, 32)]
    # accumulation re-derived: the same 64, accepted with a notice
    new = {"train": {"batch_size": 32, "accumulation_steps": 2}}
    assert drift.check(old, new, allow=False, say=said.append, worlds=(2, 1)) == []
    assert drift.check(old, old, allow=False, worlds=(2, 2)) == []


def test_the_resume_line_names_the_world_change_and_the_kept_global_batch():
    event = {"world_size_before": 2, "world_size": 1, "accumulation_before": 1,
             "accumulation_steps": 2, "global_batch_before": 64, "global_batch": 64}
    assert world_change(event) == "; world size 2 -> 1: accumulation 1 -> 2, global batch 64 kept"
    assert world_change({**event, "global_batch": 32}).endswith("global batch 64 -> 32")
    assert world_change({**event, "world_size": 2}) == ""
