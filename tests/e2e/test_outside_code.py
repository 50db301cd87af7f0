"""Outside code runs right the first time (issue 36): what nanoGPT, word_language_model, an HF
GPT-2 and an LBFGS script hit, one test per case. The models and data factories are in
tests/outside_models.py (a nanoGPT-style GPT written here, word_language_model-style streams)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ironloop
from examples import tbptt_lstm as ex
from ironloop.config import Config
from ironloop.data.lm import ContiguousStreams
from ironloop.data.loader import EvalSampler
from ironloop.errors import ConfigError
from ironloop.outputs.numbers import number
from ironloop.outputs.readers import read_jsonl
from ironloop.tools.doctor.run import check, outcomes, subject
from ironloop.tools.recipe import train_config
from tests import outside_models as om
from tests.conftest import REPO, blobs, cfg, tiny_mlp

# --- 1. evaluation batches a val DataLoader as it says ------------------------------------------

def _word_lm_fit(tmp_path, val, **extra):
    ids, vocab = om.text_tokens()
    cut = int(len(ids) * 0.7)
    torch.manual_seed(0)
    model = ex.model(vocab, dim=8, hidden=12)
    conf = cfg(tmp_path, train__epochs=1, train__batch_size=4, data__shuffle=False,
               optim__name="sgd", optim__lr=0.5, **extra)
    result = ironloop.fit(model, ContiguousStreams(ids[:cut], 4, 7), val, conf, step_fn=ex.step)
    return model, result, ids[cut:]


def test_a_val_dataloader_is_evaluated_in_its_own_batch_size_and_streams(tmp_path):
    # word_language_model: training in 4 streams, validation built for 10 (eval_batch_size).
    # train.batch_size=4 over 10 streams mixed chunks (and crashed on the short last one).
    ids, _ = om.text_tokens()
    val_tokens = ids[int(len(ids) * 0.7):]
    model, _, _ = _word_lm_fit(tmp_path, DataLoader(ContiguousStreams(val_tokens, 10, 7),
                                                    batch_size=10))
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert evals[-1]["val_loss"] == pytest.approx(ex.plain_evaluate(model, val_tokens, 10, 7),
                                                  rel=1e-6)


def test_val_streams_that_the_evaluation_batch_cannot_fit_are_refused_before_training(tmp_path):
    ids, _ = om.text_tokens()
    val = ContiguousStreams(ids[int(len(ids) * 0.7):], 10, 7)  # a plain dataset: batch 4
    with pytest.raises(ConfigError, match=r"val_data has 10 streams but evaluates in batches "
                                          r"of 4 .*DataLoader\(val, batch_size=10\)"):
        _word_lm_fit(tmp_path, val)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained
    with pytest.raises(ConfigError, match="batches of 5 \\(its DataLoader's"):
        _word_lm_fit(tmp_path, DataLoader(val, batch_size=5))


def test_a_val_dataloader_keeps_its_collate_fn_and_drop_last(tmp_path):
    x, y = blobs(n=10, seed=1).x, blobs(n=10, seed=1).y
    seen: list[int] = []

    def collate(samples):  # the val loader's own: records each batch it makes
        seen.append(len(samples))
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    val = DataLoader(TensorDataset(x, y), batch_size=4, drop_last=True, collate_fn=collate)
    model = tiny_mlp()
    ironloop.fit(model, blobs(), val, cfg(tmp_path, train__epochs=1))
    assert seen == [4, 4]  # 10 samples, batch 4, drop_last: two batches, not three
    with torch.no_grad():
        want = F.cross_entropy(model(x[:8]), y[:8]).item()
    assert read_jsonl(tmp_path / "run" / "evals.jsonl")[-1]["val_loss"] == \
        pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_val_sample_is_counted_once_over_ranks_with_a_loaders_batching(drop_last):
    shards = [list(EvalSampler(23, 4, 0, False, rank=r, world_size=2, drop_last=drop_last))
              for r in range(2)]
    seen = sorted(i for shard in shards for batch in shard for i in batch)
    assert seen == list(range(16 if drop_last else 23))
    if drop_last:
        assert all(len(b) == 4 for shard in shards for b in shard)


def cli_main(capsys, monkeypatch, *argv: str) -> tuple[int, str]:
    """``ironloop ARGV`` as `python -m ironloop` runs it (the CLI's main), in this process from
    the repository (the subprocesses' cwd) with one intra-op thread (their OMP_NUM_THREADS=1):
    its exit code and its stderr, without an interpreter's and torch's start-up (issue 45)."""
    from ironloop.cli import main

    monkeypatch.chdir(REPO)
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(list(argv))
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def _cli(capsys, monkeypatch, run_dir, *extra):
    return cli_main(capsys, monkeypatch, "train", "data.name=tests.outside_models:word_lm",
                    "model.name=examples.tbptt_lstm:model", "model.kwargs={dim: 8, hidden: 12}",
                    "train.step_fn=examples.tbptt_lstm:step", "train.batch_size=4",
                    "data.shuffle=false", "train.epochs=1", "optim.name=sgd", "optim.lr=0.5",
                    "eval.perplexity=true", "log.progress=off", f"run.dir={run_dir}", *extra)


def test_the_cli_word_lm_with_its_own_val_batch_trains_and_a_wrong_one_stops_at_once(
        tmp_path, capsys, monkeypatch):
    code, err = _cli(capsys, monkeypatch, tmp_path / "good")
    assert code == 0, err
    assert read_jsonl(tmp_path / "good" / "evals.jsonl")[-1]["val_ppl"] > 1
    code, err = _cli(capsys, monkeypatch, tmp_path / "bad", "data.kwargs={val_batch: 5}")
    assert code == 2, err
    assert "val_data has 10 streams but evaluates in batches of 5" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()  # refused before any step


# --- 2. the LM step and forward(idx, targets) ---------------------------------------------------

def test_the_lm_step_uses_a_forward_idx_targets_models_own_loss(tmp_path):
    data = om.chars()
    model = om.gpt(data["vocab_size"])
    x, y = (torch.stack(t) for t in zip(*[data["train"][i] for i in range(8)]))
    with torch.no_grad():
        first = model(x, y)[1].item()
    ironloop.fit(model, data["train"], data["val"],
                 cfg(tmp_path, train__step_fn="lm", train__max_steps=2, train__batch_size=8,
                     data__shuffle=False))
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["loss"] == \
        pytest.approx(first, rel=1e-5)


def test_the_cli_nanogpt_run_trains_with_the_preflight_passing(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "gpt"
    code, err = cli_main(capsys, monkeypatch, "train", "data.name=tests.outside_models:chars",
                         "model.name=tests.outside_models:gpt", "train.step_fn=lm",
                         "train.batch_size=8", "train.max_steps=6", "eval.every_steps=3",
                         "log.progress=off", f"run.dir={run_dir}")
    assert code == 0, err
    doctor = {f["check"]: f for f in json.loads((run_dir / "doctor.json").read_text())["findings"]}
    assert doctor["overfit_batch"]["severity"] == "info", doctor["overfit_batch"]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["final_val_ppl"] > 1 and results["steps"] == 6


def _train(tmp_path, data: str, model: str):
    """What `ironloop train` does (the preflight, then fit), in this process."""
    conf = Config().with_overrides({"data.name": data, "model.name": model,
                                    "train.step_fn": "lm", "train.batch_size": 8,
                                    "train.epochs": 1, "log.progress": "off",
                                    "run.dir": str(tmp_path / "run")})
    return train_config(conf)


def test_a_preflight_whose_step_raises_stops_the_run_with_that_error(tmp_path):
    # forward(idx) returning last-position logits: the LM step's loss cannot take them.
    with pytest.raises(ValueError, match="Expected input batch_size") as e:
        _train(tmp_path, "tests.outside_models:chars", "tests.outside_models:last_logits")
    assert any("raised in the preflight, running the run's step on the first training batch"
               in note for note in e.value.__notes__)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained


def test_a_validation_batch_that_cannot_be_made_stops_the_run_in_the_preflight(tmp_path):
    # The crash that came after a whole epoch now comes before the first step.
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size") as e:
        _train(tmp_path, "tests.outside_models:ragged_val", "tests.outside_models:gpt")
    assert any("on the first validation batch" in note for note in e.value.__notes__)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- 3. closure optimizers ---------------------------------------------------------------------

def _equals_plain_lbfgs(ours, plain, data) -> None:
    """``plain`` trained by time_sequence_prediction's loop (3 full-batch LBFGS steps, lr 0.5,
    max_iter 4) ends torch.equal to ``ours``."""
    opt = torch.optim.LBFGS(plain.parameters(), lr=0.5, max_iter=4)
    for _ in range(3):
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(plain(data.x), data.y)
            loss.backward()
            return loss
        opt.step(closure)
    for (name, a), b in zip(ours.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_lbfgs_trains_with_its_closure_equal_to_the_plain_torch_loop(tmp_path):
    data = blobs(n=64)
    ours, plain = tiny_mlp(), tiny_mlp()
    ironloop.fit(ours, data, None, cfg(tmp_path, train__epochs=3, train__batch_size=64,
                                       data__shuffle=False, clip__max_norm=0.0),
                 optimizer=lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4))
    _equals_plain_lbfgs(ours, plain, data)


def test_lbfgs_by_name_from_the_config_equals_the_plain_torch_loop(tmp_path):
    """optim.name=LBFGS (any torch.optim class by name) with optim.args: what a config-only
    tool (ironloop train, doctor --resume-check, tune) can reach, not only fit(optimizer=)."""
    data = blobs(n=64)
    ours, plain = tiny_mlp(), tiny_mlp()
    ironloop.fit(ours, data, None, cfg(tmp_path, train__epochs=3, train__batch_size=64,
                                       data__shuffle=False, clip__max_norm=0.0,
                                       optim__name="LBFGS", optim__lr=0.5,
                                       optim__args={"max_iter": 4}))
    _equals_plain_lbfgs(ours, plain, data)


def test_lbfgs_with_accumulation_is_refused_at_build_time_saying_why(tmp_path):
    with pytest.raises(ConfigError, match="LBFGS takes a closure .*accumulation_steps=1"):
        ironloop.fit(tiny_mlp(), blobs(), None, cfg(tmp_path, train__accumulation_steps=2),
                     optimizer=lambda p: torch.optim.LBFGS(p))


def test_lbfgs_with_a_stateful_step_is_refused_at_build_time_saying_why(tmp_path):
    # a TBPTT step carries its hidden state: each closure call would move it again
    ids, vocab = om.text_tokens()
    with pytest.raises(ConfigError, match="LBFGS takes a closure .*a stateful step"):
        ironloop.fit(ex.model(vocab, dim=8, hidden=12), ContiguousStreams(ids, 4, 7), None,
                     cfg(tmp_path, train__batch_size=4, data__shuffle=False),
                     step_fn=ex.step, optimizer=lambda p: torch.optim.LBFGS(p))


# --- 4. the doctor on language models ----------------------------------------------------------

def test_the_overfit_check_judges_a_language_model_against_its_unigram_entropy():
    data = om.chars()
    conf = Config().with_overrides({"train.step_fn": "lm", "train.batch_size": 16})
    learns = check(subject(om.gpt(data["vocab_size"]), data["train"], data["val"], None, conf))
    assert outcomes(learns)["overfit_batch"] == "passed"
    frozen = conf.with_overrides({"optim.lr": 1e-9})  # a model that cannot learn still warns
    stuck = check(subject(om.gpt(data["vocab_size"]), data["train"], data["val"], None, frozen))
    assert outcomes(stuck)["overfit_batch"] == "warning"


class Dicts(torch.utils.data.Dataset):
    """Hugging Face-style dict samples: input_ids, attention_mask, labels."""

    def __init__(self, blocks, nan_at: int | None = None):
        self.blocks, self.nan_at = blocks, nan_at

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        x, _ = self.blocks[i]
        mask = torch.ones(len(x))
        if i == self.nan_at:
            mask[0] = float("nan")
        return {"input_ids": x, "attention_mask": mask, "labels": x}


def test_finite_inputs_and_leakage_read_dict_samples():
    data = om.chars()
    train = Dicts(data["train"], nan_at=3)
    val = Dicts(torch.utils.data.Subset(data["train"], [0, 1]))  # two train samples again
    found = check(subject(tiny_mlp(), train, val, None, Config()))
    got = {f.check: f for f in found if f.check in ("finite_inputs", "leakage")}
    assert got["finite_inputs"].severity == "error" and "[3]" in got["finite_inputs"].measured
    assert got["leakage"].severity == "error" and "2 of 2 val" in got["leakage"].measured


# --- 5. the progress line ----------------------------------------------------------------------

def test_the_plain_progress_line_shows_its_own_steps_loss_and_lr(tmp_path, capsys):
    ironloop.fit(tiny_mlp(), blobs(), None,
                 cfg(tmp_path, train__epochs=2, train__batch_size=20, log__every_steps=5,
                     log__progress="auto", log__progress_every_steps=5,
                     log__progress_every_s=0, schedule__name="onecycle"))
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert len(lines) >= 3
    for line in lines:
        step = int(line.split()[1].split("/")[0])
        # the console's own number format: 4 significant figures (outputs/numbers.py)
        assert f"loss {number(rows[step]['loss'])}" in line
        assert f"lr {number(rows[step]['lr'])}" in line


# --- 6. a resumed LM run with an unchanged config ----------------------------------------------

def test_an_lm_run_resumed_with_its_config_unchanged_says_so(tmp_path, capsys):
    data = om.chars()
    conf = cfg(tmp_path, train__step_fn="lm", train__max_steps=3, train__batch_size=8)
    ironloop.fit(om.gpt(data["vocab_size"]), data["train"], data["val"], conf)
    capsys.readouterr()
    ironloop.fit(om.gpt(data["vocab_size"]), data["train"], data["val"], conf, resume=True)
    out = capsys.readouterr().out
    assert "config unchanged" in out and "eval.perplexity" not in out, out


# --- 7. results.json and events.jsonl count epochs as the console does -------------------------

def test_a_run_that_max_steps_ends_mid_epoch_counts_its_epoch_and_seconds(tmp_path):
    conf = cfg(tmp_path, train__epochs=2, train__max_steps=3, checkpoint__every_steps=1)
    first = ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), conf)  # 7 steps an epoch
    assert first.results["epochs"] == 1 and first.results["seconds"] > 0
    assert first.results["seconds"] >= first.results["train_seconds"]
    ironloop.fit(tiny_mlp(), blobs(), blobs(n=64, seed=1), {**conf, "train.max_steps": 5},
                 resume=True, allow_config_change=True)
    resume = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")
              if e["event"] == "resume"][-1]
    assert resume["epoch"] == 1  # "resumed ... (epoch 1, 3/7 steps into it)"


# --- 8. optim.lr=0, and the demo's threads -----------------------------------------------------

def test_optim_lr_0_on_resume_freezes_the_weights(tmp_path):
    conf = cfg(tmp_path, train__epochs=1, schedule__name="onecycle")
    model = tiny_mlp()
    ironloop.fit(model, blobs(), blobs(n=64, seed=1), conf)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    again = ironloop.fit(model, blobs(), blobs(n=64, seed=1),
                         {**conf, "train.epochs": 2, "optim.lr": 0.0}, resume=True,
                         allow_config_change=True)  # the epochs: the LR alone needs no flag
    assert again.results["steps"] == 14
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")[7:]} == {0.0}


def test_optim_lr_0_alone_resumes_without_allow_config_change(tmp_path, capsys):
    conf = cfg(tmp_path, train__epochs=1)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "optim.lr": 0}, resume=True)
    assert "optim.lr: 0.001 -> 0.0 (every step from here runs at LR 0" in capsys.readouterr().out


def test_the_demo_runs_with_one_thread_per_process(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("demo", "_env"):
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    (repo / "pyproject.toml").write_text("")
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("#!/bin/sh\nexit 0\n")  # every import check passes
    (bin_dir / "ironloop").write_text('#!/bin/sh\necho "$OMP_NUM_THREADS" >> threads.txt\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (repo / ".venv" / ".ironloop-installed").touch()
    os.utime(repo / "pyproject.toml", (0, 0))  # older than the install stamp
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(["bash", str(repo / "scripts" / "demo")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (repo / "threads.txt").read_text().split() == ["1", "1"]  # train, then report


def test_the_docs_document_the_outside_code_cases():
    text = "".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    assert re.search(r"LBFGS", text) and "forward(idx, targets" in text
