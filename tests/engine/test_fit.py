"""fit()'s own wiring: run.threads is applied before the run is built, recorded, and given
back."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

import ironloop
from ironloop.callbacks import Callback
from ironloop.engine import fit as fit_module
from ironloop.engine.fit import settings_of
from ironloop.engine.step_fns import lm_step
from ironloop.errors import ConfigError, DataError, UserError
from ironloop.outputs.readers import read_jsonl
from ironloop.outputs.time_split import advice
from tests.conftest import blobs, cfg, tiny_mlp


class Threads(Callback):
    """Records torch's intra-op threads at every step and at the start."""

    def __init__(self):
        self.seen: list[int] = []

    def on_train_start(self, run, metrics: dict) -> None:
        self.seen.append(torch.get_num_threads())

    def on_step_end(self, run, metrics: dict) -> None:
        self.seen.append(torch.get_num_threads())


#: a run without training data, for the time table's settings (not sliced in-memory tensors)
NO_DATA = SimpleNamespace(train=None, collate_fn=None)


def test_run_threads_is_applied_for_the_run_recorded_and_given_back(tmp_path):
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    spy = Threads()
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, run__threads=want),
                          callbacks=[spy])
    assert spy.seen and set(spy.seen) == {want}
    assert result.results["threads"] == want
    assert json.loads((tmp_path / "run/results.json").read_text())["threads"] == want
    assert torch.get_num_threads() == before  # a second fit() in this process starts as before


def test_run_threads_0_leaves_torch_s_default_and_records_it(tmp_path):
    before = torch.get_num_threads()
    spy = Threads()
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path), callbacks=[spy])
    assert set(spy.seen) == {before} and result.results["threads"] == before


def test_negative_run_threads_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"run\.threads=-1: must be in \[0, 1024\]"):
        ironloop.Config().with_overrides({"run.threads": -1})


def test_results_final_val_acc_is_the_last_epochs_and_best_val_acc_the_highest(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1), cfg(tmp_path))
    epochs = [json.loads(line) for line in
              (tmp_path / "run/epochs.jsonl").read_text().splitlines()]
    accs = [r["val_acc"] for r in epochs]
    assert len(accs) == 2
    assert result.results["final_val_acc"] == accs[-1]
    assert result.results["best_val_acc"] == max(accs)
    # the run's seconds are its epochs' (training + epoch-end validation), as epochs.jsonl
    # counts them
    assert result.results["seconds"] == pytest.approx(sum(r["seconds"] for r in epochs))
    assert all(r["seconds"] > 0 for r in epochs)


def test_an_fp32_run_on_a_cuda_device_with_bf16_is_advised_to_try_bf16(monkeypatch):
    # The CUDA path without a GPU: settings_of reads the device and torch's bf16 support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    run = SimpleNamespace(data=NO_DATA, cfg=ironloop.Config(), module=SimpleNamespace(
        device=torch.device("cuda"), optimizer=opt, precision="fp32", takes_closure=False))
    compute_bound = {"data": 0.0, "copy": 0.0, "forward": 4.0, "backward": 5.0,
                     "optimizer": 1.0, "checkpoint": 0.0, "validation": 0.0, "other": 0.0}
    assert any("train.precision=bf16" in a for a in advice(compute_bound, settings_of(run)))
    run.module.device = torch.device("cpu")
    assert not any("bf16" in a for a in advice(compute_bound, settings_of(run)))


@pytest.mark.parametrize("pinned", [False, True])
def test_a_copy_bound_cuda_run_is_advised_to_pin_memory_only_when_it_is_off(pinned):
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    run = SimpleNamespace(data=NO_DATA,
                          cfg=ironloop.Config().with_overrides({"data.pin_memory": pinned}),
                          module=SimpleNamespace(device=torch.device("cuda"), optimizer=opt,
                                                 precision="bf16", takes_closure=False))
    copy_bound = {"data": 0.0, "copy": 5.0, "forward": 2.0, "backward": 2.0,
                  "optimizer": 1.0, "checkpoint": 0.0, "validation": 0.0, "other": 0.0}
    lines = advice(copy_bound, settings_of(run))
    assert any("set data.pin_memory=true" in a for a in lines) is not pinned
    assert any("pinned memory is already on" in a for a in lines) is pinned


