"""engine.overlap: gradient buckets reduced over replicas during the last backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import run_workers

from engine.overlap import GradBucketReducer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(16, 16), "b": nn.Linear(16, 16), "c": nn.Linear(16, 4),
                          "unused_once": nn.Linear(16, 4)})


def _backward(model: nn.Module, rank: int, m: int) -> None:
    for k in range(m):
        torch.manual_seed(100 * rank + k)
        x = torch.randn(5, 16)
        h = model["b"](torch.tanh(model["a"](x)))
        loss = model["c"](h).pow(2).sum()
        if k > 0:   # a parameter that misses microbatch 0: never final by count, reduced at finish
            loss = loss + model["unused_once"](h).sum()
        loss.backward()


def _reduce(bucket_bytes: int) -> dict:
    rank, m = dist.get_rank(), 3
    ref, model = _model(), _model()
    _backward(ref, rank, m)
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for g in want.values():
        dist.all_reduce(g)
    reducer = GradBucketReducer(list(model.parameters()), dist.group.WORLD, m, bucket_bytes=bucket_bytes)
    out = {"early": [], "equal": []}
    for _ in range(2):   # twice: reset() makes the second step count again from zero
        model.zero_grad(set_to_none=True)
        reducer.reset()
        _backward(model, rank, m)
        out["early"].append(reducer.launched_early)
        reducer.finish()
        out["equal"].append(all(torch.equal(p.grad, want[n]) for n, p in model.named_parameters()))
    reducer.remove()
    return out


def test_buckets_start_during_backward_and_sum_every_gradient_over_replicas() -> None:
    for r in run_workers(_reduce, 2, 16 * 16 * 4):   # one Linear(16,16) weight per bucket
        assert r["equal"] == [True, True]
        assert r["early"][0] >= 2 and r["early"] == r["early"][:1] * 2
    for r in run_workers(_reduce, 2, 2**30):          # one bucket: nothing starts early, still exact
        assert r["equal"] == [True, True] and r["early"] == [0, 0]
