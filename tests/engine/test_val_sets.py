"""Several validation sets (``fit(..., val_data={"name": ds})`` or a data factory's dict): each
set's metrics under its name, averaged weights included, any of them monitored."""

from __future__ import annotations

import pytest

import ironloop
from ironloop.errors import ConfigError, UserError
from ironloop.outputs.readers import read_jsonl
from tests.conftest import blobs, cfg, run_cli, tiny_mlp


def test_two_validation_sets_are_logged_under_their_names(tmp_path, capsys):
    clean, noisy = blobs(60, seed=1), blobs(40, seed=2)
    both = ironloop.fit(tiny_mlp(), blobs(200), {"clean": clean, "noisy": noisy},
                        cfg(tmp_path / "both", average__kind="ema", average__decay=0.9))
    out = capsys.readouterr().out
    alone = {name: ironloop.fit(tiny_mlp(), blobs(200), ds,
                                cfg(tmp_path / name, average__kind="ema", average__decay=0.9))
             for name, ds in (("clean", clean), ("noisy", noisy))}
    rows = read_jsonl(tmp_path / "both" / "run" / "evals.jsonl")
    assert len(rows) == 2
    for name, result in alone.items():  # the same training: each set's figures as if alone
        single = read_jsonl(result.run_dir / "evals.jsonl")
        for row, one in zip(rows, single):
            for metric in ("loss", "acc"):
                assert row[f"val_{name}_{metric}"] == one[f"val_{metric}"]
                assert row[f"val_avg_{name}_{metric}"] == one[f"val_avg_{metric}"]
    assert not {"val_loss", "val_acc"} & rows[0].keys()
    epochs = read_jsonl(tmp_path / "both" / "run" / "epochs.jsonl")
    assert epochs[-1]["val_noisy_acc"] == rows[-1]["val_noisy_acc"]
    assert f"val_noisy_acc {100 * rows[-1]['val_noisy_acc']:.2f}%" in out  # the epoch line
    # the default early_stop.metric (val_loss) is the first set's loss
    assert both.results["monitor"] == {"val_clean_loss": min(r["val_clean_loss"] for r in rows)}


def test_any_sets_metric_can_be_monitored(tmp_path):
    result = ironloop.fit(tiny_mlp(), blobs(200), {"a": blobs(40, seed=1), "b": blobs(40, seed=2)},
                          cfg(tmp_path, early_stop__metric="val_b_acc", early_stop__patience=5))
    rows = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert result.results["monitor"] == {"val_b_acc": max(r["val_b_acc"] for r in rows)}
    with pytest.raises(ConfigError, match="val_a_loss, val_a_acc, val_b_loss, val_b_acc"):
        ironloop.fit(tiny_mlp(), blobs(100), {"a": blobs(40, seed=1), "b": blobs(40, seed=2)},
                     cfg(tmp_path / "x", early_stop__metric="val_c_acc"), overwrite=True)


@pytest.mark.parametrize("name", ["avg", "a b", ""])
def test_a_set_name_that_cannot_name_metrics_is_refused(tmp_path, name):
    with pytest.raises(UserError, match=f"the set name {name!r} cannot name metrics"):
        ironloop.fit(tiny_mlp(), blobs(100), {name: blobs(40, seed=1)}, cfg(tmp_path))


FACTORY = """
import torch
from torch.utils.data import TensorDataset

def blobs(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(torch.randn(n, 8, generator=g) + y[:, None].float(), y)

def data(root=None):
    return {"train": blobs(128, 0), "val": {"clean": blobs(32, 1), "noisy": blobs(32, 2)},
            "num_classes": 3}
"""


def test_a_data_factory_returns_named_validation_sets(tmp_path):
    (tmp_path / "twoval.py").write_text(FACTORY)
    res = run_cli("train", "data.name=twoval:data", "model.name=mlp", "train.epochs=1",
                  f"run.dir={tmp_path / 'run'}", "log.progress=off",
                  env={"PYTHONPATH": f"{tmp_path}:{ironloop.__path__[0]}/.."})
    assert res.returncode == 0, res.stderr
    row = read_jsonl(tmp_path / "run" / "evals.jsonl")[0]
    assert {"val_clean_loss", "val_clean_acc", "val_noisy_loss", "val_noisy_acc"} <= row.keys()
