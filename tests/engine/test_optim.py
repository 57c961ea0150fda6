"""The torch optimizer backend: lr schedule, clipping by the global norm, data-parallel
averaging, non-finite policy, fp16 loss scaling, bf16 training, name-keyed state."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dist_helpers import run_workers

from engine.mesh import Mesh
from engine.optim import (LossScaler, NonFiniteError, OptimizerConfig,
                          TorchStageOptimizer, lr_at, resolve_backend)
from engine.backend import make_optimizer


def test_lr_schedule_warmup_then_cosine():
    c = OptimizerConfig(lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1)
    assert [lr_at(c, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(c, 4) == pytest.approx(1.0)
    assert lr_at(c, 9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(c, 14) == pytest.approx(0.1) and lr_at(c, 100) == pytest.approx(0.1)
    assert lr_at(OptimizerConfig(lr=0.3), 50) == 0.3


def test_backend_choice():
    assert resolve_backend(OptimizerConfig()) == "torch"
    assert resolve_backend(OptimizerConfig(zero_stage=1)) == "deepspeed"
    with pytest.raises(ValueError, match="needs backend='deepspeed'"):
        resolve_backend(OptimizerConfig(zero_stage=1, backend="torch"))
    with pytest.raises(ValueError, match="optimizer name"):
        make_optimizer(OptimizerConfig(name="lion"), nn.ModuleDict({"0": nn.Linear(2, 2)}),
                       Mesh(1, 1), microbatches=1)


def _opt(module, **kw):
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in OptimizerConfig.__dataclass_fields__}
    return make_optimizer(OptimizerConfig(**cfg_kw), module, Mesh(1, 1), microbatches=2, **kw)


def test_clipping_matches_torch_and_state_is_name_keyed():
    torch.manual_seed(0)
    a, b = nn.ModuleDict({"0": nn.Linear(3, 3)}), nn.ModuleDict({"0": nn.Linear(3, 3)})
    b.load_state_dict(a.state_dict())
    opt = _opt(a, name="sgd", lr=0.1, momentum=0.9, grad_clip=0.05)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3)
    a["0"](x).pow(2).sum().backward()
    b["0"](x).pow(2).sum().backward()
    norm = nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    skipped, got = opt.step()
    ref.step()
    assert not skipped and got == pytest.approx(float(norm), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
    sd = opt.state_dict()
    assert set(sd["state"]) == {"0.weight", "0.bias"} and sd["steps"] == 1
    opt2 = _opt(b, name="sgd", lr=0.1, momentum=0.9)
    opt2.load_state_dict(sd)
    torch.testing.assert_close(opt2.state_dict()["state"]["0.weight"]["momentum_buffer"],
                               sd["state"]["0.weight"]["momentum_buffer"])


def test_nonfinite_policy_and_fp16_scaling():
    m = nn.ModuleDict({"0": nn.Linear(2, 2)})
    for p in m.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(NonFiniteError, match=r"stage\(s\) \[0\]"):
        _opt(m).step()
    assert _opt(m, nonfinite="skip").step() == (True, None)
    o16 = _opt(m, precision="fp16-autocast")
    scale = o16.loss_scale
    before = [p.detach().clone() for p in m.parameters()]
    assert o16.step() == (True, None) and o16.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert float(o16.scale_loss(torch.tensor(1.0))) == scale / 2 / 2   # x scale / m


def test_one_loss_scaler_halves_to_a_floor_of_one_and_grows():
    s = LossScaler(enabled=True, init_scale=8.0, growth_interval=3)
    for want in (4.0, 2.0, 1.0, 1.0, 1.0):       # halves on overflow, never below 1.0
        s.update(overflow=True)
        assert s.scale == want
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 1.0 and s.good_steps == 2
    s.update(overflow=False)                     # a clean interval doubles it
    assert s.scale == 2.0 and s.good_steps == 0
    s.update(overflow=False)
    s.update(overflow=True)                      # an overflow restarts the interval
    assert s.scale == 1.0 and s.good_steps == 0
    restored = LossScaler(enabled=True)
    restored.load_state_dict(s.state_dict())
    assert (restored.scale, restored.good_steps) == (s.scale, s.good_steps)
    off = LossScaler(enabled=False)
    off.update(overflow=True)
    assert off.scale == 1.0


def test_torch_backend_loss_scale_stops_at_one():
    # Both backends use LossScaler (the DeepSpeed one is checked in test_zero): a run of
    # overflows lowers the torch backend's scale to the same floor as DeepSpeed's, not to 0.
    m = nn.ModuleDict({"0": nn.Linear(2, 2)})
    o16 = _opt(m, precision="fp16-autocast")
    assert isinstance(o16.scaler, LossScaler)
    for _ in range(20):
        for p in m.parameters():
            p.grad = torch.full_like(p, float("inf"))
        assert o16.step() == (True, None)
    assert o16.loss_scale == 1.0


def _dp_and_norm():
    import torch.distributed as dist
    rank = dist.get_rank()
    out = {}
    # data parallel x2: gradients are averaged
    m = nn.ModuleDict({"0": nn.Linear(2, 1, bias=False)})
    with torch.no_grad():
        m["0"].weight.fill_(1.0)
    o = TorchStageOptimizer(OptimizerConfig(lr=1.0), dict(m.named_parameters()), Mesh(1, 2),
                            microbatches=1)
    m["0"].weight.grad = torch.full((1, 2), float(rank + 1))   # 1 and 2 -> mean 1.5
    skipped, norm = o.step()
    out["dp"] = (m["0"].weight.detach().clone(), norm)
    # pipeline x2: the clipping norm spans both stages
    m2 = nn.ModuleDict({str(rank): nn.Linear(1, 1, bias=False)})
    o2 = TorchStageOptimizer(OptimizerConfig(lr=1.0, grad_clip=1.0), dict(m2.named_parameters()),
                             Mesh(2, 1), microbatches=1)
    w0 = m2[str(rank)].weight.detach().clone()
    m2[str(rank)].weight.grad = torch.full((1, 1), 3.0 if rank == 0 else 4.0)
    _, norm2 = o2.step()
    out["pp"] = (norm2, (w0 - m2[str(rank)].weight.detach()).item())
    return out


def test_data_parallel_average_and_global_norm_across_stages():
    r0, r1 = run_workers(_dp_and_norm, 2)
    for r in (r0, r1):
        torch.testing.assert_close(r["dp"][0], torch.full((1, 2), 1.0 - 1.5))
        assert r["dp"][1] == pytest.approx(math.sqrt(2 * 1.5 ** 2))
        assert r["pp"][0] == pytest.approx(5.0)       # sqrt(3^2 + 4^2), not per stage
    assert r0["pp"][1] == pytest.approx(3.0 / 5.0, rel=1e-5)   # clipped by the global norm
    assert r1["pp"][1] == pytest.approx(4.0 / 5.0, rel=1e-5)


def _train(precision, steps=20):
    from engine import Pipeline
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    y = x[:, :2] * 2 - x[:, 2:4]
    pipe = Pipeline([lambda: nn.Linear(8, 16), lambda: nn.Tanh(), lambda: nn.Linear(16, 2)],
                    [(0, 3)], loss_fn=nn.functional.mse_loss, microbatches=2,
                    precision=precision, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
    return [pipe.train_step(x, y) for _ in range(steps)]


def test_bf16_trains_close_to_fp32_and_fp16_runs():
    fp32 = [r.loss for r in _train("fp32")]
    bf16 = [r.loss for r in _train("bf16-autocast")]
    assert bf16[-1] < 0.5 * bf16[0]
    assert abs(bf16[-1] - fp32[-1]) < 0.05 * fp32[0]
    fp16 = _train("fp16-autocast", steps=5)   # CPU autocast supports float16 in this torch
    assert not any(r.skipped for r in fp16) and fp16[-1].loss < fp16[0].loss


@pytest.mark.parametrize("precision", ["fp32", "fp16-autocast"])
def test_seeding_backward_with_loss_grad_equals_back_propagating_the_scaled_loss(precision):
    # the last chunk seeds its backward with loss_grad(loss) instead of scaling the loss: the
    # gradients must be the same bits, with and without an fp16 loss scale
    torch.manual_seed(0)
    a, b = nn.ModuleDict({"0": nn.Linear(3, 2)}), nn.ModuleDict({"0": nn.Linear(3, 2)})
    b.load_state_dict(a.state_dict())
    oa, ob = _opt(a, precision=precision), _opt(b, precision=precision)
    x = torch.randn(5, 3)
    loss_a, loss_b = a["0"](x).pow(2).mean(), b["0"](x).pow(2).mean()
    oa.backward([oa.scale_loss(loss_a)], None)
    ob.backward([loss_b], [ob.loss_grad(loss_b)])
    assert ob.loss_grad(loss_b).shape == loss_b.shape
    assert float(ob.loss_grad(loss_b)) == ob.loss_scale / 2
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)
