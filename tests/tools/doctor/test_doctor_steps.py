"""The doctor runs every check through the run's step, never the model's forward directly: an
RNN whose forward needs (x, hidden), a model returning (logits, loss) and a Hugging Face-style
model returning an output object are all checked, and a check that cannot run is counted as
skipped, with its reason, never as passed and never as a crash."""

from __future__ import annotations

import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ironloop.config import Config
from ironloop.data.loader import TensorData
from ironloop.tools.doctor.run import check, outcomes, subject
from tests.conftest import REPO

V, T = 12, 6


def tokens(n: int, seed: int = 0) -> TensorData:
    """Sequences that count up mod V: learnable, so the overfit check can pass."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, V, (n, 1), generator=g)
    seq = (start + torch.arange(T + 1)) % V
    return TensorData(seq[:, :-1], seq[:, 1:])


def config(**over) -> Config:
    base = {"train.batch_size": 16, "optim.lr": 3e-2, "run.dir": "unused",
            "doctor.overfit_steps": 60}
    return Config().with_overrides({**base, **{k.replace("__", "."): v for k, v in over.items()}})


class RNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.rnn, self.head = nn.Embedding(V, 16), nn.GRU(16, 32, batch_first=True), \
            nn.Linear(32, V)

    def forward(self, x, hidden):  # the hidden state is required, as in word_language_model
        out, hidden = self.rnn(self.embed(x), hidden)
        return self.head(out), hidden


def rnn_step(model, batch, state):
    x, y = batch
    logits, state["h"] = model(x, state.get("h"))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()), {}, y.numel()


class LogitsAndLoss(nn.Module):  # nanoGPT's contract
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, 32), nn.Linear(32, V)

    def forward(self, idx, targets):
        logits = self.head(self.embed(idx))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tuple_step(model, batch):
    _, loss = model(*batch)
    return loss, {}


class HFStyle(nn.Module):
    """model(**batch) -> an object with .loss and .logits, as transformers' causal LMs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, 32), nn.Linear(32, V)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss, logits=logits)


class Dicts(Dataset):
    def __init__(self, data: TensorData):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data.x[i], "labels": self.data.y[i]}


MODEL_CHECKS = ("initial_loss", "overfit_batch", "dead_parameters", "input_bound")


def assert_model_checks_ran(findings):
    got = outcomes(findings)
    for name in MODEL_CHECKS:
        # input_bound times the loader against the step: its verdict depends on the machine's
        # load, but it ran through the step (a check that raised would read "skipped").
        ran = ("passed", "warning") if name == "input_bound" else ("passed",)
        assert got.get(name) in ran, (name, [f.render() for f in findings])


def test_an_rnn_whose_forward_needs_hidden_is_checked_through_its_step():
    found = check(subject(RNN(), tokens(128), tokens(32, seed=1), None, config(),
                          step_fn=rnn_step))
    assert_model_checks_ran(found)
    assert outcomes(found)["probabilities"] == "skipped"  # it reads raw outputs: needs no step


def test_an_rnn_without_its_step_is_an_error_finding_and_stops_the_preflight():
    # The default step calls model(x): the run itself would die at step 1 on the missing
    # `hidden`, so the doctor says so as an error, and the preflight raises it (issue 36).
    s = subject(RNN(), tokens(128), tokens(32, seed=1), None, config())
    found = check(s)
    got = outcomes(found)
    assert got["step"] == "error", got
    assert not any(name in got for name in MODEL_CHECKS), got  # they would only repeat it
    step = next(f.measured for f in found if f.check == "step")
    assert "missing 1 required positional argument: 'hidden'" in step
    with pytest.raises(TypeError, match="hidden"):
        check(s, raise_step=True)


def test_a_model_returning_logits_and_loss_is_checked_through_its_step():
    found = check(subject(LogitsAndLoss(), tokens(128), tokens(32, seed=1), None, config(),
                          step_fn=tuple_step))
    assert_model_checks_ran(found)


def test_a_hugging_face_style_model_is_checked_through_the_default_step():
    found = check(subject(HFStyle(), Dicts(tokens(128)), Dicts(tokens(32, seed=1)), None,
                          config()))
    assert_model_checks_ran(found)


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, 32), nn.Linear(32, V)

    def forward(self, idx):
        return self.head(self.embed(idx))


def test_the_built_in_lm_step_is_what_the_doctor_runs_with_train_step_fn_lm():
    found = check(subject(Bigram(), tokens(128), tokens(32, seed=1), None,
                          config(train__step_fn="lm")))
    assert_model_checks_ran(found)



def test_a_language_model_that_diverges_on_one_batch_is_an_overfit_batch_error():
    from ironloop.tools.doctor.model_checks import check_overfit_batch

    hot = config(train__step_fn="lm", optim__name="sgd", optim__lr=1e4, clip__max_norm=0.0)
    s = subject(Bigram(), tokens(64), None, None, hot)
    (f,) = check_overfit_batch(s, s.batch(), steps=20)
    assert (f.check, f.severity) == ("overfit_batch", "error") and "diverged" in f.measured

