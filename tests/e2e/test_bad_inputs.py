"""Bad inputs end in one line and exit 2, with no traceback and nothing overwritten: a
non-finite LR, an empty training split, a model output that does not fit the loss, a disk that
fills up while metrics.jsonl is written (a real process under RLIMIT_FSIZE); the models, data
and arguments fit() refuses by name, config values and files the CLI refuses, a signal during
the CLI's setup."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ironloop
from ironloop.cli import main
from ironloop.config import load_config
from ironloop.errors import ConfigError, DataError, UserError
from tests.conftest import REPO, blobs, tiny_mlp
from tests.engine.test_preempt import ARGS, ENV, TIMEOUT


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "clip.max_norm", "optim.weight_decay"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_floats_are_refused(key, value, capsys, tmp_path):
    assert main(["train", "configs/digits.yaml", f"{key}={value}",
                 f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "finite" in err[0], err
    assert not (tmp_path / "run").exists()


def conf(tmp_path) -> dict:
    return {"run.dir": str(tmp_path / "run"), "log.progress": "off", "train.epochs": 1}


def test_an_empty_training_split_is_one_line(tmp_path):
    empty = (torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(DataError, match="training split is empty"):
        ironloop.fit(tiny_mlp(), empty, blobs(n=16), conf(tmp_path))
    assert not (tmp_path / "run").exists()  # refused: nothing written, not even the lock


def test_an_output_that_does_not_fit_the_loss_names_both_shapes(tmp_path):
    model = nn.Sequential(nn.Linear(8, 6), nn.Unflatten(1, (2, 3)))  # [batch, 2, 3]
    with pytest.raises(UserError, match=r"output Tensor\[32, 2, 3\].*targets Tensor\[32\]"):
        ironloop.fit(model, blobs(n=64), None, {**conf(tmp_path), "train.batch_size": 32})


def limited(limit: int):
    """In the child: files may grow to ``limit`` bytes; past it a write fails with EFBIG
    instead of killing the process with SIGXFSZ (what a full disk or a quota looks like)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_while_logging_stops_with_the_last_complete_line(tmp_path):
    run_dir, limit = tmp_path / "run", 9000
    proc = subprocess.run(
        [sys.executable, "-m", "ironloop", "train", *ARGS, "train.epochs=3",
         "checkpoint.enabled=false", f"run.dir={run_dir}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
        preexec_fn=limited(limit))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl" in err[0] and "File too large" in err[0], err
    assert "Traceback" not in proc.stderr
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and os.path.getsize(run_dir / "metrics.jsonl") <= limit
    steps = [json.loads(line)["step"] for line in text.splitlines()]  # every line complete
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 10


def test_the_preflight_doctor_names_samples_with_non_finite_inputs():
    from ironloop.tools.doctor.run import check, subject

    train = blobs(n=64)
    train.x[7, 2] = float("nan")
    train.x[40, 0] = float("inf")
    findings = check(subject(tiny_mlp(), train, blobs(n=16, seed=1), num_classes=3))
    bad = [f for f in findings if f.check == "finite_inputs"]
    assert len(bad) == 1 and bad[0].severity == "error", findings
    assert "train: 2 sample(s)" in bad[0].render() and "[7, 40]" in bad[0].render()
    clean = check(subject(tiny_mlp(), blobs(n=64), blobs(n=16, seed=1), num_classes=3))
    assert not [f for f in clean if f.check == "finite_inputs"]


# --- fit(): what the model, the data and the arguments cannot be -------------------------------

class DictSamples(torch.utils.data.Dataset):
    """Blobs as {'x': ..., 'y': ...} samples: batches the default step passes as model(**batch)."""

    def __init__(self):
        self.data = blobs(n=32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x, y = self.data[i]
        return {"x": x, "y": y}


class Total(nn.Module):
    """Returns one number for the whole batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x).sum()


class FixedProjection(nn.Module):
    """Its weights in a buffer: nothing to train."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(8, 3))

    def forward(self, x):
        return x @ self.w


class FirstThree(nn.Module):
    def forward(self, x):
        return x[:, :3]


def frozen_mlp() -> nn.Module:
    return tiny_mlp().requires_grad_(False)


def f1(num_classes: int):
    metrics = pytest.importorskip("torchmetrics.classification")
    return {"f1": metrics.MulticlassF1Score(num_classes=num_classes)}


def pairs(x, y):
    from ironloop.data.loader import TensorData

    return TensorData(x, y)


#: id -> (model, train_data, val_data, fit()'s keywords, what the one line must name)
FIT_CASES = {
    "30 features on 20": (lambda: (nn.Linear(30, 3), blobs(n=32, d=20), None, {}),
                          r"inputs Tensor\[16, 20\] float32.*samples of shape \[20\]"),
    "float64 inputs": (lambda: (tiny_mlp(), pairs(blobs(n=32).x.double(), blobs(n=32).y), None,
                                {}),
                       r"inputs are Tensor\[16, 8\] float64 but the model's parameters are "
                       r"float32.*\.to\(torch\.float32\)"),
    "dict batches": (lambda: (tiny_mlp(), DictSamples(), None, {}),
                     r"batches are dicts \(\{x: Tensor.*forward does not take them.*step_fn"),
    "scalar output": (lambda: (Total(), blobs(n=32), None, {}),
                      r"output Tensor\[\] float32.*one number for the whole batch"),
    "no parameters": (lambda: (FirstThree(), blobs(n=32), None, {}),
                      r"nothing to train: it has no parameters"),
    "all frozen": (lambda: (frozen_mlp(), blobs(n=32), None, {}),
                   r"nothing to train: all 4 of its parameter tensors are frozen"),
    "buffers only": (lambda: (FixedProjection(), blobs(n=32), None, {}),
                     r"nothing to train: it has no parameters, only buffers \(w\)"),
    "(N, 1) targets": (lambda: (tiny_mlp(), pairs(blobs(n=32).x, blobs(n=32).y[:, None]), None,
                                {}),
                       r"targets Tensor\[16, 1\] int64.*flatten the targets"),
    "callbacks=5": (lambda: (tiny_mlp(), blobs(n=32), None, {"callbacks": 5}),
                    r"callbacks=5: must be a list of callbacks, not int"),
    "meta device": (lambda: (tiny_mlp().to("meta"), blobs(n=32), None, {}),
                    r"meta device.*to_empty"),
    "val_data={}": (lambda: (tiny_mlp(), blobs(n=32), {}, {}),
                    r"val_data=\{\} names no validation set"),
    "val_data={'b': None}": (lambda: (tiny_mlp(), blobs(n=32), {"b": None}, {}),
                             r"val_data\['b'\] is None"),
    "metric for 5 classes": (lambda: (tiny_mlp(), blobs(n=32), blobs(n=16, seed=1),
                                      {"metrics": f1(5)}),
                             r"eval\.metrics\.f1: num_classes=5, but the run has 3 classes"),
}


@pytest.mark.parametrize("case", list(FIT_CASES))
def test_fit_refuses_a_bad_input_in_one_line_naming_it(case, tmp_path):
    build, named = FIT_CASES[case]
    model, train, val, kwargs = build()
    with pytest.raises(UserError, match=named) as caught:
        ironloop.fit(model, train, val, {**conf(tmp_path), "train.batch_size": 16}, **kwargs)
    assert "\n" not in str(caught.value)
    # nothing trained: no step logged, so the corrected rerun is not refused
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        not (tmp_path / "run" / "metrics.jsonl").read_text()


# --- the CLI: config values and files ----------------------------------------------------------

def refused(capsys, argv: list[str], *named: str) -> None:
    """main(argv) exits 2 with one line on stderr that names each of ``named``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(n in err[0] for n in named), err


@pytest.mark.parametrize(("seed", "named"), [
    ("99999999999999999999", "out of range"),  # torch.manual_seed: "Overflow", a traceback
    ("-99999999999999999999", "out of range"),
    ("1e23", "expected an integer"),  # YAML reads it as text
    ("1.0e+23", "expected an integer"),  # a float
])
def test_a_seed_out_of_64_bit_range_is_refused_before_torch_sees_it(seed, named, capsys,
                                                                    tmp_path):
    refused(capsys, ["train", "configs/digits.yaml", f"run.seed={seed}",
                     f"run.dir={tmp_path / 'run'}"], "run.seed=", named)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["run.threads=99999999", "data.num_workers=100000"])
def test_thread_and_worker_counts_past_1024_are_refused(override):
    # Checked on the config alone: without the check, a run would start them (OpenMP crashed
    # with SIGSEGV at 99999999 threads; 100000 loader workers fork-bomb the machine).
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}={value}: must be in \[0, 1024\]"):
        load_config(None, [override])


def test_a_yaml_key_given_twice_is_refused_naming_it_and_both_lines(capsys, tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text("run:\n  seed: 1\n  dir: x\ntrain:\n  epochs: 1\nrun:\n  seed: 2\n")
    refused(capsys, ["train", str(config)], str(config), "line 6", "'run'", "first on line 1")
    config.write_text("run:\n  seed: 1\n  dir: x\n  seed: 2\n")  # within one section too
    refused(capsys, ["train", str(config)], "line 4", "'seed'", "first on line 2")


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "-5"])
def test_a_tune_budget_that_is_not_a_positive_finite_number_is_refused(budget, capsys,
                                                                        tmp_path):
    refused(capsys, ["tune", "configs/digits.yaml", f"run.dir={tmp_path / 'run'}",
                     "--budget", budget], "--budget", "finite number of seconds > 0")
    assert not (tmp_path / "run").exists()


def test_the_preflight_refuses_a_metric_for_another_class_count_before_training(capsys,
                                                                               tmp_path):
    pytest.importorskip("torchmetrics")
    refused(capsys, ["train", "configs/digits.yaml", f"run.dir={tmp_path / 'run'}",
                     "eval.metrics.f1.spec=torchmetrics.classification.MulticlassF1Score",
                     "eval.metrics.f1.num_classes=5"],
            "eval.metrics.f1: num_classes=5, but the run has 10 classes",
            "eval.metrics.f1.num_classes=10")
    assert not (tmp_path / "run").exists()  # refused before the checks wrote doctor.json


# --- the CLI: a signal during setup ------------------------------------------------------------

class SignalsAtForward(nn.Module):
    """Sends SIGTERM to its own process at its first forward (the preflight's, under run.dir's
    lock): a scheduler stopping the job while it sets up."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)

    def forward(self, x):
        os.kill(os.getpid(), signal.SIGTERM)
        return self.fc(x.flatten(1))


def signalling_model(input_shape, num_classes):
    return SignalsAtForward(input_shape, num_classes)


class Unhandled(BaseException):
    """What this test's own SIGTERM handler raises: the CLI did not take the signal."""


def test_sigterm_during_setup_is_one_line_exit_143_and_leaves_run_dir_as_it_was(capsys,
                                                                                 tmp_path):
    def unhandled(signum, frame):
        raise Unhandled("the CLI left SIGTERM to the process's own handler")

    before = signal.signal(signal.SIGTERM, unhandled)  # instead of the default: death
    try:
        code = main(["train", "configs/digits.yaml", f"run.dir={tmp_path / 'run'}",
                     f"model.name={__name__}:signalling_model"])
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the CLI put it back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SIGTERM during setup, before the first step" in err[0], err
    assert not (tmp_path / "run").exists()  # the lock's directory and file taken back


# --- the CLI: a second run while the first builds its data -------------------------------------

SEEN: dict[str, bool] = {}


def data_that_probes_the_lock():
    """A data factory (a download, a tokenizer: seconds to minutes) that records whether
    run.dir was held while it ran, as a second process would find it, then stops the run."""
    import fcntl

    from ironloop.state.lock import LOCK_NAME

    fd = os.open(Path(SEEN["run_dir"]) / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:  # a new open file description: flock conflicts with the holder's, even in-process
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        SEEN["held"] = False
    except BlockingIOError:
        SEEN["held"] = True
    finally:
        os.close(fd)
    raise DataError("stop here: the lock was probed")


def test_run_dir_is_held_while_the_data_is_built_so_a_second_run_names_the_holder(
        capsys, tmp_path):
    # A run building its data did not hold run.dir yet: a second run on it found it free and an
    # older run there ("already holds a run") instead of naming the live one (pid, host).
    (tmp_path / "run").mkdir()
    SEEN.update(run_dir=str(tmp_path / "run"))
    refused(capsys, ["train", f"run.dir={tmp_path / 'run'}",
                     f"data.name={__name__}:data_that_probes_the_lock"], "stop here")
    assert SEEN["held"] is True
