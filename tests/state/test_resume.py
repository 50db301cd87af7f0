"""Resume semantics in-process: no replay, fallback past damage, clear refusals, export.

state/resume.py in-process: what a checkpoint's dict holds, and what restoring checks."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import ironloop
from ironloop.cli import main
from ironloop.data.loader import TensorData
from ironloop.engine.progress import Meter
from ironloop.errors import CheckpointError, UserError
from ironloop.state import io as ckpt_io, resume
from ironloop.state.io import FORMAT_VERSION
from ironloop.state.resume import rank_meter
from tests.conftest import StopAt, blobs, cfg, tiny_mlp


class CountingData(TensorData):
    """Counts the samples fetched, to prove a resume does not replay skipped batches."""

    fetched = 0

    def __getitems__(self, indices):
        CountingData.fetched += len(indices)
        return super().__getitems__(indices)


def counting(n=640) -> CountingData:
    d = blobs(n=n)
    return CountingData(d.x, d.y)


def test_resume_mid_epoch_fetches_only_the_rest_of_the_epoch(tmp_path):
    conf = cfg(tmp_path, train__epochs=1, train__batch_size=32, checkpoint__every_steps=5,
               checkpoint__keep_last=10)
    ironloop.fit(tiny_mlp(), counting(), None, conf)
    full = ironloop.fit(tiny_mlp(), counting(), None, {**conf, "run.dir": str(tmp_path / "b")})
    step15 = tmp_path / "run" / "checkpoints" / "step-00000015.pt"
    CountingData.fetched = 0
    model = tiny_mlp()
    ironloop.fit(model, counting(), None, conf, resume=str(step15))
    assert CountingData.fetched == 640 - 15 * 32  # the 5 remaining batches, nothing replayed
    for k, v in full.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def test_resume_with_nothing_to_resume_starts_fresh(tmp_path, capsys):
    res = ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path), resume=True)
    assert "starting a fresh run" in capsys.readouterr().out
    assert res.results["steps"] == 2 * 7


def test_truncated_last_falls_back_to_an_older_step_file(tmp_path, capsys):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=3, checkpoint__keep_last=3)
    reference = ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "run.dir": str(tmp_path / "r")})
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 9})
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a torn write
    # also damage the newest step file (last.pt's twin): the fallback must go one further back
    (tmp_path / "run" / "checkpoints" / "step-00000009.pt").write_bytes(b"garbage")
    model = tiny_mlp()
    res = ironloop.fit(model, blobs(), None, conf, resume=True, allow_config_change=True)
    out = capsys.readouterr().out
    assert out.count("is damaged") == 2 and "falling back" in out
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["step"] == 7  # the end of epoch 1: step-9 and last.pt were damaged
    assert res.results["steps"] == reference.results["steps"]
    for k, v in reference.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def test_checkpoint_of_another_model_lists_keys_and_shapes(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path))
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    with pytest.raises(CheckpointError, match=r"does not fit.*0.weight.*\(16, 8\)"):
        ironloop.fit(other, blobs(), None, cfg(tmp_path), resume=True)


def test_not_a_checkpoint_and_malicious_pickle_are_refused(tmp_path, capsys):
    junk = tmp_path / "notes.pt"
    junk.write_text("hello")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, evil, pickle_protocol=2)
    base = ["train", "configs/digits.yaml", "train.epochs=1", f"run.dir={tmp_path / 'r'}"]
    assert main([*base, "--resume", str(junk)]) == 2
    assert "damaged or not a checkpoint" in capsys.readouterr().err
    assert main([*base, "--resume", str(evil)]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "Traceback" not in err
    assert not marker.exists(), "loading must never run the pickle's code"
    torch.load(evil, weights_only=False)  # the control: an unsafe load does run it
    assert marker.exists()


def test_full_disk_during_a_save_stops_the_run_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch):
    conf = cfg(tmp_path, train__epochs=3)
    real_fsync, calls = os.fsync, {"n": 0}
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.epochs": 1})
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    before = last.read_bytes()

    def full_disk(fd):
        calls["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_io.os, "fsync", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        ironloop.fit(tiny_mlp(), blobs(), None, conf, resume=True, allow_config_change=True)
    monkeypatch.setattr(ckpt_io.os, "fsync", real_fsync)
    assert calls["n"] >= 1 and last.read_bytes() == before
    assert not list(last.parent.glob(".*tmp*"))
    state = torch.load(last, weights_only=True)
    assert state["progress"]["epoch"] == 1


def test_export_writes_safetensors_and_never_clobbers(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path))
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--which", "last"]) == 0
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    exported = load_file(out)
    assert exported.keys() == last.keys() and all(torch.equal(exported[k], last[k]) for k in last)
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--force"]) == 0
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x.st")]) == 2


def test_checkpoint_holds_everything_the_issue_lists(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path, train__precision="fp16"))
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "scaler", "progress", "sampler", "rng",
                "tracker", "config", "format_version", "ironloop_version", "torch_version"):
        assert key in state, key
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert state["scaler"] is not None and state["progress"]["epoch"] == 2


def test_prefixed_checkpoint_keys_load(tmp_path):
    """Checkpoints written from DDP ("module.") or torch.compile ("_orig_mod.") models load."""
    ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path))
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    state["model"] = {f"module._orig_mod.{k}": v for k, v in state["model"].items()}
    ckpt_io.save_atomic(state, path)
    model = tiny_mlp(seed=5)
    ironloop.fit(model, blobs(), None, cfg(tmp_path), resume=str(path))
    for k, v in state["model"].items():
        assert torch.equal(model.state_dict()[k.split("_orig_mod.")[1]], v)


def _same_weights(a, b) -> bool:
    return all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_a_resume_continues_the_random_streams_a_step_draws_from(tmp_path):
    """A step (an augmentation, a collate) that draws from python's random, numpy and torch
    (dropout): resumed from step 5 it ends bit-exact with the run that never stopped, only if
    the checkpoint's RNG states are put back (the resume seeds every generator first)."""
    import random

    import numpy as np

    def step(m, batch):
        x, y = batch
        x = x * (1 + 0.5 * random.random()) + float(np.random.randn())  # "augmentation"
        return torch.nn.functional.cross_entropy(m(x), y), {}

    conf = cfg(tmp_path, train__epochs=1, checkpoint__every_steps=5, checkpoint__keep_last=10)
    full = ironloop.fit(tiny_mlp(dropout=0.3), blobs(n=320), None, conf, step_fn=step).model
    resumed = tiny_mlp(dropout=0.3)
    ironloop.fit(resumed, blobs(n=320), None, {**conf, "run.dir": str(tmp_path / "b")},
                 step_fn=step,
                 resume=str(tmp_path / "run" / "checkpoints" / "step-00000005.pt"))
    assert _same_weights(resumed, full)


