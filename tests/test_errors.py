"""Errors and notices speak the caller's language: fit()'s arguments to Python, the flags to the
CLI (errors.option, set once at the front door)."""

from __future__ import annotations

import pytest

import ironloop
from ironloop.errors import ConfigError, UserError, option, speaking_python
from tests.conftest import blobs, cfg, tiny_mlp


def test_an_option_is_a_flag_to_the_cli_and_an_argument_to_python():
    assert (option("overwrite"), option("allow_config_change")) == \
        ("--overwrite", "--allow-config-change")
    assert option("resume", "runs/a/best.pt") == "--resume runs/a/best.pt"
    with speaking_python():
        assert (option("overwrite"), option("allow_config_change")) == \
            ("overwrite=True", "allow_config_change=True")
        assert option("resume", "runs/a/best.pt") == "resume='runs/a/best.pt'"
    assert option("resume") == "--resume"  # set back on the way out


def test_running_the_readme_fit_twice_names_fits_arguments(tmp_path):
    conf = cfg(tmp_path, train__max_steps=2)
    ironloop.fit(tiny_mlp(), blobs(), None, conf)
    with pytest.raises(UserError) as e:
        ironloop.fit(tiny_mlp(), blobs(), None, conf)
    assert "resume=True" in str(e.value) and "overwrite=True" in str(e.value)
    assert "--" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # the drift refusal, too
        ironloop.fit(tiny_mlp(), blobs(), None, {**conf, "optim.lr": 0.5}, resume=True)
    assert "allow_config_change=True" in str(e.value) and "--allow" not in str(e.value)
