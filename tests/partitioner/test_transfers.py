"""Pipeline transfers in a plan (partitioner.transfers): the device spec's NVLink or NIC by whether
two neighbouring pipeline ranks share a node, an explicit rate winning, and the exact split with a
cut time per stage."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from partitioner import LayerCost, Profile, get_device_spec, partition
from partitioner.collectives import pipeline_hops
from partitioner.solve import optimal_split

OUT = 1 << 24   # 16 MiB per message
# The a100 preset's figures written out from their sources (docs/device-model.md, "Collectives"):
# NVLink3 600 GB/s bidirectional per GPU, one direction; one ConnectX-6 HDR 200 Gb/s NIC per GPU
# (DGX A100); latencies 25 us (NCCL, 8 GPUs) and 30 us (assumed); 8 GPUs per DGX A100 node.
NVLINK, NIC, NVLINK_LAT, NIC_LAT, NODE = 600e9 / 2, 200e9 / 8, 25e-6, 30e-6, 8


def _profile(n: int = 16) -> Profile:
    return Profile([LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=1 << 20, activation_bytes=1 << 22,
                              output_bytes=OUT, name="L")] * n)


def _links(**overrides):  # noqa: ANN202
    return replace(get_device_spec("a100"), **overrides).links


def test_a_gpu_preset_plan_charges_every_transfer_from_the_spec():
    plan = partition(_profile(), 4, microbatches=8, links=_links())
    assert plan.link_source == "device_spec"
    assert plan.boundary_links == ["device_spec intra-node"] * 3
    assert all(c > 0 for c in plan.boundary_comm_s)
    free = partition(_profile(), 4, microbatches=8)
    assert free.link_source == "free" and free.boundary_comm_s == [0.0] * 3
    assert plan.step_s > free.step_s


def test_the_plan_figures_are_bytes_over_the_datasheet_rate_plus_latency():
    # 16 stages of 8 GPUs per node: boundary 7 (rank 7 -> rank 8) crosses nodes, the others do not
    plan = partition(_profile(), 16, microbatches=16, links=_links())
    intra = OUT / NVLINK + NVLINK_LAT     # 16777216 / 300e9 + 25e-6 = 80.92 us
    inter = OUT / NIC + NIC_LAT           # 16777216 / 25e9 + 30e-6 = 701.09 us
    want = [inter if j == 7 else intra for j in range(15)]
    assert plan.boundary_comm_s == pytest.approx(want, rel=1e-12)
    assert plan.boundary_links[7] == "device_spec inter-node" and plan.boundary_links.count("device_spec intra-node") == 14
    assert plan.link_bytes_per_s == NIC   # the slowest boundary's rate
    assert inter > 8 * intra
    assert any("boundaries [7] cross nodes" in n for n in plan.notes)


def test_crossing_nodes_costs_more_than_staying_within_one():
    prof = _profile()
    inside = partition(prof, 4, microbatches=8, links=_links())                   # 4 ranks on one node
    apart = partition(prof, 4, microbatches=8, links=_links(gpus_per_node=1))     # a node per rank
    assert apart.boundary_links == ["device_spec inter-node"] * 3
    assert min(apart.boundary_comm_s) > max(inside.boundary_comm_s)
    assert apart.step_s > inside.step_s


def test_an_explicit_link_wins_over_the_spec():
    plan = partition(_profile(), 16, microbatches=16, links=_links(), link_bytes_per_s=1e9)
    assert plan.link_source == "config" and plan.boundary_links == [] and plan.link_bytes_per_s == 1e9
    assert plan.boundary_comm_s == pytest.approx([OUT / 1e9] * 15, rel=1e-12)


def test_a_spec_without_a_node_size_prices_nothing_from_it():
    plan = partition(_profile(), 4, microbatches=8, links=_links(gpus_per_node=None))
    assert plan.link_source == "free" and plan.boundary_comm_s == [0.0] * 3


def test_replicas_and_tensor_parallel_ranks_decide_the_crossings():
    # engine.mesh: rank = (replica * p + pipeline_rank) * tp + tp_rank
    assert pipeline_hops([0, 1, 2], 3, 1, 1, 4) == ["intra", "intra"]
    assert pipeline_hops([0, 1, 2], 3, 2, 1, 4) == ["inter", "intra"]        # replica 1: ranks 3 | 4, 5
    assert pipeline_hops([0, 1, 2, 3], 4, 1, 2, 4) == ["intra", "inter", "intra"]  # tp pairs: 0-1, 2-3 | 4-5, 6-7
    # interleaved (loop placement): chunk 3 on rank 3 hands to chunk 4 on rank 0, the same node
    assert pipeline_hops([0, 1, 2, 3, 0, 1, 2, 3], 4, 1, 1, 8) == ["intra"] * 7
    assert pipeline_hops([0, 1, 2, 3, 0, 1, 2, 3], 4, 1, 1, 2) == ["intra", "inter", "intra", "inter", "intra",
                                                                    "inter", "intra"]


def test_a_v_turn_stays_on_its_rank_and_the_plan_simulates_what_it_charges():
    plan = partition(_profile(12), 2, schedule="zbv", virtual_stages=2, microbatches=8, links=_links(gpus_per_node=1))
    assert plan.boundary_links == ["device_spec inter-node", "on rank", "device_spec inter-node"]
    assert plan.step_s == pytest.approx(plan.predicted_step_s(plan.simulate()), rel=1e-12)


def _brute_force(time, k, cut_rows, static, cap):  # noqa: ANN001, ANN202
    n = len(time)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        stages = list(zip(edges[:-1], edges[1:]))
        if any(static[s:e].sum() > cap for s, e in stages):
            continue
        best = min(best, max(time[s:e].sum() + cut_rows[j][e] for j, (s, e) in enumerate(stages)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_exact_split_with_a_cut_time_per_stage_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    n, k = 10, 4
    time = rng.uniform(1.0, 3.0, n)
    static = rng.uniform(1.0, 2.0, n)
    cheap, dear = np.zeros(n + 1), np.zeros(n + 1)
    cheap[1:n] = rng.uniform(0.0, 0.2, n - 1)
    dear[1:n] = cheap[1:n] * 10
    cut = np.stack([cheap, dear, cheap, np.zeros(n + 1)])    # stage 1's outgoing link is the slow one
    cap = 6.0
    bounds, b = optimal_split(time, k, cut_time=cut, static=static, caps=cap)
    assert b == pytest.approx(_brute_force(time, k, cut, static, cap), rel=1e-12)
    assert max(time[s:e].sum() + cut[j][e] for j, (s, e) in enumerate(bounds)) == pytest.approx(b, rel=1e-12)


def test_replicas_that_cross_at_different_boundaries_are_charged_at_the_worst_and_the_plan_says_so():
    # 3 stages x 2 replicas on nodes of 4: replica 0 is ranks 0, 1, 2 (one node), replica 1 is 3 | 4, 5
    plan = partition(_profile(12), 3, microbatches=6, data_parallel=2, links=_links(gpus_per_node=4))
    assert plan.boundary_links == ["device_spec inter-node", "device_spec intra-node"]
    assert any("an upper bound on the step" in n for n in plan.notes)
    even = partition(_profile(12), 4, microbatches=6, data_parallel=2, links=_links(gpus_per_node=4))
    assert not any("an upper bound" in n for n in even.notes)


def _v_brute_force(time, p, cut_rows):  # noqa: ANN001, ANN202
    n, k = len(time), 2 * p
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        t = [time[s:e].sum() + (0.0 if j == p - 1 else cut_rows[j][e])   # the V's turn stays on its rank
             for j, (s, e) in enumerate(zip(edges[:-1], edges[1:]))]
        best = min(best, max(t[r] + t[k - 1 - r] for r in range(p)))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_exact_v_split_with_a_cut_time_per_chunk_is_the_brute_force_optimum(seed):
    from partitioner.vsplit import optimal_v_split

    rng = np.random.default_rng(seed)
    n, p = 9, 2
    time = rng.uniform(1.0, 3.0, n)
    cheap = np.concatenate([[0.0], rng.uniform(0.0, 0.3, n - 1), [0.0]])
    cut = np.stack([cheap * 10, np.zeros(n + 1), cheap, np.zeros(n + 1)])   # chunk 0's link is the slow one
    _, b = optimal_v_split(time, p, cut_time=cut)
    assert b == pytest.approx(_v_brute_force(time, p, cut), rel=1e-12)