def test_a_resume_after_a_rollback_keeps_skipping_the_poisoned_window(tmp_path):
    """The guard's skip list comes back on resume: the sampler leaves the rolled-back window
    out of the rest of the run, as the run that never stopped did."""
    from ironloop.data.loader import EpochSampler

    order = EpochSampler(256, 32, seed=0, shuffle=True).permutation().tolist()
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=2, checkpoint__keep_last=50,
               fault__nan_sample=order[32 * 4 + 5], guard__max_bad_steps=1)
    full = ironloop.fit(tiny_mlp(), blobs(n=256), None, conf)
    # the bad sample's inputs explain the step: only it is left out (guard/decide.py)
    assert full.results["rollbacks"] == 1 and full.results["skipped_samples"] == 1
    resumed = tiny_mlp()
    step6 = tmp_path / "run" / "checkpoints" / "step-00000006.pt"  # after the rollback
    again = ironloop.fit(resumed, blobs(n=256), None, {**conf, "run.dir": str(tmp_path / "b")},
                         resume=str(step6))
    assert (again.results["bad_steps"], again.results["skipped_samples"]) == (1, 1)
    assert _same_weights(resumed, full.model)
    skips = [torch.load(d / "checkpoints" / "last.pt", weights_only=True)["guard"]["skip"]
             for d in (tmp_path / "run", tmp_path / "b")]
    assert skips[0] == skips[1] == [order[32 * 4 + 5]]


