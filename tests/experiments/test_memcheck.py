"""Memory truth: the plan's per-rank peak is what the run uses, measured independently by
torch's MemTracker (experiments.memcheck trains each layout on local ranks)."""
from __future__ import annotations

import pytest

from experiments.memcheck import BASE, GRID, LARGE_VOCAB, SMALL_GRID, Layout, _prepare, layout, measure_layouts, smallest_limit

pytestmark = pytest.mark.slow

TOLERANCE = 0.10   # issue 11: every rank's predicted peak within 10% of the measured one


def test_plan_matches_memtracker_on_several_layouts():
    # interleaved-1f1b is in the small grid (fp32, recomputing) below
    names = (layout(optimizer="sgd").name, layout(precision="bf16", zero=1).name)
    rows = measure_layouts([lay for lay in GRID if lay.name in names], steps=2)
    assert {r["layout"] for r in rows} == set(names) and len(rows) == 2 * len(names)
    for r in rows:
        assert abs(r["error"]) <= TOLERANCE, (r["layout"], r["rank"], r["error"], r["breakdown"],
                                              r["predicted_breakdown"])
    # what the optimizer keeps is counted from the real optimizer: SGD's momentum buffer (4 bytes
    # per parameter), DeepSpeed's fp32 master partition and Adam moments over 2 replicas
    for r in rows:
        got, pred = r["breakdown"]["optimizer_state"], r["predicted_breakdown"]["optimizer_state"]
        assert got == pytest.approx(pred, rel=0.01), r["layout"]
        if r["layout"] == names[0]:
            assert got == 4 * r["numel"]
        if r["layout"] == names[1]:   # bf16 weights, (8 + 4) / 2 state
            assert r["breakdown"]["parameters"] == pytest.approx(2 * r["numel"], rel=0.01)
            assert got == pytest.approx(6 * r["numel"], rel=0.01)


def test_auto_checkpointing_under_a_limit_trains_the_same_within_the_limit():
    """A memory limit just under the smallest that fits without recomputation: with
    activation_checkpointing=auto the plan recomputes on some stages but not all, the run's
    losses equal the unconstrained run's, and every rank's measured peak stays under the limit."""
    from experiments.config import compose_config
    from experiments.models import build_model
    from experiments.wiring import partition_kwargs, profile_model

    cfg = compose_config(*BASE, "pipeline.activation_checkpointing=auto")
    spec = build_model(cfg.model)
    prof, kwargs = profile_model(cfg, spec), partition_kwargs(cfg)
    limit = int(smallest_limit(prof, kwargs, "off") * 0.97)
    free = Layout("free", ())
    auto = Layout("auto", ("pipeline.activation_checkpointing=auto", f"partitioner.memory_limit={limit}B"))
    rows = measure_layouts([free, auto], steps=3)
    by = {(r["layout"], r["rank"]): r for r in rows}
    recompute = by[("auto", 0)]["recompute"]
    assert any(recompute) and not all(recompute), recompute
    assert by[("auto", 1)]["losses"] == pytest.approx(by[("free", 1)]["losses"], rel=1e-6)
    for j in (0, 1):
        assert by[("auto", j)]["measured"] <= limit, (j, by[("auto", j)]["measured"], limit)
    assert max(by[("free", j)]["measured"] for j in (0, 1)) > limit   # the limit did bind


def test_zb_h1_deferred_weight_gradients_are_in_the_plan():
    """zb-h1 keeps, per microbatch between its I and its deferred W, the gradients at every
    weight-owning node: the plan counts them (pending microbatches x the profile's
    pending_grad_bytes, as temporary) and every rank is within 10% of MemTracker's peak
    (it was +41% on the last rank without them)."""
    rows = measure_layouts([layout("zb-h1")], steps=2)
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert abs(r["error"]) <= TOLERANCE, (r["rank"], r["error"], r["breakdown"], r["predicted_breakdown"])
    plan = _prepare(layout("zb-h1"), BASE)["plan"]
    # the counts at each rank's peak moment (partitioner.planner._rank_moments): the last rank
    # peaks with 2 microbatches pending; rank 0 (token ids in: its whole backward is W, freeing
    # as it goes) in a W, 2 held and 1 pending (MemTracker's peak on rank 0 is inside a W too)
    assert plan.stage_pending == [1, 2] and plan.stage_inflight == [2, 2]
    # the last rank's kept gradients are what MemTracker books as temporary (6.9 MiB measured
    # against 0.75 predicted before they were counted)
    last = rows[1]
    assert last["breakdown"]["temporary"] == pytest.approx(last["predicted_breakdown"]["temporary"], rel=0.10)


