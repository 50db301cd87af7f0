"""Whole-split metrics (engine/metrics.py): an F1 over a split equals scikit-learn's f1_score
on the same predictions, in one process and over 2 gloo ranks; from fit(metrics=...), from
eval.metrics specs, fed by a custom step, and monitored by early stopping.

Then engine/metrics.py's spec reading, in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from sklearn.metrics import f1_score
from torch.nn import functional as F
from torchmetrics.classification import MulticlassF1Score

import ironloop
from ironloop.config import load_config
from ironloop.engine import metrics
from ironloop.errors import ConfigError, UserError
from ironloop.outputs.readers import read_jsonl
from ironloop.state.io import load_verified
from ironloop.tools.models import from_config
from tests.conftest import REPO, blobs, cfg, tiny_mlp

F1 = {"spec": "torchmetrics.classification.MulticlassF1Score", "num_classes": 3,
      "average": "macro"}


def sklearn_f1(model, val, average="macro") -> float:
    with torch.no_grad():
        preds = model(val.x).argmax(-1)
    return f1_score(val.y.numpy(), preds.numpy(), average=average)


def test_f1_over_a_split_equals_sklearns(tmp_path):
    """61 samples in batches of 32 and 29: the F1 of the split, not a mean of batch F1s."""
    val, test = blobs(61, seed=1), blobs(45, seed=2)
    result = ironloop.fit(tiny_mlp(), blobs(200), val,
                          cfg(tmp_path, eval__metrics={"f1m": F1}, early_stop__metric="val_f1"),
                          test_data=test, metrics={"f1": MulticlassF1Score(3, average="macro")})
    best = tiny_mlp()  # the test split is measured on the best weights (best.pt)
    best.load_state_dict(load_verified(tmp_path / "run/checkpoints/best.pt")["model"])
    assert result.results["test_weights"] == "best"
    assert result.results["test_f1"] == pytest.approx(sklearn_f1(best, test), abs=1e-6)
    last = read_jsonl(tmp_path / "run" / "evals.jsonl")[-1]
    want = sklearn_f1(result.model, val)
    assert last["val_f1"] == pytest.approx(want, abs=1e-6)
    assert last["val_f1m"] == last["val_f1"]  # the config's spec builds the same metric
    rows = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert result.results["monitor"] == {"val_f1": max(r["val_f1"] for r in rows)}
    with torch.no_grad():  # what the split's F1 is not: a mean over its batches
        batches = [(val.x[i:i + 32], val.y[i:i + 32]) for i in (0, 32)]
        per_batch = [f1_score(y.numpy(), result.model(x).argmax(-1).numpy(), average="macro")
                     for x, y in batches]
    assert abs(sum(per_batch) / 2 - want) > 1e-4


def step_with_inputs(model, batch):
    """A custom step: it says what the metrics get (here the probabilities)."""
    x, y = batch
    out = model(x)
    loss = F.cross_entropy(out, y)
    if model.training:
        return loss, {}
    return loss, {"metric_inputs": (out.softmax(-1), y)}


def test_a_custom_step_feeds_the_metrics(tmp_path):
    val = blobs(61, seed=1)
    result = ironloop.fit(tiny_mlp(), blobs(200), val, cfg(tmp_path, train__epochs=1),
                          step_fn=step_with_inputs,
                          metrics={"f1": MulticlassF1Score(3, average="micro")})
    last = read_jsonl(tmp_path / "run" / "evals.jsonl")[-1]
    assert last["val_f1"] == pytest.approx(sklearn_f1(result.model, val, "micro"), abs=1e-6)
    assert "val_metric_inputs" not in last


def test_a_step_that_feeds_nothing_gets_a_one_line_error(tmp_path):
    def plain(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1]), {}

    with pytest.raises(UserError, match="return {'metric_inputs': \\(preds, target\\)"):
        ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1), cfg(tmp_path, train__epochs=1),
                     step_fn=plain, metrics={"f1": MulticlassF1Score(3)})


def test_bad_metric_specs_and_names_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="eval.metrics.f1=.*must be a mapping with spec"):
        load_config(None, ["eval.metrics={f1: MulticlassF1Score}"])
    with pytest.raises(ConfigError, match="eval.metrics.f1.spec=.*cannot import module"):
        ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1),
                     cfg(tmp_path, eval__metrics={"f1": {"spec": "no_such_pkg.F1"}}))
    # torchmetrics is installed: a misspelled class is named, not answered with "pip install"
    with pytest.raises(ConfigError, match="has no callable 'MulticlassF2Score'"):
        typo = {**F1, "spec": "torchmetrics.classification.MulticlassF2Score"}
        ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1),
                     cfg(tmp_path / "d", eval__metrics={"f1": typo}))
    with pytest.raises(ConfigError, match="eval.metrics.f1: .*MulticlassF1Score.* failed"):
        ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1),
                     cfg(tmp_path / "a", eval__metrics={"f1": {**F1, "num_classes": "x"}}))
    with pytest.raises(UserError, match="the name 'acc' cannot be used"):
        ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1), cfg(tmp_path / "b"),
                     metrics={"acc": MulticlassF1Score(3)})
    with pytest.raises(UserError, match="has no update"):
        ironloop.fit(tiny_mlp(), blobs(100), blobs(40, seed=1), cfg(tmp_path / "c"),
                     metrics={"f1": f1_score})


@pytest.mark.slow
def test_f1_over_2_gloo_ranks_equals_sklearns_on_the_whole_split(tmp_path):
    """digits' 359 validation samples over 2 ranks (180 + 179): every sample counted once."""
    run_dir = tmp_path / "run"
    overrides = ["model.name=mlp", "train.epochs=1", "log.progress=off",
                 "doctor.preflight=false", f"run.dir={run_dir}",
                 "eval.metrics={f1: {spec: torchmetrics.classification.MulticlassF1Score, "
                 "num_classes: 10, average: macro}}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--standalone", "-m", "ironloop", "train", "configs/digits.yaml",
                          *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-5000:]
    model, bundle = from_config(load_config(REPO / "configs/digits.yaml", overrides))
    model.load_state_dict(load_file(run_dir / "final.safetensors"))
    model.eval()
    assert len(bundle.val) == 359
    last = read_jsonl(run_dir / "evals.jsonl")[-1]
    assert last["val_f1"] == pytest.approx(sklearn_f1(model, bundle.val), abs=1e-6)


