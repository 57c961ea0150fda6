"""partitioner.zero3 against MemTracker: ZeRO-3's parameter, gradient and optimizer-state bytes
at each rank's measured peak (pp2 x fsdp2, 4 gloo ranks, fp32, 1f1b; wide layers, so that the
state, not the activations, makes the peak: the peak falls inside a backward).

The model's terms are within 10% of MemTracker's breakdown on every rank without resharding. With
resharding the layers of the chunk that computes are all counted gathered: the optimizer state is
within 10%, and the parameters and gradients are upper bounds,
which the measured peak meets only when it falls at the end of a chunk's backward with every
layer gathered (it depends on the all-gather prefetch's timing; in 2 runs of 8 it does not).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_helpers import run_workers
from partitioner.zero3 import zero3_state_bytes
from problems import batches, ranges

pytestmark = pytest.mark.slow

WIDTH, M, BATCH = 192, 4, 8
CASES = [dict(opt=dict(name="sgd", lr=0.01, momentum=0.9), reshard=r) for r in ("false", "true")]
CASES += [dict(opt=dict(name="adamw", lr=1e-3), reshard="false")]


def _factories():
    return [lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(5)] + [
        lambda: nn.Linear(WIDTH, 4)]


def _worker(cases):
    from engine import OptimizerConfig, Pipeline

    torch.set_num_threads(1)
    out = []
    for case in cases:
        pipe = Pipeline(_factories(), ranges(6, 2), loss_fn=nn.functional.mse_loss,
                        schedule="1f1b", microbatches=M, data_parallel=2, seed=0,
                        optimizer=OptimizerConfig(**case["opt"], zero_stage=3,
                                                  reshard_after_forward=case["reshard"]))
        x, y = batches(0, seed=1, batch=BATCH, in_dim=WIDTH, out_dim=4)
        pipe.train_step(x, y)
        r = pipe.train_step(x, y, measure_memory=True)
        numel = sum(p.numel() for c in pipe.chunks.values() for p in c.params)
        out.append({"numel": numel, "breakdown": r.stats["memory_measured"]["breakdown"]})
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 4, CASES, timeout_s=300)


@pytest.mark.parametrize("k", range(len(CASES)),
                         ids=[f"{c['opt']['name']}-reshard_{c['reshard']}" for c in CASES])
def test_zero3_terms_match_memtracker(results, k):
    case = CASES[k]
    for rank in results:
        got = rank[k]
        model = zero3_state_bytes([got["numel"]], data_parallel=2, optimizer=case["opt"]["name"],
                                  momentum=case["opt"].get("momentum", 0.0),
                                  reshard_after_forward=case["reshard"] == "true")
        if case["reshard"] == "true":
            # an upper bound: the peak holds every layer gathered and every gradient only when the
            # backward's all-gather prefetch lines up with the reshards; otherwise it falls where
            # part of the layers are gathered or part of the gradients exist (2 runs in 8 at
            # 053686a: parameters 297992 or gradients 148224 where the bound is 449304 / 299536).
            # The plan never books less than the peak holds; the shards are always there.
            assert got["breakdown"]["optimizer_state"] == pytest.approx(model["optimizer_state"], rel=0.10)
            for kind in ("parameters", "gradients"):
                assert got["breakdown"][kind] <= model[kind] * 1.10, (kind, got["breakdown"], model)
            assert got["breakdown"]["parameters"] >= got["numel"] * 4 / 2 and got["breakdown"]["gradients"] > 0
            continue
        for kind in ("parameters", "gradients", "optimizer_state"):
            measured = got["breakdown"][kind]
            assert measured == pytest.approx(model[kind], rel=0.10), (kind, got["breakdown"], model)