def test_results_name_the_device_and_precision_the_run_used(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    saved = json.loads((tmp_path / "run/results.json").read_text())
    assert (result.results["device"], result.results["precision"]) == ("cpu", "fp32")
    assert (saved["device"], saved["precision"]) == ("cpu", "fp32")


def test_a_dict_config_is_parsed_once_per_fit(tmp_path, monkeypatch):
    """fit()'s wrappers (the run.dir lock, run.threads) and fit() itself share one Config:
    a dict is parsed once, not once per wrapper (issue 41)."""
    from ironloop.engine import fit as fit_module

    parsed = []
    real = fit_module.as_config

    def counting(config):
        if not isinstance(config, ironloop.Config):
            parsed.append(config)
        return real(config)

    monkeypatch.setattr(fit_module, "as_config", counting)
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    assert len(parsed) == 1


def test_the_wait_for_checkpoint_writes_and_uploads_at_the_end_is_not_training_time(
        tmp_path, monkeypatch):
    """Closing the outputs waits for an async checkpoint write and the remote's uploads (up to
    checkpoint.remote_wait_s); that wait is kept out of train_seconds. A clock that jumps 1000 s
    while the outputs close stands in for a stalled store (no wall-clock assertion)."""
    import time

    from ironloop.engine.run import Outputs

    shift, real_clock, real_close = [0.0], time.perf_counter, Outputs.close

    def slow_close(self):
        shift[0] += 1000.0
        real_close(self)

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + shift[0])
    monkeypatch.setattr(Outputs, "close", slow_close)
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    assert shift[0] == 1000.0 and 0.0 < result.results["train_seconds"] < 1000.0


def test_a_run_that_max_steps_stops_mid_epoch_records_the_open_epoch(tmp_path):
    # 64 samples in batches of 16: 4 steps an epoch; max_steps=3 stops in epoch 1
    result = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                          cfg(tmp_path, train__batch_size=16, train__max_steps=3,
                              guard__enabled=False))
    final = read_jsonl(tmp_path / "run/evals.jsonl")[-1]
    assert final["step"] == 3
    assert result.results["stopped_mid_epoch"] == {"epoch": 1, "val_loss": final["val_loss"]}
    assert (result.results["steps"], result.results["epochs"]) == (3, 1)
    assert result.results["seconds"] > 0  # the open epoch's training and final evaluation
    assert "bad_steps" not in result.results  # no guard, no guard counts
    saved = json.loads((tmp_path / "run/results.json").read_text())
    assert saved["stopped_mid_epoch"] == result.results["stopped_mid_epoch"]


def test_a_run_without_the_guard_logs_its_epochs_and_counts_no_bad_steps(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), None,
                          cfg(tmp_path, train__epochs=1, guard__enabled=False))
    (row,) = read_jsonl(tmp_path / "run/epochs.jsonl")
    assert (row["epoch"], row["step"]) == (1, 2) and "bad_steps" not in row
    assert "stopped_mid_epoch" not in result.results


def test_an_epoch_line_without_seconds_counts_none_in_the_run_s_seconds(tmp_path):
    """epochs.jsonl written by an ironloop from before epochs logged their seconds: a resume
    that extends the run sums the seconds the lines have."""
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    log = tmp_path / "run/epochs.jsonl"
    (old,) = read_jsonl(log)
    del old["seconds"]
    log.write_text(json.dumps(old) + "\n")
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=2),
                          resume=True, allow_config_change=True)
    rows = read_jsonl(log)
    assert len(rows) == 2 and "seconds" not in rows[0]
    assert result.results["seconds"] == pytest.approx(rows[1]["seconds"])


