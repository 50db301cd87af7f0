"""Weight averaging (engine/average.py): EMA and SWA weights equal torch's own AveragedModel
updated by hand after the same optimizer steps; the average is evaluated, checkpointed, resumed
exactly after SIGKILLs, restored by the guard's rollback, and exported."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.optim.swa_utils import (
    AveragedModel,
    get_ema_multi_avg_fn,
    get_swa_multi_avg_fn,
    update_bn,
)
from torch.overrides import TorchFunctionMode

import ironloop
from ironloop.callbacks import Callback
from ironloop.config import AverageConfig
from ironloop.data.loader import EpochSampler
from ironloop.engine.average import WeightAverage
from ironloop.errors import ConfigError
from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import load_verified, save_atomic
from tests import forked
from tests.conftest import REPO, blobs, cfg, logged_step, tiny_mlp, wait_running
from tests.engine.test_host_reads import READS


def bn_mlp(seed: int = 0) -> nn.Module:
    """A model with BatchNorm: its buffers are what EMA averages and SWA recomputes."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def warmed_ema(decay: float):
    """torch's EMA update at TensorFlow's warmed-up decay, min(decay, (1 + t) / (10 + t)), with
    t read from torch's own count of updates (what average.warmup does by default)."""

    def update(own, new, num_averaged):
        t = int(num_averaged)
        get_ema_multi_avg_fn(min(decay, (1 + t) / (10 + t)))(own, new, num_averaged)

    return update


class HandAveraged(Callback):
    """torch's AveragedModel, updated with ``update_parameters`` after the same optimizer
    steps as the run's (from step 2, every ``every`` steps), from on_step_end."""

    def __init__(self, model: nn.Module, kind: str, every: int = 2):
        self.every = every
        fn = warmed_ema(0.9) if kind == "ema" else get_swa_multi_avg_fn()
        self.avg = AveragedModel(copy.deepcopy(model), multi_avg_fn=fn, use_buffers=kind == "ema")

    def on_step_end(self, run, row):
        if run.step >= 2 and run.step % self.every == 0:
            self.avg.update_parameters(run.model)


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_average_equals_a_hand_written_averaged_model_loop(tmp_path, kind):
    model, train = bn_mlp(), blobs(200)
    hand = HandAveraged(model, kind)
    ironloop.fit(model, train, blobs(60, seed=1),
                 cfg(tmp_path, average__kind=kind, average__decay=0.9, average__start_step=2,
                     average__every_steps=2), callbacks=[hand])
    run = tmp_path / "run"
    saved = load_verified(run / "checkpoints" / "last.pt")["average"]
    want = hand.avg.state_dict()
    assert int(want["n_averaged"]) == 7  # steps 2, 4, ..., 14 of 14
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[k], want[k]) for k in want), kind
    final = load_file(run / "final_avg.safetensors")
    if kind == "swa":  # BatchNorm statistics recomputed over the training split, in order
        update_bn([(train.x[i:i + 32], train.y[i:i + 32]) for i in range(0, 200, 32)],
                  hand.avg)
        assert not torch.equal(final["1.running_mean"], saved["module.1.running_mean"])
    expected = {k.removeprefix("module."): v for k, v in hand.avg.state_dict().items()
                if k != "n_averaged"}
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected), kind
    raw = load_file(run / "final.safetensors")  # final.safetensors stays the raw weights
    assert not torch.equal(raw["0.weight"], final["0.weight"])


