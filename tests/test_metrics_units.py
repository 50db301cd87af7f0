"""engine/metrics.py's spec reading, in this process (tests/test_metrics.py trains with them)."""

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
    with pytest.raises(ConfigError, match=r"^eval.metrics.c: tests.test_metrics_units.Counter\("
                                          r"\{'stop': 1\}\) failed: .*; check its arguments$"):
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