class Counter:
    def __init__(self, start: int = 0):
        self.start = start


def test_a_spec_names_a_class_by_dots_or_a_colon_and_passes_the_other_keys():
    dotted = metrics._from_spec("c", {"spec": f"{__name__}.Counter", "start": 3})
    assert isinstance(dotted, Counter) and dotted.start == 3
    assert metrics._from_spec("c", {"spec": f"{__name__}:Counter"}).start == 0
    with pytest.raises(ConfigError, match=r"^eval.metrics.c: tests.engine.test_metrics."
                                          r"Counter\(\{'stop': 1\}\) failed: .*; "
                                          r"check its arguments$"):
        metrics._from_spec("c", {"spec": f"{__name__}.Counter", "stop": 1})


def test_a_missing_torchmetrics_class_is_a_config_error_unless_torchmetrics_is_missing(
        monkeypatch):
    def not_found(path, key):  # import_spec on a name torchmetrics does not have
        raise ConfigError(f"{key}={path!r}: no such class")

    monkeypatch.setattr(metrics, "import_spec", not_found)
    spec = {"spec": "torchmetrics.NoSuchMetric"}
    with pytest.raises(ConfigError) as e:
        metrics._from_spec("f1", spec)
    assert str(e.value) == "eval.metrics.f1.spec='torchmetrics:NoSuchMetric': no such class"
    monkeypatch.setattr(metrics, "find_spec", lambda name: None)
    with pytest.raises(Exception, match=r"^eval.metrics.f1.spec='torchmetrics.NoSuchMetric' needs "
                                        r"torchmetrics; pip install 'ironloop\[metrics\]'$") as e:
        metrics._from_spec("f1", spec)
    assert type(e.value).__name__ == "UserError"


