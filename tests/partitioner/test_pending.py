"""Issue 11: the gradients a split-backward schedule (zb-h1, zb-h2, zbv) keeps between a
microbatch's I and its deferred W, in the profile and in the memory model."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.schedules import build_schedule
from partitioner import LayerCost, Profile, partition
from partitioner.feasible import Problem
from partitioner.memory import (MemorySettings, held_and_pending, inflight_from_schedule, peak_state,
                                schedule_states)

# ---- counts read from the engine's schedules -----------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (3, 2), (4, 8), (5, 12), (4, 3)])
def test_zb_h1_holds_min_p_m_and_has_min_j_plus_1_m_pending(p, m):
    held, pending = held_and_pending(build_schedule("zb-h1", p, m), [1.0] * p, [1.0] * p)
    assert held == [min(p, m)] * p
    assert pending == [min(j + 1, m) for j in range(p)]


def test_zb_h2_and_zbv_pending_counts():
    # zb-h2, p=4, m=8, max_inflight 2p - 1 = 7: rank j has 2j + 1 microbatches pending at its peak
    assert held_and_pending(build_schedule("zb-h2", 4, 8), [1.0] * 4, [1.0] * 4) == ([7] * 4, [1, 3, 5, 7])
    assert held_and_pending(build_schedule("zb-h2", 4, 8, max_inflight=5), [1.0] * 4, [1.0] * 4) == \
        ([5] * 4, [1, 2, 3, 5])
    # zbv, p=2, m=4 (rank 0: chunks 0 and 3; rank 1: chunks 1 and 2): no single state dominates
    sched = build_schedule("zbv", 2, 4, 2)
    states = schedule_states(sched)
    assert states[0] == [((3, 1), (0, 1)), ((4, 0), (1, 0))]
    assert states[1] == [((2, 2), (0, 1)), ((3, 1), (1, 0)), ((2, 1), (2, 1))]
    # which state is the peak depends on the bytes: heavy kept gradients on chunk 3 ...
    assert peak_state(states[0], [1.0, 1.0], [0.0, 10.0]) == ((3, 1), (0, 1))
    # ... or heavy activations on chunk 0
    assert peak_state(states[0], [10.0, 1.0], [1.0, 1.0]) == ((4, 0), (1, 0))
    # rank 1: 2 held + 2 pending of chunk 1 wins when kept gradients dominate
    assert peak_state(states[1], [1.0, 1.0], [10.0, 1.0]) == ((2, 1), (2, 1))
    held, pending = held_and_pending(sched, [1.0, 1.0, 1.0, 1.0], [0.0, 5.0, 5.0, 5.0])
    assert (held, pending) == ([3, 2, 1, 1], [0, 2, 1, 1])


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_schedules_without_split_backward_have_nothing_pending(name, v):
    sched = build_schedule(name, 3, 6, v)
    assert all(g == (0,) * v for states in schedule_states(sched) for _, g in states)
    k = 3 * v
    assert held_and_pending(sched, [1.0] * k, [9.0] * k) == (inflight_from_schedule(sched), [0] * k)


# ---- the per-layer figure: serialised, defaulted, rule per backend ----------------------------


def _layer(pending: int | None, param: int = 4_000, act: int = 10_000, out: int = 1_000) -> LayerCost:
    return LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=param, activation_bytes=act,
                     output_bytes=out, weight_grad_s=1e-3, pending_grad_bytes=pending)


def test_pending_grad_bytes_round_trips_and_old_profiles_default():
    prof = Profile([_layer(3_000), _layer(None), _layer(None, param=0)])
    assert Profile.from_json(prof.to_json()) == prof
    old = json.loads(prof.to_json())
    for row in old["layers"]:
        del row["pending_grad_bytes"]   # a profile written before the field existed
    back = Profile.from_json(json.dumps(old))
    assert [c.pending_bytes for c in back.layers] == [1_000, 1_000, 0]   # output bytes when it has weights
    assert [c.pending_bytes for c in prof.layers] == [3_000, 1_000, 0]
    with pytest.raises(ValueError, match="pending_grad_bytes"):
        _layer(-1)


def test_the_backend_sets_the_rule():
    lc = _layer(3_000)
    assert MemorySettings(zero_stage=0).node_split and MemorySettings(zero_stage=0).pending_grad_bytes(lc) == 3_000
    ds = MemorySettings(zero_stage=1)   # DeepSpeed: the engine cuts the graph per layer
    assert not ds.node_split and ds.pending_grad_bytes(lc) == 1_000
    assert ds.pending_grad_bytes(_layer(3_000, param=0)) == 0


# ---- the memory model counts them ----------------------------------------------------------


def _profile(pending: int | None, n: int = 8) -> Profile:
    return Profile([_layer(pending) for _ in range(n)], meta={"input_requires_grad": True})


def test_a_known_pending_figure_adds_pending_times_its_bytes_as_temporary():
    p, m, g = 2, 4, 7_000
    kw = dict(microbatches=m, zero_stage=0, simulate=False)
    zero = partition(_profile(0), p, schedule="zb-h1", **kw)
    with_g = partition(_profile(g), p, schedule="zb-h1", **kw)
    assert with_g.stage_ranges == zero.stage_ranges == [(0, 4), (4, 8)]
    assert with_g.stage_pending == [1, 2] and with_g.stage_inflight == [2, 2]
    for r, (a, e) in enumerate(with_g.stage_ranges):
        d0, d1 = zero.rank_memory_breakdown[r], with_g.rank_memory_breakdown[r]
        assert d1["temporary"] - d0["temporary"] == with_g.stage_pending[r] * (e - a) * g
        # the transfer buffers alive at the peak may differ: the peak is the moment of the
        # largest total, and the kept gradients move it (partitioner.memory.program_peaks)
        same = ("parameters", "gradients", "optimizer_state", "activations")
        assert {k: d1[k] for k in same} == {k: d0[k] for k in same}
        assert with_g.rank_memory_bytes[r] == sum(d1.values())
        assert (with_g.rank_memory_bytes[r] - zero.rank_memory_bytes[r]
                == with_g.stage_pending[r] * (e - a) * g + d1["communication"] - d0["communication"])


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_schedules_without_split_backward_are_unchanged(schedule, v):
    a = partition(_profile(0), 2, schedule=schedule, virtual_stages=v, microbatches=4, zero_stage=0)
    b = partition(_profile(50_000), 2, schedule=schedule, virtual_stages=v, microbatches=4, zero_stage=0,
                  memory_limit_bytes=10 << 20)
    c = partition(_profile(0), 2, schedule=schedule, virtual_stages=v, microbatches=4, zero_stage=0,
                  memory_limit_bytes=10 << 20)
    assert a.rank_memory_breakdown == b.rank_memory_breakdown == c.rank_memory_breakdown
    assert b.stage_ranges == c.stage_ranges and b.stage_pending == [0] * 2 * v


def test_recomputing_chunks_keep_nothing_to_w():
    kw = dict(microbatches=4, zero_stage=0, activation_checkpointing=True)
    zero, big = partition(_profile(0), 2, schedule="zb-h1", **kw), partition(_profile(50_000), 2, schedule="zb-h1", **kw)
    assert big.rank_memory_breakdown == zero.rank_memory_breakdown and big.stage_pending == [0, 0]


def test_a_first_chunk_without_a_float_input_keeps_its_output_gradient():
    """The engine defers the whole backward of a chunk without an input gradient to W: it keeps
    only the gradient arriving at its output, and that W, a whole backward, meets its last
    layer's workspace (2 x output bytes when unknown) besides the weight-gradient transient that
    a split W alone meets (partitioner.planner._transients)."""
    g, out = 7_000, 1_000
    grad_in = partition(_profile(g), 2, schedule="zb-h1", microbatches=4, zero_stage=0)
    prof = _profile(g)
    prof.meta["input_requires_grad"] = False
    tokens = partition(prof, 2, schedule="zb-h1", microbatches=4, zero_stage=0)
    diff = [a - b for a, b in zip(grad_in.rank_memory_bytes, tokens.rank_memory_bytes)]
    assert diff == [grad_in.stage_pending[0] * (4 * g - out) - 2 * out, 0]


def test_the_split_solver_counts_pending_like_activations():
    act = np.full(4, 100.0)
    pend = np.array([10.0, 20.0, 30.0, 40.0])
    P = Problem(np.ones(4), 2, act=act, inflight=[2, 2], pend=pend, pending=[1, 2])
    _, mem = P.costs([(0, 2), (2, 4)])
    assert list(mem) == [2 * 200 + 1 * 30, 2 * 200 + 2 * 70]
    R = Problem(np.ones(4), 2, act=act, inflight=[2, 2], pend=pend, pending=[1, 2], recompute_time=np.ones(4),
                checkpointing="on")
    _, mem = R.costs([(0, 2), (2, 4)], [0, 0])
    assert list(mem) == [200, 200]   # a recomputing stage: one microbatch's activations, nothing pending
    # a limit that fits the split without the pending gradients but not with them
    prof = _profile(0)
    zero = partition(prof, 2, schedule="zb-h1", microbatches=4, zero_stage=0)
    limit = max(zero.rank_memory_bytes) + 1_000
    partition(prof, 2, schedule="zb-h1", microbatches=4, zero_stage=0, memory_limit_bytes=limit)
    big = Profile([dataclasses.replace(c, pending_grad_bytes=50_000) for c in prof.layers], meta=prof.meta)
    with pytest.raises(Exception, match="smallest memory_limit_bytes"):
        partition(big, 2, schedule="zb-h1", microbatches=4, zero_stage=0, memory_limit_bytes=limit)


@pytest.mark.parametrize("schedule,pend,act", [
    ("zbv", [100_000, 0, 0, 0, 0, 0, 0, 100_000], [1_000] * 8),
    # interleaved: rank 1 may hold 2 of chunk 1 and 1 of chunk 3, or 3 of chunk 1; heavy
    # activations in chunk 1 make the second the peak though both hold 3 microbatches
    ("interleaved-1f1b", [0] * 8, [1_000, 1_000, 90_000, 90_000, 1_000, 1_000, 1_000, 1_000]),
])
def test_multi_chunk_ranks_take_the_peak_of_the_combined_quantity(schedule, pend, act):
    """zbv's and interleaved's ranks have several non-dominated (held, pending) states: the
    plan's memory is the largest over them for its split, and it fits the limit it was given."""
    # no cut tensors: the kept outputs and transfer buffers (tests/partitioner/test_memory_terms.py)
    # would move the peak; here only held activations and pending gradients make it
    layers = [_layer(g, act=a, out=0) for g, a in zip(pend, act)]
    prof = Profile(layers, meta={"input_requires_grad": True})
    plan = partition(prof, 2, schedule=schedule, virtual_stages=2, microbatches=4, zero_stage=0)
    sched = build_schedule(schedule, 2, 4, 2)
    if schedule == "interleaved-1f1b":
        assert plan.stage_ranges == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert inflight_from_schedule(sched)[1::2] == [2, 1]     # the count peak
        assert [plan.stage_inflight[c] for c in (1, 3)] == [3, 0]   # the bytes peak
    for r, states in enumerate(schedule_states(sched)):
        mine = sched.stages_of(r)
        best = 0.0
        for held, pend in states:
            best = max(best, sum(h * sum(c.activation_bytes for c in prof.layers[slice(*plan.stage_ranges[j])])
                                 + q * sum(c.pending_bytes for c in prof.layers[slice(*plan.stage_ranges[j])])
                                 for j, h, q in zip(mine, held, pend)))
        d = plan.rank_memory_breakdown[r]
        base = partition(Profile([dataclasses.replace(c, pending_grad_bytes=0, activation_bytes=0)
                                  for c in prof.layers], meta=prof.meta), 2, schedule=schedule, virtual_stages=2,
                         microbatches=4, zero_stage=0)
        assert base.stage_ranges == plan.stage_ranges
        extra = sum(d.values()) - sum(base.rank_memory_breakdown[r].values())
        assert extra == pytest.approx(best, abs=2)
    limited = partition(prof, 2, schedule=schedule, virtual_stages=2, microbatches=4, zero_stage=0,
                        memory_limit_bytes=max(plan.rank_memory_bytes))
    assert limited.fits and max(limited.rank_memory_bytes) <= max(plan.rank_memory_bytes)


