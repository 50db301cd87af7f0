"""The doctor: each planted bug is found, a clean model draws no error or warning, and the
preflight, --strict and `ironloop doctor` behave as documented."""

from __future__ import annotations

import json
import sys
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import ironloop
from ironloop.config import Config
from ironloop.data.loader import TensorData
from ironloop.engine.oom import OutOfMemory
from ironloop.tools.doctor.lr_find import check_lr_find
from ironloop.tools.doctor.run import DoctorError, check, subject
from ironloop.tools.recipe import train_config
from tests.conftest import REPO, blobs, cfg, tiny_mlp

SOFTMAX_PKG = '''
from torch import nn
import math

def softmax_model(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU(),
                         nn.Linear(32, num_classes), nn.Softmax(dim=1))
'''


def config(**over) -> Config:
    base = {"train.batch_size": 32, "optim.lr": 1e-2, "run.dir": "unused"}
    return Config().with_overrides({**base, **{k.replace("__", "."): v for k, v in over.items()}})


def diagnose(model, train=None, val=None, test=None, **over):
    train = train if train is not None else blobs(256)
    val = val if val is not None else blobs(64, seed=1)
    return check(subject(model, train, val, test, config(**over)))


def serious(findings, check_name=None):
    return [f for f in findings if f.severity != "info"
            and (check_name is None or f.check == check_name)]


def test_clean_model_draws_no_error_or_warning():
    findings = diagnose(tiny_mlp())
    assert serious(findings) == [], [f.render() for f in serious(findings)]
    checks = {f.check for f in findings}
    assert {"labels", "leakage", "initial_loss", "probabilities", "overfit_batch",
            "dead_parameters", "input_bound"} <= checks
    assert any("pass" in f.measured for f in findings if f.check == "overfit_batch")


def test_softmax_head_is_named():
    model = nn.Sequential(tiny_mlp(), nn.Softmax(dim=1))
    (f,) = serious(diagnose(model), "probabilities")
    assert f.severity == "error" and "'1'" in f.measured and "nn.Softmax" in f.measured
    assert "remove the final nn.Softmax" in f.fix


class FunctionalSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_mlp()

    def forward(self, x):
        return self.net(x).softmax(-1)  # no module to find: the outputs give it away


def test_probabilities_from_forward_are_caught():
    (f,) = serious(diagnose(FunctionalSoftmax()), "probabilities")
    assert f.severity == "error" and "sums to 1" in f.measured


class DeadLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_mlp()
        self.unused = nn.Linear(8, 8)      # built, never called
        self.gate = nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x) + 0 * self.gate(x)  # gate's output never reaches the loss


def test_dead_layer_is_named():
    found = serious(diagnose(DeadLayer()), "dead_parameters")
    text = " ".join(f.measured for f in found)
    assert "unused.weight" in text and "unused.bias" in text   # no gradient
    assert "gate.weight" in text                                 # exactly zero gradient
    assert "net." not in text
    assert found[0].fix == ("call the layer in forward() or delete it; frozen weights should "
                            "set requires_grad=False")  # Python's spelling: code to paste


def test_labels_out_of_range():
    train = blobs(256)
    bad = TensorData(train.x, train.y.clone())
    bad.y[[3, 10]] = 5
    errors = [f for f in diagnose(tiny_mlp(), bad) if f.severity == "error"]
    assert errors and errors[0].check == "labels"
    assert "2 label(s) outside [0, 3)" in errors[0].measured and "[3, 10]" in errors[0].measured


def test_class_never_seen_and_balance():
    train = blobs(256)
    keep = train.y != 2
    found = diagnose(tiny_mlp(), TensorData(train.x[keep], train.y[keep]))
    (missing,) = [f for f in serious(found, "labels") if "never appear" in f.measured]
    assert "[2]" in missing.measured
    assert any("class balance" in f.measured for f in found if f.check == "labels")


def test_duplicated_train_val_samples():
    train, val = blobs(256), blobs(64, seed=1)
    val.x[[0, 5, 7]] = train.x[[11, 12, 13]]
    (f,) = serious(diagnose(tiny_mlp(), train, val), "leakage")
    assert f.severity == "error" and f.measured.startswith("3 of 64 val samples")
    assert "val[0]=train[11]" in f.measured
    test = TensorData(train.x[:4].clone(), train.y[:4].clone())
    leaks = serious(diagnose(tiny_mlp(), train, blobs(64, seed=1), test), "leakage")
    assert [f.measured.split(" (")[0] for f in leaks] == ["4 of 4 test samples"]