def test_a_checkpoint_that_does_not_fit_the_model_is_named_in_the_error(tmp_path):
    from ironloop.errors import CheckpointError

    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    last = tmp_path / "run/checkpoints/last.pt"
    with pytest.raises(CheckpointError, match=rf"^checkpoint {last} does not fit this model: "):
        ironloop.fit(tiny_mlp(c=4), blobs(64), None, cfg(tmp_path, train__epochs=1),
                     resume=True)


def test_the_time_table_s_settings_are_the_run_s():
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    run = SimpleNamespace(data=NO_DATA, cfg=ironloop.Config(), module=SimpleNamespace(
        device=torch.device("cpu"), optimizer=opt, precision="fp32", takes_closure=False))
    got = settings_of(run)
    assert (got.device, got.threads, got.optimizer, got.precision, got.bf16_open) == \
        ("cpu", torch.get_num_threads(), "loop", "fp32", False)
    # the user's SGD, not the AdamW optim.name builds: named in the advice
    assert got.optimizer_class == "SGD" and got.foreach_open and not got.closure


def test_results_hold_the_test_splits_accuracy_and_loss_of_the_weights_it_measured(tmp_path):
    test = blobs(40, seed=2)  # 40 = 32 + 8: a ragged last evaluation batch
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1),
                          test_data=test)
    assert result.results["test_weights"] == "last"  # no validation, no best: the final weights
    with torch.no_grad():
        logits = result.model.eval()(test.x)
    loss = float(torch.nn.functional.cross_entropy(logits, test.y))
    acc = float((logits.argmax(1) == test.y).float().mean())
    assert result.results["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert result.results["test_acc"] == pytest.approx(acc, abs=1e-6)
    saved = json.loads((tmp_path / "run/results.json").read_text())
    assert (saved["test_acc"], saved["test_loss"]) == \
        (result.results["test_acc"], result.results["test_loss"])


def test_results_final_val_ppl_is_the_last_evaluations_perplexity(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                          cfg(tmp_path, eval__perplexity=True))
    evals = read_jsonl(tmp_path / "run/evals.jsonl")
    assert len(evals) == 2 and evals[0]["val_ppl"] != evals[-1]["val_ppl"]
    assert result.results["final_val_ppl"] == evals[-1]["val_ppl"]
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    without = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                           cfg(tmp_path / "off"))
    assert "final_val_ppl" not in without.results  # no perplexity asked for: none recorded


def test_every_time_table_setting_is_read_from_the_run_s_config_and_module(monkeypatch):
    import os

    from ironloop.engine import fit as fit_module

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(fit_module.os, "cpu_count", lambda: 64)  # not what the run may use
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    sgd = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1, fused=True)
    config = ironloop.Config().with_overrides({
        "data.num_workers": 3, "data.pin_memory": True, "checkpoint.every_steps": 7,
        "checkpoint.async": True, "optim.name": "sgd"})
    run = SimpleNamespace(data=NO_DATA, cfg=config, module=SimpleNamespace(
        device=torch.device("cuda"), optimizer=sgd, precision="bf16", takes_closure=True))
    got = settings_of(run)
    assert (got.device, got.num_workers, got.cores, got.pin_memory) == ("cuda", 3, 3, True)
    assert (got.optimizer, got.fused_open, got.foreach_open, got.closure) == \
        ("fused", True, True, True)
    assert (got.optimizer_class, got.checkpoint_async, got.checkpoint_every_steps) == \
        ("", True, 7)
    assert (got.precision, got.bf16_open) == ("bf16", True)
    # LBFGS takes neither fused= nor foreach=: neither is open
    lbfgs = torch.optim.LBFGS(tiny_mlp().parameters())
    run.module.optimizer, run.module.device = lbfgs, torch.device("cpu")
    got = settings_of(run)
    assert (got.fused_open, got.foreach_open, got.optimizer_class, got.bf16_open) == \
        (False, False, "LBFGS", False)
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS, Windows: the machine's count
    assert settings_of(run).cores == 64


