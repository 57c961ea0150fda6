"""partitioner.search also chooses sequence parallelism and the recompute granularity
(``sequence_parallel="auto"``, ``recompute_granularity="auto"``), on plain numbers: under a memory
limit only one of them meets, the search finds it, records it in the plan, and an explicit
setting is kept."""

from __future__ import annotations

import pytest

from partitioner import LayerCost, PartitionError, Profile, partition, search
from partitioner.plan import format_search
from partitioner.recompute import checkpoint_each_layer, sequence_parallel_profile
from partitioner.search import granularity_choices, sequence_parallel_choices

ONE = dict(schedules=["1f1b"], microbatches=4)   # one layout: the choice is SP / granularity alone


def _tp2(act: int, out: int, n: int = 8) -> Profile:
    """One tp rank's profile of ``n`` equal layers (tp = 2), the residual stream whole."""
    return Profile([LayerCost(1e-3, 2e-3, 1 << 16, act, out)] * n, meta={"tensor_parallel": 2})


def _peak(prof: Profile, **kw) -> int:
    return max(partition(prof, 2, schedule="1f1b", microbatches=4, tensor_parallel=2, **kw).rank_memory_bytes)


def test_choices():
    assert granularity_choices("auto", "auto") == ["chunk", "layer"]
    assert granularity_choices("auto", "off") == ["chunk"]   # nothing recomputes: one granularity
    assert sequence_parallel_choices("auto", 2) == [False, True] and sequence_parallel_choices("auto", 1) == [False]
    with pytest.raises(ValueError, match="'auto'"):
        sequence_parallel_choices("sometimes", 2)


def test_only_sequence_parallelism_fits_and_auto_finds_it():
    """Activations of three residual streams per layer, two of them saved by the norms: sequence
    parallelism over 2 ranks takes each layer's activations from 3 to 1 stream and halves what
    crosses a cut. The limit is the SP plan's peak; no plan without SP fits it."""
    prof = _tp2(act=3 << 20, out=1 << 20)
    limit = _peak(sequence_parallel_profile(prof, 2))
    kw = dict(ONE, tensor_parallel=2, memory_limit_bytes=limit, activation_checkpointing=False)
    with pytest.raises(PartitionError):   # the premise: without SP nothing fits
        search(prof, 2, 16, **kw)
    res = search(prof, 2, 16, sequence_parallel="auto", **kw)
    assert res.plan.sequence_parallel and res.chosen.sequence_parallel and max(res.plan.rank_memory_bytes) <= limit
    assert res.chosen.label.endswith(" sp")
    twin = [c for c in res.candidates if not c.sequence_parallel]
    assert twin and all(c.status == "infeasible" for c in twin)
    assert "SP" in format_search(res.plan.search)
    assert search(prof, 2, 16, sequence_parallel=True, **kw).plan.sequence_parallel   # explicit: kept


def test_explicit_sequence_parallel_setting_is_kept_where_both_fit():
    prof = _tp2(act=3 << 20, out=1 << 20)
    kw = dict(ONE, tensor_parallel=2, memory_limit_bytes=1 << 40)
    assert search(prof, 2, 16, sequence_parallel="auto", **kw).plan.sequence_parallel   # less to send: faster
    assert not search(prof, 2, 16, sequence_parallel=False, **kw).plan.sequence_parallel
    assert not search(prof, 2, 16, **kw).plan.sequence_parallel   # the default: as the profile is
    # one tp rank has no sequence to split
    one = Profile(prof.layers)
    assert not search(one, 2, 16, **dict(ONE, sequence_parallel="auto")).plan.sequence_parallel


def test_only_per_layer_recompute_fits_and_auto_finds_it():
    """Layers whose activations are 100x their output: a chunk recomputed whole has every
    layer's activations in its backward at once; layer by layer it keeps each layer's input per
    microbatch and one layer's activations. The limit is the per-layer plan's peak; the whole-chunk
    checkpoints do not fit it."""
    prof = Profile([LayerCost(1e-3, 2e-3, 1 << 16, 100 << 20, 1 << 20)] * 8)
    limit = max(partition(prof, 2, schedule="1f1b", microbatches=4, activation_checkpointing=True,
                          recompute_granularity="layer").rank_memory_bytes)
    for ckpt in (True, "auto"):
        kw = dict(ONE, memory_limit_bytes=limit, activation_checkpointing=ckpt)
        with pytest.raises(PartitionError):   # the premise: chunk checkpoints do not fit
            search(prof, 2, 16, **kw)
        res = search(prof, 2, 16, recompute_granularity="auto", **kw)
        assert res.plan.recompute_granularity == "layer" and any(res.plan.stage_recompute)
        assert res.chosen.label.endswith(" per-layer") and "per-layer" in res.table()
        assert search(prof, 2, 16, recompute_granularity="layer", **kw).plan.recompute_granularity == "layer"


def test_chunk_checkpoints_kept_where_they_fit_and_no_duplicate_rows():
    """Where nothing needs to recompute, the per-layer twin is the same plan: not listed as a
    second choice. An explicit granularity is kept."""
    prof = Profile([LayerCost(1e-3, 2e-3, 1 << 16, 100 << 20, 1 << 20)] * 8)
    kw = dict(ONE, memory_limit_bytes=1 << 40, activation_checkpointing="auto")
    res = search(prof, 2, 16, recompute_granularity="auto", **kw)
    assert res.plan.recompute_granularity == "chunk" and not any(res.plan.stage_recompute)
    assert [c.status for c in res.candidates] == ["ok", "skipped"]
    everywhere = dict(kw, activation_checkpointing=True)
    assert search(prof, 2, 16, recompute_granularity="chunk", **everywhere).plan.recompute_granularity == "chunk"


def test_sequence_parallelism_is_divided_once():
    prof = _tp2(act=3 << 20, out=1 << 20)
    sp = sequence_parallel_profile(prof, 2)
    with pytest.raises(ValueError, match="already planned under sequence parallelism"):
        sequence_parallel_profile(sp, 2)
    with pytest.raises(ValueError, match="already planned under sequence parallelism"):
        search(sp, 2, 16, sequence_parallel=True, **ONE, tensor_parallel=2)
    # per-layer checkpoints of an SP profile hold each block's input once divided by tp
    held = checkpoint_each_layer(sp).layers[1].activation_bytes
    assert held == sp.layers[0].output_bytes == prof.layers[0].output_bytes // 2