class AllReads(TorchFunctionMode):
    """Host reads of tensors (torch's own included, unlike tests/engine/test_host_reads.py's
    counter): what AveragedModel.update_parameters does twice per call."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", "") in READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_an_update_reads_nothing_back_from_the_device(kind):
    model = bn_mlp()
    average = WeightAverage(AverageConfig(kind=kind), model)
    with AllReads() as counter:
        for _ in range(3):
            average.update()
    assert counter.reads == 0
    with AllReads() as counter:  # the counter sees torch's reads of n_averaged
        for _ in range(3):
            average.averaged.update_parameters(model)
    assert counter.reads == 6


def test_averaged_weights_are_evaluated_and_monitored(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(200), blobs(60, seed=1),
                          cfg(tmp_path, average__kind="ema", average__decay=0.5,
                              early_stop__metric="val_avg_acc"))
    rows = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert {"val_loss", "val_acc", "val_avg_loss", "val_avg_acc"} <= row.keys()
        assert row["val_loss"] != row["val_avg_loss"]
    assert result.results["monitor"] == {"val_avg_acc": max(r["val_avg_acc"] for r in rows)}
    assert "average" in result.results["time_split"]  # its cost in the step-time breakdown


def test_no_average_means_no_average_files_or_columns(tmp_path):
    ironloop.fit(tiny_mlp(), blobs(100), blobs(30, seed=1), cfg(tmp_path, train__epochs=1))
    run = tmp_path / "run"
    assert not (run / "final_avg.safetensors").exists()
    assert load_verified(run / "checkpoints" / "last.pt")["average"] is None
    row = read_jsonl(run / "evals.jsonl")[0]
    assert not any(k.startswith("val_avg_") for k in row)


def test_a_checkpoint_without_an_average_resumes_with_a_fresh_one(tmp_path):
    """An older run (no 'average' key) resumes with averaging on: the average starts from the
    restored weights, not from the model as it was handed in."""
    ironloop.fit(tiny_mlp(), blobs(200), None, cfg(tmp_path, train__epochs=1))
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    state = load_verified(last)
    del state["average"]  # as an ironloop from before averaging wrote it
    save_atomic(state, last)
    restored = {k: v.clone() for k, v in state["model"].items()}

    class Before(Callback):
        def on_train_start(self, run, row):
            self.avg = {k: v.clone() for k, v in run._run.module.average.module.state_dict()
                        .items()}

    before = Before()
    ironloop.fit(tiny_mlp(seed=5), blobs(200), None,
                 cfg(tmp_path, train__epochs=2, average__kind="swa"), resume=True,
                 allow_config_change=True, callbacks=[before])
    assert all(torch.equal(before.avg[k], restored[k]) for k in restored)


class StatefulHand(HandAveraged):
    """The hand-written average, saved and restored with the run (a rollback included)."""

    def state_dict(self):
        return self.avg.state_dict()

    def load_state_dict(self, state):
        self.avg.load_state_dict(state)


@pytest.mark.parametrize("rollback_to", ["checkpoint", "memory"])
def test_the_guards_rollback_restores_the_average(tmp_path, rollback_to):
    """A NaN sample in step 5 rolls back to step 4. The skipped step 5 updated the run's
    average; the rollback puts it back, so it equals the hand-written one, which never saw the
    bad step (on_step_end does not fire for it), and counts each good step once."""
    order = EpochSampler(256, 32, seed=0, shuffle=True).permutation().tolist()
    model = tiny_mlp()
    hand = StatefulHand(model, "ema", every=1)
    result = ironloop.fit(model, blobs(256), None,
                          cfg(tmp_path, fault__nan_sample=order[32 * 4 + 5],
                              guard__max_bad_steps=1, checkpoint__every_steps=2,
                              guard__rollback_to=rollback_to, average__kind="ema",
                              average__decay=0.9, average__start_step=2),
                          callbacks=[hand])
    assert result.results["rollbacks"] == 1
    saved = load_verified(tmp_path / "run" / "checkpoints" / "last.pt")["average"]
    want = hand.avg.state_dict()
    assert int(saved["n_averaged"]) == result.results["steps"] - 1  # steps 2, 3, ...
    assert all(torch.equal(saved[k], want[k]) for k in want)


def test_bad_average_keys_name_the_key():
    with pytest.raises(ConfigError, match=r"average.decay=1.5: must be in \[0, 1\]"):
        ironloop.config.load_config(None, ["average.decay=1.5"])
    with pytest.raises(ConfigError, match="average.kind='ewa': must be one of none, ema, swa"):
        ironloop.config.load_config(None, ["average.kind=ewa"])


def test_export_which_avg_writes_the_averaged_weights(tmp_path, capsys):
    # The CLI's main in this process (not a subprocess): what export runs is this checkout's.
    from ironloop.cli import main

    ironloop.fit(tiny_mlp(), blobs(100), None,
                 cfg(tmp_path, train__epochs=1, average__kind="ema", average__decay=0.5))
    run = tmp_path / "run"
    assert main(["export", str(run), "--out", str(tmp_path / "avg.safetensors"), "--which",
                 "avg"]) == 0, capsys.readouterr().err
    avg = load_verified(run / "checkpoints" / "last.pt")["average"]
    out = load_file(tmp_path / "avg.safetensors")
    assert out.keys() == {k.removeprefix("module.") for k in avg if k != "n_averaged"}
    assert all(torch.equal(out[k], avg[f"module.{k}"]) for k in out)
    plain = tmp_path / "plain"
    ironloop.fit(tiny_mlp(), blobs(100), None, cfg(plain, train__epochs=1))
    capsys.readouterr()
    assert main(["export", str(plain / "run"), "--out", str(tmp_path / "x.safetensors"),
                 "--which", "avg"]) == 2
    err = capsys.readouterr().err
    assert "average.kind=none" in err and "Traceback" not in err


@contextlib.contextmanager
def one_thread():
    """One intra-op thread, as the subprocesses (OMP_NUM_THREADS=1): an in-process reference
    run does the same float math as the run it is compared with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def in_process(*argv: str) -> int:
    """``ironloop`` as the subprocesses run it (the CLI's main), in this process, one thread: a
    reference run costs no interpreter and torch import (issue 45)."""
    from ironloop.cli import main

    with one_thread():
        return main(list(argv))