def test_the_test_split_of_a_run_without_checkpoints_is_measured_on_the_restored_best(tmp_path):
    """Early stopping restored the best weights in memory (there is no best.pt to read): the
    test split measures those and says so."""
    train, val = blobs(n=128), blobs(n=64, seed=1)
    val = type(val)(val.x, (val.y + 1) % 3)  # val disagrees with train: val loss worsens
    test = blobs(40, seed=2)
    result = ironloop.fit(tiny_mlp(), train, val,
                          cfg(tmp_path, train__epochs=20, early_stop__patience=2,
                              optim__lr=0.01, checkpoint__enabled=False), test_data=test)
    assert result.results["restored_best"]
    assert not (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    assert result.results["test_weights"] == "best"
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(result.model.eval()(test.x), test.y))
    assert result.results["test_loss"] == pytest.approx(loss, rel=1e-5)


def test_a_synchronized_time_split_prints_the_gpu_compute_share(tmp_path, monkeypatch, capsys):
    """profile.sync's timer (CUDA only) reaches the time table, which then adds the share of
    the step spent in forward + backward. The CPU timer never syncs: it is set here, after
    the loop and before the table."""
    real = fit_module.evaluate.test_metrics

    def synced(run, restored):
        run.outputs.timer.sync = True
        return real(run, restored)

    monkeypatch.setattr(fit_module.evaluate, "test_metrics", synced)
    ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    assert "GPU compute (forward + backward): " in capsys.readouterr().out


def test_a_run_stopped_mid_epoch_counts_its_open_epoch_s_training_and_final_evaluation(tmp_path):
    """results' seconds: the finished epochs' lines, plus the open epoch's training so far and
    its final evaluation (each step and evaluation batch sleeps, so every part is sizeable)."""
    def step(m, batch):
        time.sleep(0.01)
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1]), {}

    # 64 samples in batches of 32: 2 steps an epoch; step 5 is the first of epoch 3
    result = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                          cfg(tmp_path, train__epochs=3, train__max_steps=5), step_fn=step)
    epochs = read_jsonl(tmp_path / "run/epochs.jsonl")
    final = read_jsonl(tmp_path / "run/evals.jsonl")[-1]
    assert len(epochs) == 2 and final["step"] == 5 and 0.01 < final["seconds"] < 60
    trained = sum(r["train_seconds"] for r in epochs)  # the closed epochs' training
    assert trained > 0.04
    open_epoch = result.results["train_seconds"] - trained + final["seconds"]
    assert result.results["seconds"] == pytest.approx(
        sum(r["seconds"] for r in epochs) + open_epoch, abs=2e-3)


# --- fit()'s arguments and the config it resolves --------------------------------------------

def test_a_config_that_is_not_a_config_dict_or_none_is_refused_naming_its_type():
    assert fit_module.as_config(None) == ironloop.Config()
    given = ironloop.Config()
    assert fit_module.as_config(given) is given
    both = fit_module.as_config({"train": {"epochs": 3}, "optim.lr": 0.5})
    assert (both.train.epochs, both.optim.lr) == (3, 0.5)
    with pytest.raises(ConfigError) as e:
        fit_module.as_config(["train.epochs=3"])
    assert str(e.value) == "config must be an ironloop.Config, a dict or None, not list"


def test_fit_s_required_arguments_are_refused_in_one_full_line(tmp_path):
    with pytest.raises(UserError) as e:
        ironloop.fit(lambda x: x, blobs(), None, cfg(tmp_path))
    assert str(e.value) == ("model must be a torch.nn.Module, not function; pass the model "
                            "instance (a function: wrap it in an nn.Module's forward)")
    with pytest.raises(DataError) as e:
        ironloop.fit(tiny_mlp(), None, None, cfg(tmp_path))
    assert str(e.value) == ("train_data is None; pass the training split: a Dataset, a "
                            "DataLoader, a Hugging Face datasets.Dataset or an (inputs, "
                            "targets) pair")