def test_a_resumed_run_restores_the_best_weights_from_best_pt_at_its_end(tmp_path):
    # min_delta so large that only the first evaluation is a best (step 7): the resumed process
    # never sees a new best itself, so the final weights must come back from best.pt.
    conf = cfg(tmp_path, train__epochs=3, early_stop__patience=10, early_stop__min_delta=100.0)
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), {**conf, "train.max_steps": 10})
    best = ckpt_io.load_verified(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["progress"]["step"] == 7
    res = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), conf, resume=True,
                       allow_config_change=True)
    assert res.results["steps"] == 21 and res.results["restored_best"]
    for k, v in best["model"].items():
        assert torch.equal(res.model.state_dict()[k], v)
    final = load_file(tmp_path / "run" / "final.safetensors")
    assert all(torch.equal(final[k], v) for k, v in best["model"].items())



def test_without_patience_a_resume_never_reads_best_pt_so_its_damage_does_not_stop_it(tmp_path):
    conf = cfg(tmp_path, train__epochs=2)  # early_stop.patience=0: no final restore
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), {**conf, "train.max_steps": 10})
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    data = best.read_bytes()
    best.unlink()  # a hard link to a step file: that one stays intact
    best.write_bytes(data[:100])  # a disk error in a file this resume has no use for
    res = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), conf, resume=True,
                       allow_config_change=True)
    assert res.results["steps"] == 14 and not res.results["restored_best"]

def test_a_fresh_run_over_a_run_dir_with_checkpoints_but_no_log_line_is_refused(tmp_path):
    # A run killed after a checkpoint but before its first log line (log.every_steps larger
    # than checkpoint.every_steps): its checkpoints alone are a run to resume, not to overwrite.
    conf = cfg(tmp_path, train__epochs=1, checkpoint__every_steps=2, train__max_steps=3)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").unlink()
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(UserError, match="already holds a run; pass resume=True"):
        ironloop.fit(tiny_mlp(), blobs(), None, conf)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_resuming_another_runs_checkpoint_past_this_run_dirs_own_steps_is_allowed_not_before(
        tmp_path):
    # Another lineage's checkpoint may seed run.dir while run.dir's own checkpoints are all
    # older than its step; one that would leave newer ones behind (to be deleted) is refused.
    conf = cfg(tmp_path, train__epochs=1, checkpoint__every_steps=2, checkpoint__keep_last=5)
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "run.dir": str(tmp_path / "a")})
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "train.max_steps": 4})  # own: steps 2, 4
    other = tmp_path / "a" / "checkpoints"
    with pytest.raises(CheckpointError, match="holds its own checkpoints up to step 4, past "
                                              "this checkpoint's step 2"):
        ironloop.fit(tiny_mlp(), blobs(), None, conf, resume=str(other / "step-00000002.pt"))
    res = ironloop.fit(tiny_mlp(), blobs(), None, conf, resume=str(other / "step-00000006.pt"))
    assert res.results["steps"] == 7


def test_resume_of_a_killed_run_that_had_checkpoints_disabled_is_refused(tmp_path):
    # killed before its end (no results.json, no final weights): config.yaml says it wrote no
    # checkpoint, so --resume would start it over and overwrite its outputs
    conf = cfg(tmp_path, train__epochs=1, checkpoint__enabled=False)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    run_dir = tmp_path / "run"
    for name in ("results.json", "final.safetensors"):
        (run_dir / name).unlink()
    with pytest.raises(UserError, match=r"wrote no checkpoint \(checkpoint.enabled=false\)"):
        ironloop.fit(tiny_mlp(), blobs(), None, conf, resume=True)
    assert (run_dir / "metrics.jsonl").exists()