class Recorder:
    """torchmetrics' protocol, recording its calls: compute() is the count of updates."""

    def __init__(self, num_classes=None):
        self.num_classes = num_classes
        self.calls: list = []

    def update(self, preds, target):
        self.calls.append(("update", preds.requires_grad, target.tolist()))

    def compute(self):
        import torch

        return torch.tensor(sum(c[0] == "update" for c in self.calls), dtype=torch.int64)

    def reset(self):
        self.calls.append(("reset",))


def test_every_metric_gets_the_detached_predictions_and_is_reset_after_its_value_is_read():
    import torch

    f1, auc = Recorder(), Recorder()
    split = metrics.SplitMetrics({"f1": f1, "auc": auc}, torch.device("cpu"))
    preds = torch.ones(2, requires_grad=True)
    split.update((preds, torch.tensor([0, 1])))
    split.update([preds, torch.tensor([1, 1])])  # a list is a pair too
    assert f1.calls == auc.calls == [("update", False, [0, 1]), ("update", False, [1, 1])]
    values = split.compute()
    assert values == {"f1": 2.0, "auc": 2.0} and type(values["f1"]) is float
    assert f1.calls[-1] == auc.calls[-1] == ("reset",)
    split.reset()
    assert f1.calls[-2:] == [("reset",), ("reset",)]


def test_a_metric_that_is_a_module_moves_to_the_runs_device():
    import torch

    class Module(torch.nn.Module, Recorder):
        def __init__(self):
            torch.nn.Module.__init__(self)
            Recorder.__init__(self)
            self.moved_to: list = []

        def to(self, device):
            self.moved_to.append(device)
            return self

    m = Module()
    metrics.SplitMetrics({"f1": m}, torch.device("meta"))
    assert m.moved_to == [torch.device("meta")]


def test_a_metrics_name_must_be_free_and_an_identifier_and_its_object_a_metric():
    import torch

    from ironloop.errors import UserError

    cpu = torch.device("cpu")
    for name in ("loss", "acc", "ppl", "f-1", "1st"):
        with pytest.raises(UserError) as e:
            metrics.SplitMetrics({name: Recorder()}, cpu)
        assert str(e.value) == (f"metrics: the name {name!r} cannot be used (loss, acc and ppl "
                                f"are taken; use letters, digits and _), e.g. 'f1'")
    with pytest.raises(UserError) as e:
        metrics.SplitMetrics({"f1": Counter()}, cpu)
    assert str(e.value) == ("metrics['f1']: Counter has no update(preds, target) / compute() / "
                            "reset(); pass a torchmetrics Metric")


def test_a_metric_built_for_another_class_count_is_refused_before_training():
    import torch

    split = metrics.SplitMetrics({"f1": Recorder(num_classes=5)}, torch.device("cpu"))
    split.check_classes(5)
    split.check_classes(None)  # the run's classes unknown: nothing to compare
    with pytest.raises(ConfigError) as e:
        split.check_classes(3)
    assert str(e.value) == ("eval.metrics.f1: num_classes=5, but the run has 3 classes (the "
                            "data's, the model's outputs); set eval.metrics.f1.num_classes=3 (or "
                            "build the metric passed to fit() with it)")
    # a metric without an int class count (binary, regression) is not judged
    metrics.SplitMetrics({"f1": Recorder(num_classes="5")}, torch.device("cpu")).check_classes(3)


def test_the_configs_metrics_and_fits_are_one_set_and_a_name_in_both_is_refused():
    import torch

    from ironloop.errors import UserError

    cpu = torch.device("cpu")
    assert metrics.build_metrics({}, None, cpu) is None
    assert metrics.build_metrics({}, {}, cpu) is None
    given = Recorder()
    built = metrics.build_metrics({"c": {"spec": f"{__name__}.Recorder", "num_classes": 4}},
                                  {"f1": given}, cpu)
    assert built is not None and list(built.metrics) == ["c", "f1"]
    assert built.metrics["c"].num_classes == 4 and built.metrics["f1"] is given
    with pytest.raises(UserError) as e:
        metrics.build_metrics({"f1": {"spec": f"{__name__}.Recorder"}}, {"f1": given}, cpu)
    assert str(e.value) == ("metrics: 'f1' is both in eval.metrics and passed to fit(); keep "
                            "one")
