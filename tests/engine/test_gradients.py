"""The pre-clip norm and clipping, apart from the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ironloop.engine.gradients import clip_gradients, grad_norm_of


def test_clip_returns_pre_clip_norm_and_flags():
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm, clipped = clip_gradients([p], 1.0, "norm")
    assert float(norm) == pytest.approx(5.0) and bool(clipped)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.tensor([3.0, -4.0, 0.0, 0.0])
    norm, clipped = clip_gradients([p], 2.0, "value")
    assert float(norm) == pytest.approx(5.0) and bool(clipped)
    assert p.grad.tolist() == [2.0, -2.0, 0.0, 0.0]
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm, clipped = clip_gradients([p], 0.0, "norm")  # disabled: measured, untouched
    assert float(norm) == pytest.approx(5.0) and not bool(clipped)
    assert p.grad.tolist() == [3.0, 4.0, 0.0, 0.0]


def test_the_norm_is_get_total_norms_bits_on_the_short_path_and_where_it_steps_aside():
    """One device and dtype takes a direct foreach norm (the small-model path); mixed dtypes and
    a gradient that carries a graph go through get_total_norm. Both give its bits."""
    g = torch.Generator().manual_seed(0)

    def params(*dtypes) -> list[nn.Parameter]:
        out = []
        for i, dtype in enumerate(dtypes):
            p = nn.Parameter(torch.zeros(7 + i, dtype=dtype))
            p.grad = torch.randn(7 + i, generator=g).to(dtype) * 10 ** i
            out.append(p)
        return out

    for ps in (params(torch.float32, torch.float32, torch.float32),
               params(torch.float32, torch.float64, torch.float32)):
        want = nn.utils.get_total_norm([p.grad for p in ps])
        assert torch.equal(grad_norm_of(ps), want)
    graph = params(torch.float32, torch.float32)
    w = torch.ones(8, requires_grad=True)
    graph[1].grad = w * 2.0  # create_graph's kind of gradient: the norm carries no graph here
    assert not grad_norm_of(graph).requires_grad
    assert torch.equal(grad_norm_of(graph), nn.utils.get_total_norm([p.grad for p in graph]))


def test_value_clipping_flags_only_a_gradient_past_the_bound_and_no_grad_is_no_norm():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([2.0, -1.0])
    norm, clipped = clip_gradients([p], 2.0, "value")  # at the bound: nothing clipped
    assert not bool(clipped) and p.grad.tolist() == [2.0, -1.0]
    p.grad = torch.tensor([3.0, 4.0])
    norm, clipped = clip_gradients([p], 5.0, "norm")  # a norm of exactly max_norm
    assert not bool(clipped) and p.grad.tolist() == pytest.approx([3.0, 4.0])
    norm, clipped = clip_gradients([p], 0.0, "value")  # disabled
    assert float(norm) == pytest.approx(5.0) and not bool(clipped)
    assert clipped.dtype == torch.bool
    frozen = nn.Parameter(torch.zeros(2))  # no grad: not in the norm
    norm, clipped = clip_gradients([frozen], 1.0, "norm")
    assert float(norm) == 0.0 and not bool(clipped) and clipped.dtype == torch.bool
    norm, clipped = clip_gradients([frozen, p], 1.0, "norm")
    assert float(norm) == pytest.approx(5.0) and bool(clipped)


def test_before_torch_2_6_the_norm_and_the_clip_are_clip_grad_norm_s_own(monkeypatch):
    """torch < 2.6 has neither ``get_total_norm`` nor ``clip_grads_with_norm_``: the fallback
    measures the global norm over every gradient and scales by max_norm / (norm + 1e-6), never
    up, exactly as torch's clip_grad_norm_ (run here before the two are taken away)."""
    def grads() -> list[nn.Parameter]:
        a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(1))
        a.grad, b.grad = torch.tensor([3.0, 4.0, 0.0, 0.0]), torch.tensor([12.0])
        return [a, b]  # a global norm of 13

    want = {}
    for max_norm in (1.0, 20.0):  # clipped, and a bound above the norm (but under twice it)
        ref = grads()
        nn.utils.clip_grad_norm_(ref, max_norm)
        want[max_norm] = [p.grad.clone() for p in ref]
    monkeypatch.delattr(nn.utils, "clip_grads_with_norm_")
    monkeypatch.delattr(nn.utils, "get_total_norm")
    for max_norm, clipped_too in ((1.0, True), (20.0, False)):
        params = grads()
        norm, clipped = clip_gradients(params, max_norm, "norm")
        assert float(norm) == 13.0 and bool(clipped) is clipped_too
        assert all(torch.equal(p.grad, w) for p, w in zip(params, want[max_norm]))
    assert want[20.0][1].item() == 12.0  # the bound above the norm left them as they were


def test_under_fsdp2_the_norm_of_sharded_gradients_is_made_whole(monkeypatch):
    """FSDP2's gradients are shards (DTensors): the local norm goes through full_tensor, the
    collective that makes it the global one; plain gradients' norm is used as it is."""
    from ironloop.engine import gradients

    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    seen = []
    monkeypatch.setattr(gradients.data_parallel, "is_sharded", lambda t: seen.append(t) or True)
    monkeypatch.setattr(gradients.data_parallel, "full_tensor", lambda t: t * 10)
    assert float(gradients.grad_norm_of([p])) == 50.0  # made whole (here: x 10)
    assert seen == [p.grad]  # judged by the first gradient
    monkeypatch.setattr(gradients.data_parallel, "is_sharded", lambda t: False)
    assert float(gradients.grad_norm_of([p])) == 5.0