def test_a_run_with_the_guard_off_checkpoints_without_guard_state_and_resumes(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, guard__enabled=False, checkpoint__every_steps=3)
    full = ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "run.dir": str(tmp_path / "full")})
    ironloop.fit(tiny_mlp(), blobs(), None, conf, callbacks=[StopAt(6)])  # saved at step 6
    assert ckpt_io.load_verified(tmp_path / "run" / "checkpoints" / "last.pt")["guard"] is None
    resumed = ironloop.fit(tiny_mlp(), blobs(), None, conf, resume=True)
    assert resumed.results["steps"] == full.results["steps"] == 14
    assert _same_weights(resumed.model, full.model)


def test_a_two_rank_meter_resumed_on_one_process_sums_the_ranks_losses_and_samples():
    # Each rank's own sums ride in the checkpoint ("ranks"); on one process rank 0 takes them
    # all, and the counts every rank shares (steps, training time) come from rank 0.
    states = []
    for loss, n, seconds in ((1.0, 4, 10.0), (3.0, 4, 12.0)):
        meter = Meter(torch.device("cpu"))
        meter.add_micro(torch.tensor(loss), n)
        meter.add_step(torch.tensor(0.5), torch.tensor(False), None)
        state = meter.state_dict()
        states.append({**state, "train_seconds": seconds})
    saved = {**states[0], "ranks": states}  # rank 0 writes the checkpoint
    merged = rank_meter(saved, 0, 1)
    assert merged["samples"] == 8 and merged["totals"][0].item() == 16.0
    assert merged["train_seconds"] == 10.0 and merged["steps"] == 1
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(merged)
    assert resumed.flush_epoch()["train_loss"] == 2.0  # the mean over both ranks' samples
    assert rank_meter(saved, 1, 2) == states[1]  # the same world size: each rank its own


def test_a_two_rank_token_weighted_meter_resumed_elsewhere_sums_the_ranks_tokens_on_rank_0():
    # A language model's loss is logged per token: the tokens, like the loss and the samples,
    # are summed over the ranks at each log, so rank 0 takes every rank's and the others none.
    states = []
    for loss, tokens in ((1.0, 10), (4.0, 30)):
        meter = Meter(torch.device("cpu"))
        meter.add_micro(torch.tensor(loss), 2, weight=torch.tensor(float(tokens)))
        meter.add_step(torch.tensor(0.5), torch.tensor(False), None)
        states.append(meter.state_dict())
    saved = {**states[0], "ranks": states}
    merged = rank_meter(saved, 0, 1)
    assert merged["totals"].tolist() == [130.0, 0.0, 0.0, 40.0]  # loss 1*10 + 4*30, 40 tokens
    resumed = Meter(torch.device("cpu"))
    resumed.load_state_dict(merged)
    assert resumed.flush_epoch()["train_loss"] == 130.0 / 40  # the mean per token, both ranks
    assert rank_meter(saved, 1, 3)["totals"].tolist() == [0.0, 0.0, 0.0, 0.0]
    # a checkpoint from before token weights holds three totals: still read
    old = [{**s, "totals": s["totals"][:3]} for s in states]
    assert rank_meter({**old[0], "ranks": old}, 0, 1)["totals"].tolist() == [130.0, 0.0, 0.0]


def test_a_checkpoints_dict_names_its_format_versions_config_parts_rng_and_values():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = resume.collect_state({"seed": 3}, model, {"optimizer": opt, "scaler": None},
                                 progress={"step": 7})
    assert state["format_version"] == FORMAT_VERSION
    assert state["ironloop_version"] == ironloop.__version__
    assert state["torch_version"] == str(torch.__version__)
    assert state["config"] == {"seed": 3} and state["progress"] == {"step": 7}
    assert state["model"].keys() == model.state_dict().keys()
    assert state["optimizer"] == opt.state_dict() and state["scaler"] is None
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}


def test_a_checkpoint_of_another_format_is_refused_naming_both_formats():
    model = torch.nn.Linear(2, 1)
    state = resume.collect_state({}, model, {})
    state["format_version"] = 99
    with pytest.raises(CheckpointError) as e:
        resume.restore_state(state, "ckpt.pt", model, {})
    assert str(e.value) == (f"ckpt.pt has checkpoint format 99, this ironloop reads "
                            f"{FORMAT_VERSION}; resume it with the ironloop that wrote it")
