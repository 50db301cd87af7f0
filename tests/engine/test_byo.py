"""Bring your own optimizer, scheduler, data, step and loss: from fit() and from the CLI."""

from __future__ import annotations

import math

import pytest
import torch

import ironloop
from ironloop.config import Config
from ironloop.errors import ConfigError, UserError
from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import load_verified
from tests.conftest import blobs, cfg, plateau_recorder, tiny_mlp


def _saved_optimizer(tmp_path, name="run"):
    return load_verified(tmp_path / name / "checkpoints" / "last.pt")["optimizer"]


# --- optimizer and scheduler --------------------------------------------------------------

def test_optim_betas_eps_and_kernels_from_config_reach_adamw(tmp_path):
    conf = cfg(tmp_path, train__epochs=1, optim__betas=[0.9, 0.95], optim__eps=1e-6,
               optim__foreach=False)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    groups = _saved_optimizer(tmp_path)["param_groups"]
    assert len(groups) == 2  # the built-in grouping (no decay for ndim < 2) stays the default
    assert all(tuple(g["betas"]) == (0.9, 0.95) and g["eps"] == 1e-6 and g["foreach"] is False
               for g in groups)


def test_optim_defaults_keep_torchs_adamw_and_validate():
    c = Config()
    assert c.optim.betas == [0.9, 0.999] and c.optim.eps == 1e-8
    assert c.optim.fused is None and c.optim.foreach is None
    assert Config().with_overrides(["optim.fused=true"]).optim.fused is True
    assert Config().with_overrides(["optim.fused=null"]).optim.fused is None
    with pytest.raises(ConfigError, match=r"optim.betas=.*two numbers in \[0, 1\)"):
        Config().with_overrides(["optim.betas=[0.9, 1.5]"])
    with pytest.raises(ConfigError, match="optim.fused"):
        Config().with_overrides(["optim.fused=yes please"])


def test_user_optimizer_object_is_used_as_is(tmp_path):
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ironloop.fit(model, blobs(), None, cfg(tmp_path, train__epochs=1), optimizer=opt)
    groups = _saved_optimizer(tmp_path)["param_groups"]
    assert len(groups) == 1 and tuple(groups[0]["betas"]) == (0.9, 0.95)
    assert groups[0]["weight_decay"] == 0.1 and opt.state  # it took steps


def test_user_optimizer_of_another_model_is_refused(tmp_path):
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    with pytest.raises(UserError, match="none of the model's parameters"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path), optimizer=opt)


def test_scheduler_object_bound_to_another_optimizer_is_refused(tmp_path):
    other = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 5)
    with pytest.raises(UserError, match="another optimizer"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path), scheduler=sched)


def _factories():
    opt = lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95))  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)  # noqa: E731
    return opt, sched


def test_user_optimizer_and_scheduler_factories_resume_bit_exact(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, checkpoint__every_steps=5, checkpoint__keep_last=10,
               log__every_steps=1)
    opt, sched = _factories()
    full = ironloop.fit(tiny_mlp(), blobs(), None, conf, optimizer=opt, scheduler=sched)
    lrs = [r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert lrs[:7] == [1e-2] * 3 + [5e-3] * 3 + [2.5e-3]  # StepLR stepped once per step
    model = tiny_mlp()
    opt, sched = _factories()
    step5 = tmp_path / "run" / "checkpoints" / "step-00000005.pt"
    ironloop.fit(model, blobs(), None, {**conf, "run.dir": str(tmp_path / "b")},
                 optimizer=opt, scheduler=sched, resume=str(step5))
    for k, v in full.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    a, b = _saved_optimizer(tmp_path), _saved_optimizer(tmp_path, "b")
    assert a["param_groups"][0]["lr"] == b["param_groups"][0]["lr"]
    for i, st in a["state"].items():
        assert torch.equal(st["exp_avg_sq"], b["state"][i]["exp_avg_sq"])


def test_user_plateau_scheduler_steps_per_evaluation_with_the_metric(tmp_path):
    seen = []

    Plateau = plateau_recorder(seen)

    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), cfg(tmp_path, train__epochs=3),
                 scheduler=lambda o: Plateau(o, patience=0))
    vals = [r["val_loss"] for r in read_jsonl(tmp_path / "run" / "epochs.jsonl")]
    assert seen == vals  # once per evaluation (here: per epoch), with val_loss