def test_the_small_grid_is_within_the_bound_on_every_rank():
    """The small grid (bf16 on the analytic profile under zb-h1, fp32 interleaved recomputing,
    DeepSpeed ZeRO-1 over two replicas, zbv, and the large head (vocabulary 32 x dim) under
    zb-h1 on both I/W split paths, DeepSpeed's per-layer cut and the torch backend's node split):
    every rank's plan within 10% of MemTracker's peak less the tensors alive before the step."""
    rows = measure_layouts(SMALL_GRID, steps=2)
    assert {r["layout"] for r in rows} == {lay.name for lay in SMALL_GRID}
    bad = [(r["layout"], r["rank"], round(r["error"], 3)) for r in rows if abs(r["error"]) > TOLERANCE]
    assert not bad, bad


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero2_on_a_second_shape_is_within_the_bound(precision):
    """DeepSpeed ZeRO-2 over two replicas, interleaved (two chunks per rank), with the large head,
    on a narrower, deeper GPT than the grid's (width 64, 6 blocks, vocabulary 64 x width): its
    embedding is larger than the reduce bucket, the first rank's replicas own different
    partitions, each rank's later chunk is back-propagated first, and the loss meets the previous
    backward's buffer. Every rank's largest replica within 10% (the plan of 2026-12-07 before
    these rules: -12.7% and -13.6%)."""
    base = (*BASE, "model.dim=64", "model.layers=6")   # later overrides win
    rows = measure_layouts([layout("interleaved-1f1b", precision, profile="analytic", vocab=LARGE_VOCAB, zero=2)],
                           base, steps=2)
    assert len(rows) == 2
    bad = [(r["rank"], r["replica"], round(r["error"], 3)) for r in rows if abs(r["error"]) > TOLERANCE]
    assert not bad, bad


@pytest.mark.parametrize("case", ["pp2-tp2", pytest.param("tp2-dp2-zero3", marks=pytest.mark.long)])
def test_tensor_parallel_parameters_are_sharded_and_the_plan_is_within_the_bound(case):
    """pp2 x tp2, and one stage of tp2 x dp2 under ZeRO-3 (``long``), on the Hugging Face Llama
    (4 gloo ranks each): every rank's plan within 10% of MemTracker's peak, and the parameter
    bytes each rank holds about 1/tp of its layers' whole tensors (the norms, position table
    and biases of row-parallel projections stay whole), about 1/(tp x dp) with ZeRO-3."""
    from experiments.memcheck import TP_GRID

    zero3 = case == "tp2-dp2-zero3"
    lay = (layout(tp=2, stages=1, zero=3, reshard="false", model="llama") if zero3
           else layout(tp=2, model="llama"))
    rows = measure_layouts([x for x in TP_GRID if x.name == lay.name], steps=2)
    ranks = (0,) if zero3 else (0, 1)
    assert sorted({(r["layout"], r["rank"], r["tp_rank"]) for r in rows}) == sorted(
        [(lay.name, j, t) for j in ranks for t in (0, 1)])
    bad = [(r["rank"], r["tp_rank"], round(r["error"], 3)) for r in rows if abs(r["error"]) > TOLERANCE]
    assert not bad, bad
    for r in rows:
        share = r["shard_bytes"] / r["whole_bytes"]
        if not zero3:
            assert 0.5 <= share <= 0.56, (r["rank"], share)
            assert r["params"] == pytest.approx(r["shard_bytes"], rel=0.01)   # MemTracker: the shards only
        else:   # MemTracker's parameters at the peak: the shards and the tp-local layers FSDP2 gathered
            assert 0.25 <= share <= 0.28, (r["rank"], share)
            pred = r["predicted_breakdown"]
            assert r["params"] == pytest.approx(pred["parameters"] + pred["gathered_parameters"], rel=0.02)


def test_layer_recompute_is_planned_within_the_bound_and_holds_less_than_chunk_recompute():
    """`pipeline.recompute_granularity=layer` (each layer its own checkpoint) against the whole
    chunk checkpointed, on the same split (analytic profile; 8 blocks, so 7 and 3 layers per
    chunk): every rank within the bound, and every rank's measured peak lower."""
    pair = [layout("1f1b", "fp32", profile="analytic", vocab=4096, recompute="on", granularity=g)
            for g in ("chunk", "layer")]
    rows = measure_layouts(pair, (*BASE, "model.layers=8"), steps=2)
    by = {(r["layout"], r["rank"]): r for r in rows}
    assert len(rows) == 4 and rows[0]["stage_ranges"] == rows[-1]["stage_ranges"]
    for r in rows:
        assert abs(r["error"]) <= TOLERANCE, (r["layout"], r["rank"], r["error"])
    for rank in (0, 1):
        assert by[(pair[1].name, rank)]["measured"] < by[(pair[0].name, rank)]["measured"]