RNN_PKG = '''
import torch
from torch import nn
from torch.nn import functional as F
from ironloop.data.lm import ContiguousStreams

def data(root, streams=4, bptt=5):
    seq = torch.arange(2000) % 11
    return {"train": ContiguousStreams(seq[:1600], streams, bptt),
            "val": ContiguousStreams(seq[1600:], streams, bptt), "vocab_size": 11}

class RNN(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab_size, 8), nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, vocab_size)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.embed(x), hidden)
        return self.head(out), hidden

def model(vocab_size):
    return RNN(vocab_size)

def step(model, batch, state):
    x, y = batch
    logits, state["h"] = model(x, state.get("h"))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()), {}, y.numel()
'''


def test_train_and_doctor_cli_with_an_rnn_never_crash(tmp_path, monkeypatch, capsys):
    """The reported crash: the preflight's class-count inference called model(x) on an RNN.
    Here the data factory also hands the model factory its vocab_size."""
    from ironloop.cli import main

    (tmp_path / "rnn_pkg.py").write_text(textwrap.dedent(RNN_PKG))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(REPO)
    common = ["data.name=rnn_pkg:data", "model.name=rnn_pkg:model",
              "train.step_fn=rnn_pkg:step", "data.shuffle=false", "train.batch_size=4",
              "train.max_steps=6", "log.progress=off", f"run.dir={tmp_path / 'run'}",
              "early_stop.metric=val_loss"]  # digits.yaml monitors val_acc: no accuracy here
    assert main(["train", "configs/digits.yaml", *common]) == 0
    out = capsys.readouterr().out
    assert "skipped: probabilities" in out and "Traceback" not in out, out
    assert main(["doctor", "configs/digits.yaml", *common, "--overwrite"]) == 0
    assert "overfit_batch" in capsys.readouterr().out


def test_threads_times_processes_over_the_cores_is_flagged(monkeypatch):
    from ironloop.tools.doctor import env_checks

    monkeypatch.setattr(env_checks, "cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert env_checks.check_threads()[0].severity == "info"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    (f,) = env_checks.check_threads()
    assert f.severity == "warning" and "2 torch thread(s) (torch's default) x 4 process(es) " \
        "on 2 core(s)" in f.measured and "run.threads=1" in f.fix


def test_the_threads_check_reads_the_run_s_threads_and_workers(monkeypatch):
    from ironloop.config import Config
    from ironloop.tools.doctor import env_checks

    monkeypatch.setattr(env_checks, "cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cpu = Config().with_overrides({"run.device": "cpu"})
    (f,) = env_checks.check_threads(cpu.with_overrides({"data.num_workers": 2}))
    assert "run.threads=1" in f.fix and "2 DataLoader worker(s)" in f.measured
    # the run already sets the threads that leave the workers their cores: nothing to advise
    (f,) = env_checks.check_threads(cpu.with_overrides({"data.num_workers": 2,
                                                        "run.threads": 1}))
    assert f.severity == "info" and not f.fix and "(run.threads)" in f.measured
    (f,) = env_checks.check_threads(cpu.with_overrides({"run.threads": 4}))
    assert f.severity == "warning" and "run.threads=2" in f.fix


def test_the_input_bound_fix_names_only_the_steps_still_open(monkeypatch):
    """The doctor's loader fix checks the run's workers, threads and pinning before it
    recommends them (the step-time advice's rule, tests/engine/test_timing.py)."""
    from types import SimpleNamespace

    from ironloop.config import Config
    from ironloop.tools.doctor import data_checks

    monkeypatch.setattr(data_checks, "cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def fix(device, **keys):
        s = SimpleNamespace(cfg=Config().with_overrides(keys), device=device)
        return data_checks.loader_fix(s, load=0.1, step=0.01)

    first = fix(cpu)
    assert "set data.num_workers=2" in first and "run.threads=1 (now 2" in first
    done = fix(cpu, **{"data.num_workers": 2, "run.threads": 1})
    assert "already have the 2 cores" in done and "=" not in done.split(";")[0], done
    assert "data.pin_memory=true" in fix(cuda, **{"data.pin_memory": False})
    assert "pin_memory" not in fix(cuda, **{"data.pin_memory": True})


class Loud(LogitsAndLoss):
    """The LM with a last layer initialised 30x too large: confidently wrong at step 0."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.head.weight.mul_(30)


@pytest.mark.parametrize("step", ["lm", "perplexity"])
def test_a_language_models_initial_loss_is_judged_against_log_vocab(step):
    """Issue 44: the doctor had no reference for an LM; log(vocab) is known (the last layer's
    width), for the LM step or a user step whose loss is a per-token NLL (eval.perplexity)."""
    kwargs = ({"cfg": config(train__step_fn="lm")} if step == "lm" else
              {"cfg": config(eval__perplexity=True), "step_fn": tuple_step})
    found = {f.check: f for f in check(subject(LogitsAndLoss(), tokens(64), None, **kwargs),
                                       quick=True)}
    assert f"expected about {math.log(V):.4f} = log({V})" in found["initial_loss"].measured
    assert found["initial_loss"].severity == "info"
    loud = {f.check: f for f in check(subject(Loud(), tokens(64), None, **kwargs), quick=True)}
    assert loud["initial_loss"].severity == "warning", loud["initial_loss"].render()
