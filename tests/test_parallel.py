"""Choosing the strategy and the FSDP2 blocks (no process group needed); the multi-rank runs
are in tests/test_distributed.py."""

from __future__ import annotations

import pytest
from torch import nn

from ironloop.config import Config
from ironloop.errors import ConfigError
from ironloop.parallel.data_parallel import fsdp_blocks, resolve_strategy
from ironloop.parallel.world import World


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(4, 2))


def test_default_blocks_are_the_children_with_parameters_of_containers():
    net = Net()
    blocks = fsdp_blocks(net, [])
    assert blocks == [net.blocks[0], net.blocks[1], net.head[1]]  # ReLU has no parameters


def test_named_blocks_and_a_name_the_model_lacks():
    net = Net()
    assert fsdp_blocks(net, ["Block"]) == list(net.blocks)
    with pytest.raises(ConfigError, match=r"dist.fsdp_modules.*Block.*Linear"):
        fsdp_blocks(net, ["TransformerBlock"])


def test_strategy_resolution():
    one, two = World(), World(rank=0, size=2)
    cfg = Config()
    assert resolve_strategy(cfg, one) == "none"
    assert resolve_strategy(cfg, two) == "ddp"
    fsdp = cfg.with_overrides({"dist.strategy": "fsdp"})
    assert resolve_strategy(fsdp, two) == "fsdp"
    assert resolve_strategy(fsdp, one) == "none"  # one process: nothing to shard over
    with pytest.raises(ConfigError, match="dist.strategy='none' on 2 processes"):
        resolve_strategy(cfg.with_overrides({"dist.strategy": "none"}), two)


@pytest.mark.parametrize("override, match", [
    ({"dist.strategy": "zero3"}, r"dist.strategy='zero3': must be one of auto, ddp, fsdp"),
    ({"dist.timeout_s": 0}, r"dist.timeout_s=0.0: must be > 0"),
    ({"dist.fsdp_modules": [""]}, r"dist.fsdp_modules=\[''\]: must be a list of module class"),
])
def test_dist_config_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        Config().with_overrides(override)
