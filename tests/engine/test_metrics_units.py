"""engine/metrics.py's spec reading, in this process (tests/engine/test_metrics.py trains with
them)."""

from __future__ import annotations

import pytest

from ironloop.engine import metrics
from ironloop.errors import ConfigError


class Counter:
    def __init__(self, start: int = 0):
        self.start = start


def test_a_spec_names_a_class_by_dots_or_a_colon_and_passes_the_other_keys():
    dotted = metrics._from_spec("c", {"spec": f"{__name__}.Counter", "start": 3})
    assert isinstance(dotted, Counter) and dotted.start == 3
    assert metrics._from_spec("c", {"spec": f"{__name__}:Counter"}).start == 0
    with pytest.raises(ConfigError, match=r"^eval.metrics.c: tests.engine.test_metrics_units."
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