# --- your own data, model, step and loss from the CLI ---------------------------------------

USER_MODULE = '''
import torch
from torch import nn

VOCAB = 12


def data(root, n=256, length=6):
    """Next-token prediction on sequences that count up mod VOCAB."""
    assert root == "elsewhere"
    start = torch.arange(n) % VOCAB
    seq = (start[:, None] + torch.arange(length + 1)) % VOCAB
    ds = torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])
    return torch.utils.data.random_split(ds, [n - 64, 64], torch.Generator().manual_seed(0))


class TinyLM(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB)

    def forward(self, idx, targets=None):  # nanoGPT's signature and return value
        logits = self.head(self.emb(idx))
        loss = None if targets is None else nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten())
        return logits, loss


def lm(dim=16):  # no input_shape, no num_classes
    return TinyLM(dim)


def step(model, batch):
    _, loss = model(*batch)
    return loss, {}


def token_loss(output, target):
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def plain_lm(dim=16):
    class Plain(TinyLM):
        def forward(self, idx):
            return super().forward(idx)[0]
    return Plain(dim)
'''


def _user_module(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)  # only the CWD makes it importable


def test_cli_trains_with_user_data_model_and_step(tmp_path, monkeypatch, capsys):
    from ironloop.cli import main

    _user_module(tmp_path, monkeypatch, "byo_lm_a")
    code = main(["train", "help"])  # a config file is optional: all keys as overrides below
    assert code == 0 and "data.kwargs" in capsys.readouterr().out
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("data: {name: 'byo_lm_a:data', root: elsewhere, kwargs: {n: 320}}\n"
                        "model: {name: 'byo_lm_a:lm', kwargs: {dim: 8}}\n"
                        "train: {step_fn: 'byo_lm_a:step', epochs: 3, batch_size: 32}\n"
                        "optim: {lr: 0.05, betas: [0.9, 0.95]}\n"
                        "log: {progress: 'off'}\n")
    assert main(["train", str(cfg_file), "run.dir=r"]) == 0
    evals = read_jsonl(tmp_path / "r" / "evals.jsonl")
    assert len(evals) == 3 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    groups = _saved_optimizer(tmp_path, "r")["param_groups"]
    assert tuple(groups[0]["betas"]) == (0.9, 0.95)


def test_cli_loss_name_takes_a_user_function(tmp_path, monkeypatch):
    from ironloop.cli import main

    _user_module(tmp_path, monkeypatch, "byo_lm_b")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("log: {progress: 'off'}\n")
    assert main(["train", str(cfg_file), "data.name=byo_lm_b:data", "data.root=elsewhere",
                 "model.name=byo_lm_b:plain_lm", "loss.name=byo_lm_b:token_loss",
                 "train.epochs=1", "run.dir=r"]) == 0
    assert read_jsonl(tmp_path / "r" / "evals.jsonl")[0]["val_loss"] > 0



def test_loss_name_module_function_is_the_loss_of_the_default_classification_step(
        tmp_path, monkeypatch):
    (tmp_path / "byo_loss_c.py").write_text("def seven(output, target):\n"
                                            "    return output.sum() * 0 + 7.0\n")
    monkeypatch.chdir(tmp_path)  # only the CWD makes it importable
    ironloop.fit(tiny_mlp(), blobs(), None,
                 cfg(tmp_path, train__epochs=1, loss__name="byo_loss_c:seven"))
    assert {row["loss"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")} == {7.0}

def test_bad_specs_name_the_key(tmp_path, monkeypatch):
    from ironloop.data.builtin.datasets import build_data
    from ironloop.tools.models import build_model

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="loss.name='nope'"):
        Config().with_overrides(["loss.name=nope"])
    with pytest.raises(ConfigError, match="train.step_fn='x.y'"):
        Config().with_overrides(["train.step_fn=x.y"])
    with pytest.raises(ConfigError, match="model.name='no_such_mod:f': cannot import"):
        build_model("no_such_mod:f", (4,), 3, {})
    with pytest.raises(ConfigError, match="data.name='no_such_mod:f': cannot import"):
        build_data(Config().with_overrides(["data.name=no_such_mod:f"]).data)


def loader_data(root=None):
    """A data factory whose training split is a DataLoader over a map-style dataset."""
    d = blobs(n=64, d=5)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(d.x, d.y),
                                       batch_size=16), None


