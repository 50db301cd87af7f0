"""Choosing the strategy and the FSDP2 blocks (no process group needed), and sharding on a
process group of one; the multi-rank runs are in tests/test_distributed.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ironloop.config import Config
from ironloop.errors import ConfigError
from ironloop.parallel import data_parallel as dp
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
    with pytest.raises(ConfigError, match=r"dist.fsdp_modules=\['TransformerBlock'\]: the model "
                                          r"has no such submodule; its module classes are "
                                          r"Block, Linear, ModuleList, Net, ReLU, Sequential$"):
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


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one, in this process: enough for FSDP2 to shard over."""
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60),
                            store=dist.FileStore(str(tmp_path / "store"), 1))
    yield
    dist.destroy_process_group()


def test_shard_makes_each_block_and_then_the_root_an_fsdp_module(one_rank):
    net = Net()
    blocks = fsdp_blocks(net, [])
    assert dp.shard(net, [], "bf16") is net  # sharded in place
    assert all(dp.is_fsdp(b) for b in blocks) and dp.is_fsdp(net)
    assert not dp.is_fsdp(net.embed)  # not a block: its parameters are the root's


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16),
                                              ("fp16", torch.float16),
                                              ("fp32", torch.float32)])
def test_a_sharded_block_computes_in_the_runs_precision(one_rank, precision, dtype):
    net = dp.shard(Net(), [], precision)
    assert net.head[1](torch.ones(3, 4)).dtype == dtype  # its parameters gathered in dtype


def test_under_fsdp_a_rank_with_fewer_eval_batches_owes_the_others_their_forwards(one_rank):
    """5 samples in batches of 2 over 2 ranks: rank 0 has 3 (2 batches), rank 1 has 2 (1)."""
    net = dp.shard(Net(), [], "fp32")
    two = World(rank=1, size=2)
    assert dp.extra_forwards(net, two, 5, 2, done=1) == 1
    assert dp.extra_forwards(net, two, 5, 2, done=2) == 0
    assert dp.extra_forwards(Net(), two, 5, 2, done=1) == 0  # DDP: every forward is local
    assert dp.extra_forwards(net, World(), 5, 2, done=1) == 0  # one process: nobody waits