class SlowData(Dataset):
    """Blobs behind a __getitem__ that sleeps, like an expensive decode."""

    def __init__(self, n: int, delay: float):
        self.data, self.delay = blobs(n), delay

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.data.x[i], self.data.y[i]


def test_loader_slowed_by_a_sleep():
    # 80 ms a batch: slower than the tiny model by far even on a loaded machine
    found = diagnose(tiny_mlp(), SlowData(96, 0.01), train__batch_size=8)
    (f,) = serious(found, "input_bound")
    assert f.severity == "warning" and "data.num_workers=" in f.fix
    assert "ironloop.tune(" in f.fix  # outside `ironloop train`: the Python call


def test_model_too_wide_for_its_lr():
    wide = nn.Sequential(nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 3))
    hot = {"optim__name": "sgd", "optim__lr": 0.5, "clip__max_norm": 0.0}
    (f,) = serious(diagnose(wide, **hot), "overfit_batch")
    assert f.severity == "error" and "diverged" in f.measured and "lower optim.lr" in f.fix
    assert serious(diagnose(tiny_mlp(), **hot), "overfit_batch") == []  # the narrow one copes


def test_checks_leave_model_and_rng_untouched():
    model = tiny_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    diagnose(model)
    assert torch.equal(torch.rand(3), expected)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_lr_find_writes_plot_and_names_method(tmp_path):
    s = subject(tiny_mlp(), blobs(256), None, None, config())
    (f,) = check_lr_find(s, tmp_path / "lr_find.png", steps=60)
    assert (tmp_path / "lr_find.png").read_bytes()[:4] == b"\x89PNG"
    assert "steepest descent" in f.measured


@pytest.fixture
def softmax_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(SOFTMAX_PKG)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("pkg", None)
    yield tmp_path
    sys.modules.pop("pkg", None)


def test_strict_preflight_stops_before_training(softmax_pkg, tmp_path, capsys):
    run_dir = tmp_path / "run"
    conf = Config().with_overrides({"run.dir": str(run_dir), "model.name": "pkg:softmax_model",
                                    "doctor.strict": True, "log.progress": "off"})
    with pytest.raises(DoctorError, match="probabilities"):
        train_config(conf)
    assert "error: [probabilities]" in capsys.readouterr().out
    report = json.loads((run_dir / "doctor.json").read_text())
    assert any(f["check"] == "probabilities" and f["severity"] == "error"
               for f in report["findings"])
    assert not (run_dir / "metrics.jsonl").exists()


def test_fit_runs_the_preflight_when_doctor_preflight_is_true_and_not_by_default(tmp_path,
                                                                                capsys):
    """ironloop.fit() with doctor.preflight=true runs the quick checks the CLI runs (issue 44:
    it ignored the key), with the run's own loss_fn; fit()'s default (null) does not."""
    softmax = nn.Sequential(nn.Linear(8, 3), nn.Softmax(dim=1))
    conf = cfg(tmp_path, doctor__preflight=True, doctor__strict=True)
    with pytest.raises(DoctorError, match="probabilities"):
        ironloop.fit(softmax, blobs(96), blobs(32, seed=1), conf)
    assert (tmp_path / "run" / "doctor.json").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert "preflight:" in capsys.readouterr().out
    plain = cfg(tmp_path / "plain", train__epochs=1)
    ironloop.fit(tiny_mlp(), blobs(96), blobs(32, seed=1), plain)
    assert "preflight:" not in capsys.readouterr().out
    assert not (tmp_path / "plain" / "run" / "doctor.json").exists()


