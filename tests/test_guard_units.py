"""The guard's parts one at a time, in-process and without a training run: the reporter's
rollback target, settle bookkeeping and messages, the device verdict's state, the fault knobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ironloop.config import Config
from ironloop.guard.reporter import GuardReporter
from ironloop.guard.verdict import device_verdicts
from ironloop.state.io import save_atomic


def reporter(tmp_path, *overrides: str, from_files: bool = False,
             accumulation: int = 1, advice: str = "") -> GuardReporter:
    conf = Config().with_overrides([*overrides]).guard
    verdicts = device_verdicts(conf, torch.device("cpu"), torch.float64)
    return GuardReporter(conf, tmp_path, verdicts, from_files, accumulation, advice)


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
