"""Model chunks: split-independent initialisation, the I/W split equals full backward,
activation checkpointing, saved-activation accounting, stage-range checks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.runtime import check_stage_ranges
from engine.stage import Chunk, build_layers


class _Opt:
    """The protocol methods a chunk uses."""

    def __init__(self, m=1):
        self.m = m

    def scale_loss(self, loss):
        return loss / self.m

    def loss_grad(self, loss):
        return torch.full_like(loss, 1 / self.m)

    def backward(self, tensors, grad_tensors, inputs=None, retain_graph=False):
        torch.autograd.backward(tensors, grad_tensors, inputs=inputs, retain_graph=retain_graph)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return self.lin(x), x * 2  # a tuple, one element a pass-through of the input


class Merge(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4)

    def forward(self, t):
        return self.lin(torch.tanh(t[0]) * t[1])


def _factories():
    return [lambda: nn.Linear(4, 5), lambda: nn.GELU(), lambda: Pair(), lambda: Merge(),
            lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 2)]


def test_layer_init_independent_of_split():
    whole = build_layers(_factories(), 0, 7, seed=3)
    part = build_layers(_factories(), 3, 7, seed=3)
    for a, b in zip(whole[3:], part):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    other = build_layers(_factories(), 3, 4, seed=4)
    assert not torch.equal(other[0].lin.weight, part[0].lin.weight)


def _grads_of(mode, ckpt=False):
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    y = torch.randn(6, 2)
    layers = build_layers(_factories(), 0, 7, seed=1)
    # share one parameter between two layers: its gradient must collect both uses
    layers[5].weight = layers[4].weight
    chunk = Chunk(0, 0, layers, loss_fn=nn.functional.mse_loss, activation_checkpointing=ckpt)
    opt = _Opt(m=2)
    gx_all = []
    for mb in range(2):
        xi = x[mb * 3:(mb + 1) * 3].detach().requires_grad_(True)
        chunk.forward(mb, xi, y[mb * 3:(mb + 1) * 3], split=(mode != "B"))
    for mb in range(2):
        if mode == "B":
            gx_all.append(chunk.backward(mb, None, opt))
        else:
            gx_all.append(chunk.backward_input(mb, None, opt))
    if mode != "B":
        if ckpt:  # a checkpointed chunk runs its whole backward at I; W has nothing left
            assert all(p.grad is not None for p in chunk.params)
        else:
            assert all(p.grad is None for p in chunk.params)  # I computed no weight gradient
        for mb in range(2):
            chunk.backward_weight(mb, opt)
    assert not chunk.state and chunk.live_bytes == 0
    return {n: p.grad.clone() for n, p in chunk.module.named_parameters()}, gx_all, chunk


@pytest.mark.parametrize("ckpt", [False, True])
def test_input_and_weight_split_equals_full_backward(ckpt):
    gb, xb, _ = _grads_of("B", ckpt)
    gs, xs, _ = _grads_of("IW", ckpt)
    g0, x0, _ = _grads_of("B", False)
    for n in g0:
        torch.testing.assert_close(gs[n], gb[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(gb[n], g0[n], rtol=1e-6, atol=1e-7)
    for a, b in zip(xb, xs):
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)


def test_activation_accounting_and_checkpointing():
    _, _, plain = _grads_of("B")
    _, _, ckpt = _grads_of("B", ckpt=True)
    assert plain.peak_bytes > 0
    assert 0 < ckpt.peak_bytes < plain.peak_bytes
    # parameters are not activations: a forward saving only weights counts nothing but inputs
    chunk = Chunk(0, 0, [nn.Linear(1000, 1)])
    chunk.forward(0, torch.randn(2, 1000, requires_grad=True))
    assert chunk.peak_bytes <= 2 * 1000 * 4 + 64


@pytest.mark.parametrize("ranges, match", [
    ([(0, 2), (3, 5)], "unassigned"),
    ([(0, 3), (2, 5)], "overlaps"),
    ([(0, 0), (0, 5)], "empty"),
    ([(0, 2), (2, 4)], "must stop at 5"),
    ([(0, 5)], "2 model chunks"),
])
def test_stage_range_errors(ranges, match):
    with pytest.raises(ValueError, match=match):
        check_stage_ranges(ranges, 5, 2 if match == "2 model chunks" else len(ranges))


@pytest.mark.parametrize("tied", [False, True])
def test_w_accumulates_each_parameter_once_per_microbatch(tied):
    # The data-parallel reducer (engine.overlap) counts accumulations: W must add each
    # parameter's gradient once per microbatch, whether it runs per boundary or, for a weight
    # tied across boundaries, as one summed backward.
    torch.manual_seed(0)
    layers = build_layers(_factories(), 0, 7, seed=1)
    if tied:
        layers[5].weight = layers[4].weight
    chunk = Chunk(0, 0, layers, loss_fn=nn.functional.mse_loss)
    ref = Chunk(0, 0, build_layers(_factories(), 0, 7, seed=1), loss_fn=nn.functional.mse_loss)
    if tied:
        ref.module[5].weight = ref.module[4].weight
        ref.refresh_params()
    counts: dict[int, int] = {}
    for p in chunk.params:
        p.register_post_accumulate_grad_hook(lambda t: counts.__setitem__(id(t), counts.get(id(t), 0) + 1))
    used = []
    real = chunk._boundary_params
    chunk._boundary_params = lambda b: used.append(real(b)) or used[-1]
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 2)
    for mb in range(2):
        chunk.forward(mb, x, y, split=True)
        chunk.backward_input(mb, None, _Opt())
        chunk.backward_weight(mb, _Opt())
        ref.forward(mb, x, y)
        ref.backward(mb, None, _Opt())
    assert sorted(counts.values()) == [2] * len(chunk.params)
    assert (used[0] is None) == tied      # per-boundary W only when no weight is shared
    for a, b in zip(chunk.params, ref.params):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
