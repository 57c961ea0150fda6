"""The planner's 3-D terms (issue 42 part 4): ZeRO-3 memory and collectives, tensor-parallel
all-reduces, the reshard policy, the 3-D search and per-block checkpointing, in pure numbers."""
from __future__ import annotations

import pytest

from partitioner import LayerCost, Links, PartitionError, Profile, get_device_spec, partition, search_parallel
from partitioner.collectives import megatron_allreduces
from partitioner.recompute import checkpoint_each_layer
from partitioner.search import parallel_layouts

MB = 1 << 20
LINKS = Links(intra_bytes_per_s=100e9, inter_bytes_per_s=10e9, intra_latency_s=0.0, inter_latency_s=0.0,
              efficiency=1.0)


def _profile(n: int = 8, param: int = 40 * MB, act: int = 4 * MB, out: int = MB, tp: int = 1) -> Profile:
    layers = [LayerCost(1e-3, 2e-3, param, act, out, largest_param_bytes=param // 4, workspace_bytes=0)
              for _ in range(n)]
    return Profile(layers, meta={"tensor_parallel": tp} if tp > 1 else {})


def test_zero3_breakdown_shards_over_replicas_and_books_the_gathered_copy():
    prof = _profile()
    for d in (2, 4):
        plan = partition(prof, 2, microbatches=4, data_parallel=d, zero_stage=3, reshard_after_forward=False)
        n = 4 * 40 * MB / 4   # fp32 profile: 4 layers of 10 M elements per rank
        for b in plan.rank_memory_breakdown:
            assert b["parameters"] == pytest.approx(4 * n / d, abs=1)          # fp32 shards
            assert b["gathered_parameters"] == pytest.approx(4 * n, abs=1)     # every layer, fp32 compute
            assert b["gradients"] == pytest.approx(4 * n, abs=1)               # unsharded accumulation
            assert b["optimizer_state"] == pytest.approx(8 * n / d, abs=1)     # AdamW's moments on the shards
        assert plan.reshard_after_forward is False and plan.zero_stage == 3


def test_zero3_bf16_gathers_16_bit_copies_of_fp32_masters():
    prof = Profile([LayerCost(1e-3, 2e-3, 20 * MB, 4 * MB, MB, workspace_bytes=0)] * 4, dtype="bfloat16")
    plan = partition(prof, 2, microbatches=4, data_parallel=4, zero_stage=3, reshard_after_forward=False)
    n = 2 * 20 * MB / 2
    b = plan.rank_memory_breakdown[0]
    assert b["parameters"] == pytest.approx(4 * n / 4, abs=1) and b["gathered_parameters"] == pytest.approx(2 * n, abs=1)


def test_reshard_is_chosen_only_when_the_layers_kept_gathered_do_not_fit():
    prof = _profile(n=8, param=40 * MB, act=MB)
    kw = dict(schedule="interleaved-1f1b", virtual_stages=2, microbatches=4, data_parallel=4, zero_stage=3)
    free = partition(prof, 2, **kw)
    assert free.reshard_after_forward is False
    kept = max(free.rank_memory_bytes)
    both = partition(prof, 2, **kw, reshard_after_forward=True)
    assert max(both.rank_memory_bytes) < kept     # one chunk of two gathered at the peak
    tight = partition(prof, 2, **kw, memory_limit_bytes=(kept + max(both.rank_memory_bytes)) / 2)
    assert tight.reshard_after_forward is True and tight.fits
    assert any("reshard_after_forward=true" in n for n in tight.notes)


def test_reshard_policy_needs_zero3_and_tp_needs_a_tp_profile():
    with pytest.raises(ValueError, match="ZeRO-3"):
        partition(_profile(), 2, microbatches=4, zero_stage=1, reshard_after_forward=True)
    with pytest.raises(ValueError, match="tp-sharded shapes"):
        partition(_profile(), 2, microbatches=4, tensor_parallel=2)


def test_tensor_parallel_all_reduces_add_to_forward_and_backward():
    assert megatron_allreduces(4) == [(1, 0), (2, 2), (2, 2), (0, 1)]
    prof = _profile(n=4, tp=4)
    base = partition(_profile(n=4), 2, microbatches=4, simulate=False)
    plan = partition(prof, 2, microbatches=4, tensor_parallel=4, links=LINKS, simulate=False)
    ar = 2 * 3 / 4 * MB / 100e9   # one ring all-reduce of a 1 MiB activation over 4 ranks
    assert plan.stage_forward_s[0] - base.stage_forward_s[0] == pytest.approx(3 * ar)   # embedding 1 + block 2
    assert plan.stage_backward_s[1] - base.stage_backward_s[1] == pytest.approx(3 * ar)   # block 2 + head 1
    assert plan.tensor_parallel == 4


def test_zero3_collectives_per_step_and_per_action():
    prof = _profile(n=4)
    kw = dict(microbatches=4, data_parallel=4, zero_stage=3, links=LINKS)
    kept = partition(prof, 2, **kw, reshard_after_forward=False)
    n = 40 * MB / 4
    rs = 3 / 4 * 4 * n / 10e9           # reduce-scatter of one layer's fp32 gradient
    ag = 3 / 4 * 4 * n / 10e9           # all-gather of one layer's fp32 (compute dtype) copy
    # per rank: 2 layers' reduce-scatters, the first layer's gather in full, the second's beyond the
    # first's forward (1 ms)
    assert kept.rank_collective_s == pytest.approx([2 * rs + ag + max(0.0, ag - 1e-3)] * 2)
    again = partition(prof, 2, **kw, reshard_after_forward=True)
    assert again.rank_collective_s == pytest.approx([2 * rs + 2 * 4 * ag] * 2)   # first layer per action
    assert again.step_s > kept.step_s
    for zero in (0, 1):   # the replicas' gradient reduction (ZeRO-1: + the updated weights' all-gather)
        whole = partition(prof, 2, microbatches=4, data_parallel=4, zero_stage=zero, links=LINKS)
        assert whole.rank_collective_s == pytest.approx([2 * 2 * rs] * 2)
    none = partition(prof, 2, microbatches=4, data_parallel=4, zero_stage=3, reshard_after_forward=False)
    assert none.rank_collective_s == [0.0, 0.0] and any("no links" in x for x in none.notes)


def test_device_presets_carry_link_rates():
    h100 = get_device_spec("h100").links
    assert (h100.intra_bytes_per_s, h100.inter_bytes_per_s) == (450e9, 50e9)
    assert get_device_spec("a100-kernels").links.inter_bytes_per_s == 25e9
    assert LINKS.all_reduce(8e9, 8, "intra") == pytest.approx(0.14)
    with pytest.raises(ValueError, match="intra"):
        LINKS.all_gather(1.0, 2, "nvlink")


def test_search_parallel_ranks_every_triple_and_records_the_choice():
    def profiles(tp: int):   # one tp rank (parameters and compute / tp), at each microbatch size
        return lambda size: Profile([LayerCost(1e-3 * size / tp, 2e-3 * size / tp, 40 * MB // tp, MB * size,
                                               MB * size // 4, workspace_bytes=0) for _ in range(8)],
                                    meta={"tensor_parallel": tp} if tp > 1 else {})

    assert parallel_layouts(4, 16, [1, 2, 4], [1, 3]) == [(1, 4, 1), (1, 4, 3), (2, 2, 1), (2, 2, 3), (4, 1, 0)]
    res = search_parallel(profiles, 2, 16, 4, tensor_parallel=[1, 2, 4], zero_stages=[1, 3],
                          schedules=["1f1b"], microbatches=[4], links=LINKS)
    triples = {(c.data_parallel, c.tensor_parallel, c.zero_stage) for c in res.candidates}
    assert triples == {(4, 1, 1), (4, 1, 3), (2, 2, 1), (2, 2, 3), (1, 4, 0)}
    best = min((c for c in res.candidates if c.status == "ok"), key=lambda c: c.step_s)
    assert res.plan.step_s == best.step_s and res.plan.tensor_parallel == best.tensor_parallel
    assert res.plan.search["chosen"]["tensor_parallel"] == best.tensor_parallel
    assert "dp x tp" in res.table()
    limit = min(c.peak_memory_bytes for c in res.candidates if c.status == "ok")
    tight = search_parallel(profiles, 2, 16, 4, tensor_parallel=[1, 2, 4],
                            zero_stages=[1, 3], schedules=["1f1b"], microbatches=[4], links=LINKS,
                            memory_limit_bytes=limit, activation_checkpointing=False)
    assert max(tight.plan.rank_memory_bytes) <= limit
    with pytest.raises(PartitionError, match="no 3-D layout"):
        search_parallel(profiles, 2, 16, 4, tensor_parallel=[1, 2], zero_stages=[1],
                        schedules=["1f1b"], microbatches=[4], memory_limit_bytes=MB, activation_checkpointing=False)


def test_per_block_checkpointing_holds_less_than_chunk_checkpointing():
    prof = _profile(n=10, param=MB, act=40 * MB, out=MB)
    chunk = partition(prof, 2, microbatches=4, activation_checkpointing=True)
    block = partition(checkpoint_each_layer(prof, range(10)), 2, microbatches=4)
    assert max(block.rank_memory_bytes) < max(chunk.rank_memory_bytes)
    assert block.step_s == pytest.approx(chunk.step_s, rel=1e-6)   # both run each forward twice
    with pytest.raises(ValueError, match="not in the profile"):
        checkpoint_each_layer(prof, [10])


def test_cores_are_shared_by_every_replica_and_tp_rank_of_a_pipeline():
    """A CPU machine's cores (``FixedCosts.cores``) over dp x tp: what one simulated pipeline rank
    gets; fewer than its ranks and the step is time-shared (longer)."""
    import dataclasses

    from partitioner import FixedCosts

    def plan(cores, tp, dp):
        prof = dataclasses.replace(_profile(tp=tp), fixed=FixedCosts(cores=cores))
        return partition(prof, 2, microbatches=4, tensor_parallel=tp, data_parallel=dp, zero_stage=0)

    assert plan(8, 2, 2).shared_cores == 2.0 and plan(4, 2, 1).shared_cores == 2.0
    assert plan(2, 2, 1).shared_cores == 1.0 and plan(None, 2, 1).shared_cores is None
    assert plan(2, 2, 1).step_s > plan(4, 2, 1).step_s == plan(None, 2, 1).step_s


def test_fit_links_recovers_the_latency_and_rate_of_measured_collectives():
    """`fit_links` on plain numbers: collectives timed as ``latency + ring bytes / rate`` (every
    kind, 2 and 4 ranks) give back the latency and the rate; flat times a latency only; fewer than
    two sizes are refused."""
    from partitioner.collectives import COLLECTIVES, fit_links, ring_factor

    lat, rate = 3e-4, 8e8
    pts = [(k, n, b, lat + ring_factor(k, n) * b / rate) for k in COLLECTIVES for n in (2, 4)
           for b in (4096, 65536, 524288, 2 << 20)]
    links = fit_links(pts)
    assert links.intra_latency_s == pytest.approx(lat, rel=1e-6) and links.inter_latency_s == pytest.approx(lat, rel=1e-6)
    assert links.intra_bytes_per_s == pytest.approx(rate, rel=1e-6) and links.inter_bytes_per_s == pytest.approx(rate, rel=1e-6)
    assert links.all_reduce(524288, 2, "intra") == pytest.approx(lat + 524288 / rate)
    with pytest.raises(ValueError, match="two sizes"):
        fit_links([("all_reduce", 2, 4096, 1e-3)] * 3)
    flat = fit_links([("all_reduce", 2, 4096, 2e-3), ("all_reduce", 2, 1 << 20, 2e-3)])
    assert flat.intra_latency_s == pytest.approx(2e-3) and flat.intra_bytes_per_s >= 1e14   # latency only