def test_cli_doctor_names_the_softmax_and_the_fix(softmax_pkg, tmp_path, monkeypatch, capsys):
    """``ironloop doctor`` by the CLI's main in this process (what ``python -m ironloop`` runs;
    tests/test_cli.py starts that process as a user would): the softmax_pkg fixture makes pkg
    importable, as PYTHONPATH would."""
    from ironloop.cli import main

    monkeypatch.chdir(REPO)
    code = main(["doctor", "configs/digits.yaml", "model.name=pkg:softmax_model",
                 f"run.dir={tmp_path / 'doc'}", "--strict"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "final module '4' is nn.Softmax" in out
    assert "fix:   remove the final nn.Softmax" in out
    assert (tmp_path / "doc" / "doctor.json").exists()


def test_clean_digits_run_prints_no_warning_and_ends_with_the_time_table(tmp_path, capsys):
    """What `ironloop train configs/digits.yaml` does, in-process (one epoch)."""
    from ironloop.config import load_config

    conf = load_config(REPO / "configs/digits.yaml", [f"run.dir={tmp_path / 'd'}",
                                                      "train.epochs=1", "log.progress=off"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning fails the test too
        train_config(conf)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "warning" not in out.lower() and "error" not in out.lower(), out
    assert "doctor: 8 checks passed" in captured.out
    assert "time split (wall time" in captured.out.split("epoch 1/1")[1]
    assert (tmp_path / "d" / "doctor.json").exists()


def test_injected_oom_gives_the_message_and_keeps_checkpoints(tmp_path):
    conf = cfg(tmp_path, train__epochs=3, checkpoint__every_steps=2, fault__oom_at_step=5)
    with pytest.raises(OutOfMemory) as e:
        ironloop.fit(tiny_mlp(), blobs(200), blobs(40, seed=1), conf)
    msg = str(e.value)
    assert "out of memory at optimizer step 6 (epoch 1)" in msg and "train.batch_size=32" in msg
    fixes = msg.split("Fixes, easiest first:")[1]
    order = [fixes.index(k) for k in ("train.batch_size=16 train.accumulation_steps=2",
                                      "train.precision=bf16", "activation checkpointing")]
    assert order == sorted(order)
    assert "resume=True" in msg and "--resume" not in msg  # fit() speaks Python
    state = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)
    assert state["progress"]["step"] == 4
    ironloop.fit(tiny_mlp(), blobs(200), blobs(40, seed=1),
                 {**conf, "fault.oom_at_step": 0}, resume=True)  # and the run resumes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_check_on_cuda():
    found = check(subject(tiny_mlp(), blobs(256), blobs(64, seed=1), None,
                          config(run__device="cuda")))
    (f,) = [f for f in found if f.check == "memory"]
    assert "peaks at" in f.measured and "largest batch about" in f.measured


class OomOnBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = tiny_mlp()

    def forward(self, x):
        if torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)


def test_a_check_that_runs_out_of_memory_becomes_a_finding():
    found = diagnose(OomOnBackward())
    oom = [f for f in found if f.severity == "error"]
    assert {f.check for f in oom} == {"overfit_batch", "dead_parameters", "input_bound"}
    assert all("out of device memory" in f.measured for f in oom)


def test_label_smoothing_moves_the_overfit_target_to_its_floor():
    """With smoothing the loss cannot reach 0: a 10x fall towards 0 would be impossible."""
    from ironloop.tools.doctor.model_checks import loss_floor

    s = subject(tiny_mlp(), blobs(256), None, None, config(loss__label_smoothing=0.2))
    assert loss_floor(s) == pytest.approx(
        -(0.8667 * torch.log(torch.tensor(0.8667)) + 2 * 0.0667 * torch.log(torch.tensor(0.0667))
          ).item(), rel=1e-3)
    found = check(s)
    assert serious(found) == [], [f.render() for f in serious(found)]
    assert any("pass" in f.measured for f in found if f.check == "overfit_batch")


def test_preflight_is_skipped_on_a_resume_that_already_ran_it(tmp_path, capsys):
    from ironloop.data.bundle import DataBundle
    from ironloop.tools.doctor.run import preflight

    conf = config(run__dir=str(tmp_path))
    bundle = DataBundle(blobs(128), blobs(32, seed=1), None, (8,), 3)
    assert preflight(conf, tiny_mlp(), bundle) and (tmp_path / "doctor.json").exists()
    assert preflight(conf, tiny_mlp(), bundle, resume=True) == []
    assert capsys.readouterr().out.count("doctor: 8 checks passed") == 1
    assert preflight(config(run__dir=str(tmp_path), doctor__preflight=False), tiny_mlp(),
                     bundle) == []


def test_the_batch_search_doubles_the_real_batch_until_a_step_runs_out_of_memory(monkeypatch):
    """``doctor.memory_search``: each doubled batch is the first batch's samples repeated (the
    step sees real inputs of that size), and the answer is the last size whose step fit."""
    from ironloop.tools.doctor import model_checks as mc

    s = subject(tiny_mlp(), blobs(256), None, None, config())
    batch = s.batch()  # 32 samples
    seen = []

    def step_on_a_device_of_200_samples(s, model, opt, big):
        seen.append((len(big[0]), len(big[1])))
        assert torch.equal(big[0][32:64], batch[0])  # the first batch's samples, repeated
        if len(big[0]) > 200:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 0

    monkeypatch.setattr(mc, "_peak_of_step", step_on_a_device_of_200_samples)
    model, opt = s.copy()
    assert mc._search_batch(s, model, opt, batch, total=2**30) == 128
    assert seen == [(64, 64), (128, 128), (256, 256)]


def test_a_loader_with_one_batch_is_not_called_input_bound():
    """The first batch is left out of the timing (one-off costs): a loader with nothing after
    it measured no loading time, and must not be blamed for the step's."""
    from ironloop.tools.doctor.data_checks import check_input_bound

    s = subject(tiny_mlp(), blobs(32), None, None, config())  # one batch of 32
    (f,) = check_input_bound(s, s.batch())
    assert f.severity == "info", f.render()


def test_more_than_ten_missing_classes_are_listed_as_the_first_ten_and_more():
    from ironloop.tools.doctor.data_checks import check_labels

    train = blobs(64)  # classes 0..2 of the model's 15
    s = subject(tiny_mlp(c=15), train, None, None, config(), num_classes=15)
    (f,) = [f for f in check_labels(s) if "never appear" in f.measured]
    assert f.measured == "train: 12 of 15 classes never appear: [3, 4, 5, 6, 7, 8, 9, 10, 11, " \
                         "12] ..."
    s = subject(tiny_mlp(c=13), train, None, None, config(), num_classes=13)
    (f,) = [f for f in check_labels(s) if "never appear" in f.measured]
    assert f.measured.endswith("[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]")  # all ten: no "..."


def test_the_lr_suggestion_is_the_steepest_fall_before_the_minimum():
    from ironloop.tools.doctor.lr_find import suggest

    lrs = [10.0 ** e for e in range(-7, 1)]
    losses = [2.30, 2.28, 2.20, 1.20, 0.90, 0.80, 0.75, 3.00]  # steepest from 1e-5 to 1e-4
    assert suggest(lrs, losses) == 1e-5
    assert suggest(lrs, [2.30, 1.00, 0.90, 0.85, 0.80, 0.78, 0.75, 3.00]) == 1e-7


def test_an_lr_far_below_the_suggestion_is_a_warning_with_its_cause_and_fix(tmp_path,
                                                                          monkeypatch):
    from ironloop.tools.doctor import lr_find

    lrs = [10.0 ** e for e in range(-7, 1)]  # a sweep whose steepest fall is at 1e-5
    losses = [2.30, 2.28, 2.20, 1.20, 0.90, 0.80, 0.75, 3.00]
    monkeypatch.setattr(lr_find, "sweep", lambda s, steps: (lrs, losses))
    s = subject(tiny_mlp(), blobs(64), None, None, config(optim__lr=1e-7))
    (f,) = check_lr_find(s, tmp_path / "lr_find.png")
    assert f.severity == "warning" and "suggested LR 1.00e-05" in f.measured
    assert "far below" in f.cause and "cause: " in f.render()
    assert f.fix.startswith("raise optim.lr to about ")


def test_the_out_of_memory_finding_names_real_config_keys():
    """Every dotted key the fix names is one the config has: the user types it as written."""
    import re

    (f,) = [f for f in diagnose(OomOnBackward()) if f.check == "dead_parameters"]
    keys = re.findall(r"\b[A-Za-z_]\w*\.\w+", f.fix)
    assert set(keys) >= {"train.batch_size", "train.accumulation_steps", "train.precision"}
    flat = Config().to_dict()
    for key in keys:
        section, name = key.split(".")
        assert name in flat.get(section, {}), key


def test_ironloop_doctor_stops_on_an_error_with_strict_from_the_flag_or_the_config(
        softmax_pkg, tmp_path, capsys):
    from ironloop.config import load_config
    from ironloop.tools.doctor.run import doctor_config

    def conf(*extra):
        return load_config(None, [f"run.dir={tmp_path / 'doc'}", "data.name=synthetic",
                                  "model.name=pkg:softmax_model", *extra])

    assert any(f.severity == "error" for f in doctor_config(conf()))  # reported, not raised
    with pytest.raises(DoctorError, match="probabilities"):
        doctor_config(conf(), strict=True)
    with pytest.raises(DoctorError, match="probabilities"):
        doctor_config(conf("doctor.strict=true"))