def test_zero2_reduce_cast_meets_the_activations_a_backward_has_freed() -> None:
    """ZeRO-2 with 16-bit buckets: the bucket's flattened copy and its fp32 cast exist only while
    a full bucket (1/d of the rank's gradients) is reduced, when that microbatch's backward has freed 1/d of its
    activations; the peak is the larger of that moment and the one before the reduce."""
    from partitioner.memory import MemorySettings, rank_breakdown

    n, d, act, mb = 1_000_000, 2, 3e6, 2e6       # 3 MB held in all, 2 MB of one microbatch
    mem = MemorySettings(precision="bf16", optimizer="adamw", zero_stage=2, data_parallel=d)
    f = mem.footprint(n, n // 10)
    bucket = n // d
    assert f.reduce_temporary == (2 + 4) * bucket and f.reduce_after == pytest.approx(1 / d)
    assert f.backward_temporary == 2 * bucket + (2 + 4) * bucket   # the bf16 bucket, its flat copy, its cast
    kw = dict(numel=n, largest=n // 10, communication=0.0, workspace=0.0)
    plain = rank_breakdown(mem, activations=act, **kw)
    at = rank_breakdown(mem, activations=act, microbatch_activations=mb, **kw)
    assert at["activations"] == pytest.approx(act - mb / d) and at["temporary"] == plain["temporary"]
    assert sum(at.values()) == pytest.approx(sum(plain.values()) - mb / d)
    # a small microbatch: the moment before the reduce (all activations, no cast) is the peak
    small = rank_breakdown(mem, activations=act, microbatch_activations=1e3, **kw)
    before = sum(plain.values()) - f.reduce_temporary
    assert sum(small.values()) == pytest.approx(max(before, sum(plain.values()) - 1e3 / d))
    # bf16 ZeRO-1 is unchanged (fp32 ZeRO-2's reduce holds its second gradient buffer instead:
    # tests/partitioner/test_memory_terms.py)
    other = MemorySettings(precision="bf16", optimizer="adamw", zero_stage=1, data_parallel=d)
    assert other.footprint(n, n // 10).reduce_temporary == 0.0
    assert rank_breakdown(other, activations=act, microbatch_activations=mb, **kw) == \
        rank_breakdown(other, activations=act, **kw)
