"""Recompute granularity in the planner: a chunk recomputing layer by layer
(``recompute_granularity="layer"``, as ``engine.stage`` runs it) is priced by the one per-layer
rule of :func:`partitioner.recompute.checkpoint_each_layer`, in pure numbers."""
from __future__ import annotations

import pytest

from partitioner import LayerCost, PartitionError, Profile, partition
from partitioner.recompute import checkpoint_each_layer

MB = 1 << 20


def _profile(n: int = 10) -> Profile:
    # activations large against the parameters: where recomputation pays
    return Profile([LayerCost(1e-3, 2e-3, MB, 40 * MB, MB, largest_param_bytes=MB // 4, workspace_bytes=2 * MB)
                    for _ in range(n)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layer_recompute_is_the_per_layer_rule(schedule):
    """With a whole backward, every chunk recomputing layer by layer is exactly the profile with
    each layer checkpointed on its own (its input kept; its activations and workspace its
    backward's transient; its backward longer by its forward) planned without recomputation."""
    prof = _profile()
    layer = partition(prof, 2, schedule=schedule, microbatches=4, activation_checkpointing=True,
                      recompute_granularity="layer")
    rule = partition(checkpoint_each_layer(prof, range(len(prof))), 2, schedule=schedule, microbatches=4)
    assert layer.stage_ranges == rule.stage_ranges
    assert layer.rank_memory_bytes == rule.rank_memory_bytes
    assert layer.rank_memory_breakdown == rule.rank_memory_breakdown
    assert layer.step_s == pytest.approx(rule.step_s, rel=1e-12)
    assert layer.recompute_granularity == "layer" and all(layer.stage_recompute)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zb-h1", 1), ("zbv", 2), ("interleaved-1f1b", 2)])
def test_layer_recompute_peaks_below_chunk_recompute_at_the_same_time(schedule, v):
    prof = _profile(12)
    kw = dict(schedule=schedule, microbatches=4, virtual_stages=v, activation_checkpointing=True)
    chunk = partition(prof, 2, **kw)
    layer = partition(prof, 2, **kw, recompute_granularity="layer")
    assert max(layer.rank_memory_bytes) < max(chunk.rank_memory_bytes)
    assert layer.step_s == pytest.approx(chunk.step_s, rel=1e-9)   # both run each forward twice
    # a recomputing chunk runs one whole backward at I: nothing pending between I and W
    assert not any(layer.stage_pending) and chunk.recompute_granularity == "chunk"
    assert " RL" in layer.summary() and " RL" not in chunk.summary()


def test_auto_recomputes_layer_by_layer_under_a_limit_chunk_recompute_misses():
    prof = _profile(12)
    kw = dict(microbatches=4, activation_checkpointing=True)
    layer_peak = max(partition(prof, 2, **kw, recompute_granularity="layer").rank_memory_bytes)
    chunk_peak = max(partition(prof, 2, **kw).rank_memory_bytes)
    limit = (layer_peak + chunk_peak) / 2
    with pytest.raises(PartitionError):
        partition(prof, 2, microbatches=4, activation_checkpointing="auto", memory_limit_bytes=limit)
    plan = partition(prof, 2, microbatches=4, activation_checkpointing="auto", memory_limit_bytes=limit,
                     recompute_granularity="layer")
    assert any(plan.stage_recompute) and max(plan.rank_memory_bytes) <= limit


def test_granularity_without_recompute_changes_nothing_and_bad_values_are_refused():
    prof = _profile()
    off = [partition(prof, 2, microbatches=4, recompute_granularity=g) for g in ("chunk", "layer")]
    assert off[0].rank_memory_bytes == off[1].rank_memory_bytes and off[0].step_s == off[1].step_s
    with pytest.raises(ValueError, match="'chunk'.*'layer'"):
        partition(prof, 2, microbatches=4, recompute_granularity="block")