def test_named_validation_sets_monitor_the_first_set_s_loss_unless_a_metric_is_chosen():
    sets = {"clean": blobs(8), "noisy": blobs(8, seed=1)}
    base = ironloop.Config()
    assert fit_module.resolved(base, blobs(8), None, sets).early_stop.metric == "val_clean_loss"
    chosen = base.with_overrides({"early_stop.metric": "val_noisy_acc"})
    assert fit_module.resolved(chosen, blobs(8), None, sets).early_stop.metric == "val_noisy_acc"
    assert fit_module.resolved(base, blobs(8), None, blobs(8)).early_stop.metric == "val_loss"
    assert fit_module.resolved(base, blobs(8), None, None).early_stop.metric == "val_loss"


def test_the_lm_step_reports_perplexity_by_default_and_other_steps_do_not():
    base = ironloop.Config()
    assert fit_module.resolved(base, blobs(8), lm_step).eval.perplexity
    named = base.with_overrides({"train.step_fn": "lm"})
    assert fit_module.resolved(named, blobs(8), None).eval.perplexity
    assert not fit_module.resolved(base, blobs(8), None).eval.perplexity


def test_a_passed_dataloader_s_batch_size_is_the_run_s():
    loader = DataLoader(blobs(40), batch_size=5)
    assert fit_module.resolved(ironloop.Config(), loader, None).train.batch_size == 5


def test_a_resume_on_more_ranks_keeps_the_global_batch_of_the_checkpoint_it_peeked(tmp_path,
                                                                                   monkeypatch):
    conf = ironloop.Config().with_overrides(cfg(tmp_path, train__batch_size=8,
                                                train__accumulation_steps=2, train__max_steps=2))
    ironloop.fit(tiny_mlp(), blobs(64), None, conf)  # 1 rank x 8 x 2: a global batch of 16
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # as torchrun sets them; nothing here joins a group
    peeked = fit_module.peek(conf, True)
    assert peeked is not None and peeked.found is not None and peeked.found.step == 2
    assert fit_module.resolved(conf, blobs(64), None, None, peeked) \
        .train.accumulation_steps == 1  # 2 ranks x 8 x 1 keeps the 16
    assert fit_module.resolved(conf, blobs(64), None).train.accumulation_steps == 2  # fresh
    assert fit_module.peek(conf, False) is None


def test_the_local_rank_comes_from_torchrun_s_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert fit_module._env_local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert fit_module._env_local_rank() == 3


def test_results_of_a_run_without_validation_have_no_best_and_count_its_epochs(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), None, cfg(tmp_path, train__epochs=1))
    got = result.results
    assert {k: got[k] for k in (
        "best_val_acc", "final_val_acc", "best_epoch", "monitor", "test_acc", "test_loss",
        "steps", "epochs", "stopped_early", "restored_best", "stopped_by_callback",
        "precision", "device")} == {
        "best_val_acc": None, "final_val_acc": None, "best_epoch": None,
        "monitor": {"val_loss": None}, "test_acc": None, "test_loss": None, "steps": 2,
        "epochs": 1, "stopped_early": False, "restored_best": False,
        "stopped_by_callback": False, "precision": "fp32", "device": "cpu"}
    assert not {"stopped_mid_epoch", "tokens", "tokens_per_s", "final_val_ppl",
                "test_weights"} & got.keys()
    (epoch,) = read_jsonl(tmp_path / "run/epochs.jsonl")
    assert got["seconds"] == epoch["seconds"]  # no open epoch adds to the closed one
    assert 0 < got["train_seconds"] <= got["wall_seconds_this_process"] < 600
    assert json.loads((tmp_path / "run/results.json").read_text()) == got
    assert (tmp_path / "run/results.json").read_text().startswith(
        '{\n  "best_val_acc": null,\n  "final_val_acc": null,\n')  # indented, for people


def test_a_run_whose_first_epoch_is_best_records_epoch_1(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                          cfg(tmp_path, train__epochs=1))
    assert result.results["best_epoch"] == 1


def test_a_run_stopped_mid_epoch_reports_its_final_evaluation_s_accuracy(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(64), blobs(32, seed=1),
                          cfg(tmp_path, train__batch_size=16, train__max_steps=3))
    final = read_jsonl(tmp_path / "run/evals.jsonl")[-1]
    assert final["step"] == 3 and result.results["final_val_acc"] == final["val_acc"]