def test_a_data_factorys_dataloader_gives_the_model_factory_its_samples_input_shape():
    from ironloop.data.builtin.datasets import build_data

    spec = "data.name=tests.engine.test_byo:loader_data"
    bundle = build_data(Config().with_overrides([spec]).data)
    assert bundle.input_shape == (5,)  # read off the loader's dataset's first sample


# --- clear errors, and Hugging Face style outputs ------------------------------------------

class ReturnsTuple(torch.nn.Module):
    """nanoGPT's contract: forward(idx, targets=None) -> (logits, loss or None)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x, targets=None):
        return self.lin(x), None


def test_tuple_output_with_the_default_step_says_what_to_do(tmp_path):
    with pytest.raises(UserError, match=r"the model returned a tuple \(Tensor\[32, 3\] float32, "
                                        r"None\).*step_fn.*loss.name"):
        ironloop.fit(ReturnsTuple(), blobs(), None, cfg(tmp_path))


class DictData(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"inputs": x, "labels": y}


class HFStyle(torch.nn.Module):
    def __init__(self, as_dict):
        super().__init__()
        self.lin, self.as_dict = torch.nn.Linear(8, 3), as_dict

    def forward(self, inputs, labels):
        logits = self.lin(inputs)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if self.as_dict:
            return {"logits": logits, "loss": loss}
        return type("Output", (), {"logits": logits, "loss": loss})()


@pytest.mark.parametrize("as_dict", [True, False])
def test_hf_style_batches_and_outputs_train_with_the_default_step(tmp_path, as_dict):
    ironloop.fit(HFStyle(as_dict), DictData(blobs()), DictData(blobs()),
                 cfg(tmp_path, train__epochs=3, optim__lr=0.05))
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


class FailsAtStep3(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(8, 3), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 4:  # the first call infers the class count; then steps 1, 2, 3
            raise ValueError("the user's own bug")
        return self.lin(x)


def test_an_error_in_the_users_forward_keeps_its_traceback_and_gains_context(tmp_path):
    with pytest.raises(ValueError, match="the user's own bug") as info:
        ironloop.fit(FailsAtStep3(), blobs(), None, cfg(tmp_path))
    assert info.value.__notes__ == [
        "ironloop: raised in training at step 3, epoch 1; "
        "batch: a tuple (Tensor[32, 8] float32, Tensor[32] int64)"]
    assert info.traceback[-1].name == "forward"  # the user's frame is still the last one


def test_docs_byo_example_runs(tmp_path, monkeypatch):
    import re

    from tests.conftest import REPO

    text = (REPO / "docs" / "how-to" / "bring-your-own.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/how-to/bring-your-own.md", "exec"), {})  # noqa: S102 - our docs
    run = tmp_path / "runs" / "readme-lm"
    evals = read_jsonl(run / "evals.jsonl")
    assert [e["step"] for e in evals] == [40, 80, 120] and evals[-1]["val_loss"] < 1.0
    assert evals[-1]["val_ppl"] < 3  # exp of the token-weighted val_loss, not a mean of exps
    assert abs(evals[-1]["val_ppl"] - math.exp(evals[-1]["val_loss"])) < 1e-6
    lrs = [r["lr"] for r in read_jsonl(run / "scalars.jsonl")]  # the callback, per evaluation
    assert len(lrs) == 3 and lrs[0] > lrs[-1]


def test_a_data_factory_that_takes_rank_and_world_size_gets_torchruns(tmp_path, monkeypatch):
    from ironloop.config import DataConfig
    from ironloop.data.user import user_data

    (tmp_path / "byo_where.py").write_text(
        "import torch\n"
        "def data(rank, world_size):\n"
        "    return {'train': (torch.zeros(2, 3), torch.zeros(2)), 'val': None,\n"
        "            'seen': (rank, world_size)}\n")
    monkeypatch.chdir(tmp_path)  # only the CWD makes it importable
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert user_data(DataConfig(name="byo_where:data")).meta["seen"] == (2, 3)