SIGKILL_ARGS = ("data.name=digits", "model.name=mlp", "train.epochs=2", "train.batch_size=32",
                "checkpoint.every_steps=5", "log.every_steps=1", "log.progress=off",
                "doctor.preflight=false", "average.kind=swa", "average.start_step=3")


def _kill_at(tmp_path: Path, run_dir: Path, kill_at: int) -> None:
    """``ironloop train --resume`` into run_dir in a process of its own, a fork of this one
    (tests/forked.py: no interpreter's and torch's start-up), SIGKILLed once metrics.jsonl
    holds step ``kill_at`` (waiting on the file, not on a clock)."""
    out = tmp_path / f"{run_dir.name}.{kill_at}.out"
    proc = forked.fork_main(["train", *SIGKILL_ARGS, f"run.dir={run_dir}", "--resume"],
                            {**os.environ, "OMP_NUM_THREADS": "1"}, out, cwd=tmp_path)
    wait_running(proc, lambda: logged_step(run_dir) >= kill_at, f"step {kill_at}",
                 out.read_text)
    assert proc.poll() is None, f"finished before step {kill_at}: {out.read_text()[-3000:]}"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.slow
def test_sigkill_twice_and_resume_gives_equal_raw_and_averaged_weights(tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    # the uninterrupted reference in this process; the killed runs are processes of their own
    assert in_process("train", *SIGKILL_ARGS, f"run.dir={reference}") == 0
    _kill_at(tmp_path, resumed, kill_at=12)   # epoch 1 (45 steps per epoch)
    _kill_at(tmp_path, resumed, kill_at=52)   # epoch 2
    # the resume to the end in this process too: the kills are the real processes'; resuming
    # from what they left needs no fresh interpreter (issue 45)
    assert in_process("train", *SIGKILL_ARGS, f"run.dir={resumed}", "--resume") == 0
    assert [e["step"] for e in read_jsonl(resumed / "events.jsonl")
            if e["event"] == "resume"][-1] >= 50  # from what the second kill left
    for name in ("final.safetensors", "final_avg.safetensors"):
        a, b = load_file(reference / name), load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a = load_verified(reference / "checkpoints" / "last.pt")["average"]
    b = load_verified(resumed / "checkpoints" / "last.pt")["average"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# EMA at a constant LR (the FSDP test's first part would otherwise end its schedule with its one
# epoch), as both distributed tests below train it
DIST_AVERAGE = ("average.kind=ema", "average.decay=0.9", "schedule.name=constant")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process with the global batch (64): what 2 ranks x 32 must match, under DDP and FSDP."""
    from tests.e2e.test_distributed import ARGS

    run = tmp_path_factory.mktemp("one") / "run"
    # in this process (the distributed tests' config, configs/digits.yaml, from the repository)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        assert in_process("train", *ARGS, f"run.dir={run}", *DIST_AVERAGE,
                          "train.batch_size=64", "checkpoint.enabled=false") == 0
    return run


#: FSDP2 on 2 ranks x 32 (the global batch of 64)
FSDP_AVERAGE = (*DIST_AVERAGE, "train.batch_size=32", "dist.strategy=fsdp")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, Path]:
    """The two-rank runs of the tests below, one after another in ONE torchrun job (tests/
    ranks_main.py: torchrun and each rank import torch once for all four): DDP; FSDP2 to the
    end; FSDP2's first epoch, then (its 4th run) the resume of that run from its sharded
    checkpoint. {name: run.dir}."""
    from tests.e2e.test_distributed import one_job

    root = tmp_path_factory.mktemp("ranks")
    one_job(root, [("ddp", ["train.batch_size=32", *DIST_AVERAGE, "checkpoint.enabled=false"]),
                   ("fsdp_full", list(FSDP_AVERAGE)),
                   ("fsdp_part", [*FSDP_AVERAGE, "train.epochs=1"]),
                   ("fsdp_part", [*FSDP_AVERAGE, "--resume", "--allow-config-change"])])
    return {name: root / name for name in ("ddp", "fsdp_full", "fsdp_part")}


@pytest.mark.slow
def test_two_ddp_ranks_average_as_one_process_with_the_global_batch(one_process, two_ranks):
    """2 gloo ranks x 32 and one process x 64 take the same steps (tests/e2e/test_distributed.py):
    their averages match too, and so do the averaged weights' validation figures."""
    one, two = one_process, two_ranks["ddp"]
    a, b = load_file(one / "final_avg.safetensors"), load_file(two / "final_avg.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    rows = [read_jsonl(d / "evals.jsonl") for d in (one, two)]
    assert [r["val_avg_acc"] for r in rows[1]] == pytest.approx(
        [r["val_avg_acc"] for r in rows[0]], abs=1e-6)


@pytest.mark.slow
def test_fsdp_averages_as_one_process_and_its_sharded_checkpoints_resume_exactly(tmp_path,
                                                                               one_process,
                                                                               two_ranks,
                                                                               capsys):
    """FSDP2 on 2 gloo ranks: the average is sharded beside the model, matches one process
    with the global batch, and a run resumed from its sharded (.dcp) checkpoint ends with the
    same raw and averaged weights, bit for bit, as one that was not stopped."""
    one, full, part = one_process, two_ranks["fsdp_full"], two_ranks["fsdp_part"]
    a, b = load_file(one / "final_avg.safetensors"), load_file(full / "final_avg.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    assert (part / "checkpoints" / "last.dcp").is_dir()
    # epoch 2 (the job's 4th run) resumed from epoch 1's sharded checkpoint, the run's only one
    resumed = [e for e in read_jsonl(part / "events.jsonl") if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["from"].endswith(".dcp"), resumed
    assert resumed[0]["step"] == 23, resumed  # ceil(1438 / 64): epoch 1's end
    for name in ("final.safetensors", "final_avg.safetensors"):
        x, y = load_file(full / name), load_file(part / name)
        assert all(torch.equal(x[k], y[k]) for k in x), name
    capsys.readouterr()
    code = in_process("export", str(part), "--out", str(tmp_path / "avg.safetensors"), "--which",
                      "avg")
    assert code == 2 and "final_avg.safetensors" in capsys.readouterr().err


# -- EMA's warm-up (issue 44) ---------------------------------------------------------------------


def _share_of_first_weights(warmup: bool, updates: int) -> float:
    """The default EMA (decay 0.999) of a weight that is 0 at the first update and 1 at every
    later one: what is left of the first weights is 1 - the average."""
    model = nn.Linear(1, 1, bias=False)
    average = WeightAverage(AverageConfig(kind="ema", warmup=warmup), model)
    with torch.no_grad():
        model.weight.fill_(0.0)
        average.update()  # the first update copies the weights
        model.weight.fill_(1.0)
        for _ in range(updates - 1):
            average.update()
    return 1.0 - float(average.module.weight)


def test_the_default_ema_forgets_the_initial_weights_within_a_hundred_updates():
    assert _share_of_first_weights(warmup=True, updates=100) < 1e-6  # float32: one ulp of 1
    # without the warm-up, 0.999^99 of them: the average is mostly the random start
    assert _share_of_first_weights(warmup=False, updates=100) == pytest.approx(0.999 ** 99)


def test_the_warm_up_is_tensorflows_and_ends_at_the_configured_decay():
    average = WeightAverage(AverageConfig(kind="ema", decay=0.99), nn.Linear(1, 1))
    assert [average.decay_after(t) for t in (0, 1, 10)] == [0.1, 2 / 11, 11 / 20]
    assert average.decay_after(10_000) == 0.99  # (1 + t) / (10 + t) passed 0.99 at t = 890
    off = WeightAverage(AverageConfig(kind="ema", decay=0.99, warmup=False), nn.Linear(1, 1))
    assert off.decay_after(1) == 0.99


def test_a_resume_continues_the_warm_up_bit_for_bit(tmp_path):
    """A run stopped at step 5 and resumed trains the average an uninterrupted run trains: the
    warm-up's t comes back from the checkpoint (n_averaged), not from 0."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = {"average.kind": "ema", "schedule.name": "constant"}
    ironloop.fit(tiny_mlp(), blobs(200), None, {**cfg(whole), **common, "train.max_steps": 14})
    ironloop.fit(tiny_mlp(), blobs(200), None, {**cfg(split), **common, "train.max_steps": 5})
    ironloop.fit(tiny_mlp(), blobs(200), None, {**cfg(split), **common, "train.max_steps": 14},
                 resume=True, allow_config_change=True)  # extended: the same constant LR
    a = load_file(whole / "run" / "final_avg.safetensors")
    b = load_file(split / "run" / "final_avg.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
