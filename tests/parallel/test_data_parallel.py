"""Choosing the strategy and the FSDP2 blocks (no process group needed), and sharding on a
process group of one; the multi-rank runs are in tests/e2e/test_distributed.py."""

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


def test_one_process_trains_the_users_module_itself():
    net = Net()
    assert dp.wrap(net, Config(), World(), torch.device("cpu"), "fp32") == (net, "none")


def test_a_strategy_none_on_several_processes_names_the_count_and_the_ways_out():
    with pytest.raises(ConfigError) as e:
        resolve_strategy(Config().with_overrides({"dist.strategy": "none"}), World(size=3))
    assert str(e.value) == ("dist.strategy='none' on 3 processes would train 3 copies that never "
                            "sync; use ddp or fsdp, or launch one process")


def test_a_model_named_as_its_own_block_is_not_one_of_its_blocks():
    with pytest.raises(ConfigError, match=r"dist.fsdp_modules=\['Block'\]: the model has no "
                                          r"such submodule; its module classes are Block, "
                                          r"Linear$"):
        fsdp_blocks(Block(), ["Block"])


def test_ddp_on_cpu_wraps_the_model_without_device_ids_and_syncs_only_the_last_micro_batch(
        one_rank):
    net = Net()
    ddp, strategy = dp.wrap(net, Config(), World(size=2), torch.device("cpu"), "fp32")
    assert strategy == "ddp"
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is net
    assert ddp.device_ids is None
    with dp.micro_sync(ddp, last=False):
        assert not ddp.require_backward_grad_sync  # no_sync: gradients stay local
    assert ddp.require_backward_grad_sync
    with dp.micro_sync(ddp, last=True):
        assert ddp.require_backward_grad_sync

    class Compiled(nn.Module):  # what torch.compile returns: the wrapped module as _orig_mod
        def __init__(self):
            super().__init__()
            self._orig_mod = ddp

    with dp.micro_sync(Compiled(), last=False):
        assert not ddp.require_backward_grad_sync


def test_fsdp_wrap_shards_the_named_blocks_with_the_runs_precision(one_rank):
    net = Net()
    cfg = Config().with_overrides({"dist.strategy": "fsdp", "dist.fsdp_modules": ["Block"]})
    wrapped, strategy = dp.wrap(net, cfg, World(size=2), torch.device("cpu"), "bf16")
    assert wrapped is net and strategy == "fsdp"
    assert dp.is_fsdp(net.blocks[0]) and dp.is_fsdp(net.blocks[1])
    assert not dp.is_fsdp(net.head[1])  # not named: the root's
    policy = net.blocks[0]._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("precision, param, reduce", [("bf16", torch.bfloat16, torch.float32),
                                                     ("fp16", torch.float16, torch.float32),
                                                     ("fp32", None, None)])
def test_sharded_gradients_are_reduced_in_fp32_under_low_precision(one_rank, precision, param,
                                                                    reduce):
    net = dp.shard(Net(), [], precision)
    for module in (net, net.blocks[0]):
        policy = module._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)


def test_fsdp_micro_batches_sync_and_reshard_only_in_the_last(one_rank):
    net = dp.shard(Net(), [], "fp32")
    groups = [m._get_fsdp_state()._fsdp_param_group for m in (net, net.blocks[0], net.head[1])]
    dp.micro_sync(net, last=False)
    assert [(g.reduce_grads, g.reshard_after_backward) for g in groups] == [(False, False)] * 3
    dp.micro_sync(net, last=True)
    assert [(g.reduce_grads, g.reshard_after_backward) for g in groups] == [(True, True)] * 3


def test_the_full_model_state_of_a_sharded_model_is_whole_plain_tensors(one_rank, monkeypatch):
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    asked, real = [], torch_state_dict.get_model_state_dict

    def recorded(model, options):  # torch's own, with the options it was given noted
        asked.append(options)
        return real(model, options=options)

    monkeypatch.setattr(torch_state_dict, "get_model_state_dict", recorded)
    plain = Net()
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    net = dp.shard(plain, [], "fp32")
    assert dp.is_sharded(net.embed.weight) and not dp.is_sharded(expected["embed.weight"])
    state = dp.full_model_state(net)
    assert list(state) == list(expected)
    for k, v in state.items():
        assert type(v) is torch.Tensor and v.device.type == "cpu"
        assert torch.equal(v, expected[k])
    # on GPUs: the whole tensors land in host memory (rank 0's), not on every rank's device
    assert [(o.full_state_dict, o.cpu_offload) for o in asked] == [(True, True)]
    whole = dp.full_tensor(net.embed.weight)
    assert type(whole) is torch.Tensor and torch.equal(whole, expected["embed.weight"])


def test_the_full_model_state_of_an_unsharded_model_is_its_state_dict():
    net, t = Net(), torch.ones(2)
    assert list(dp.full_model_state(net)) == list(net.state_dict())
    assert dp.full_tensor(t) is t and not dp.is_sharded(t)


def test_a_cuda_ranks_ddp_is_pinned_to_its_own_device(monkeypatch):
    made = []

    class DDP:  # torch's DDP needs the GPU itself: what it is given is what matters here
        def __init__(self, module, device_ids):
            made.append(device_ids)

    monkeypatch.setattr(nn.parallel, "DistributedDataParallel", DDP)
    wrapped, strategy = dp.wrap(Net(), Config(), World(rank=1, size=2), torch.device("cuda", 1),
                                "bf16")
    assert isinstance(wrapped, DDP) and strategy == "ddp" and made == [[1]]
