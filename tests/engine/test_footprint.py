"""engine.footprint against closed forms: bytes per parameter of weights, gradients and
optimizer state, for every optimizer, ZeRO stage, precision and replica count."""
from __future__ import annotations

import itertools

import pytest

from engine.footprint import state_footprint

N = 1_000_000   # below every bucket cap

OPTIMIZERS = {"adamw": (8, 0.0), "adam": (8, 0.0), "sgd-momentum": (4, 0.9), "sgd": (0, 0.0)}
WEIGHT = {"fp32": 4, "bf16-autocast": 4, "fp16-autocast": 4, "bf16": 2, "fp16": 2}


def _closed_form(prec: str, state: int, zero: int, d: int, accum: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter, written out per case:

    * torch backend (fp32 weights, no ZeRO): 4 + 4 + state;
    * DeepSpeed (ZeRO 1/2, or 16-bit weights): weights w, the fp32 master partition and the
      moments sharded over the d replicas ((state + 4) / d, whole under ZeRO-0), gradients in
      the accumulation dtype, whole (ZeRO 0/1) or one partition (ZeRO-2)."""
    w = WEIGHT[prec]
    if w == 4 and zero == 0:
        return 4, 4, state
    a = 4 if w == 4 or accum == "fp32" else 2
    shard = d if zero > 0 else 1
    return w, a / (d if zero == 2 else 1), (state + 4) / shard


CASES = [(o, prec, z, d, acc) for o, prec, z, d, acc in itertools.product(
    OPTIMIZERS, WEIGHT, (0, 1, 2), (1, 2, 4), ("fp32", "bf16"))
    if not (acc == "bf16" and WEIGHT[prec] == 4) and not (prec == "fp16" and acc == "bf16")]


@pytest.mark.parametrize("opt,prec,zero,d,accum", CASES)
def test_bytes_per_parameter(opt, prec, zero, d, accum):
    state, momentum = OPTIMIZERS[opt]
    name = "sgd" if opt.startswith("sgd") else opt
    f = state_footprint(N, 1000, precision=prec, optimizer=name, momentum=momentum, zero_stage=zero,
                        data_parallel=d, grad_accum_dtype=accum)
    got = (f.parameters / N, f.gradients / N, f.optimizer_state / N)
    assert got == pytest.approx(_closed_form(prec, state, zero, d, accum))


def test_issue_figures():
    """Issue 16's target: bf16 AdamW ZeRO-1 over 2 replicas, 2 + 4 + 12 / 2 = 12 bytes (10 with
    bf16 accumulation); the old layout (bf16-autocast, fp32 weights) 4 + 4 + 12 / 2 = 14."""
    def total(prec, accum="fp32"):
        f = state_footprint(N, 0, precision=prec, optimizer="adamw", zero_stage=1, data_parallel=2,
                            grad_accum_dtype=accum)
        return (f.parameters + f.gradients + f.optimizer_state) / N
    assert (total("bf16"), total("bf16", "bf16"), total("bf16-autocast")) == (12, 10, 14)


def test_torch_backend_reduction_temporaries():
    """The torch backend's data-parallel reduction at the step: with the overlapped buckets
    (engine.overlap) every bucket's flat copy lives until the last is reduced (a whole gradient
    copy); without, one bucket of grad_bucket_mb (plus the tensor that overflows it); one
    replica reduces nothing."""
    n, big = 50_000_000, 1000
    overlap = state_footprint(n, big, data_parallel=2)
    plain = state_footprint(n, big, data_parallel=2, overlap_grad_reduce=False, grad_bucket_mb=10)
    alone = state_footprint(n, big, data_parallel=1)
    assert overlap.step_temporary == 4 * n
    assert plain.step_temporary == 10 * 2**20 + 4 * big
    assert alone.step_temporary == 0
