"""The collectives' links of the 3-D layout (partitioner.collectives.group_link): a tp or dp group
runs on NVLink when it lies within one node of consecutive ranks, on the NIC when it spans nodes,
and the plan charges its collectives on that link."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from partitioner import LayerCost, Profile, get_device_spec, partition
from partitioner.collectives import group_link

MB = 1 << 20
# The a100 preset's figures written out from their sources (docs/device-model.md, "Collectives"):
# NVLink3 600 GB/s bidirectional per GPU, one direction; one ConnectX-6 HDR 200 Gb/s NIC per GPU;
# latencies 25 us (NCCL, 8 GPUs) and 30 us (assumed); a ring collective reaches 0.8 of the rate.
NVLINK, NIC, NVLINK_LAT, NIC_LAT, EFF = 600e9 / 2, 200e9 / 8, 25e-6, 30e-6, 0.8


def _groups(kind: str, p: int, d: int, t: int) -> list[list[int]]:
    """Every group of ``kind`` as lists of global ranks, enumerated from the ranks themselves:
    each rank decomposed as ``engine.mesh.Mesh`` does (``tp_rank`` innermost, then the pipeline
    rank, the replica outermost), grouped by what its group shares."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank in range(p * d * t):
        rest, q = divmod(rank, t)
        replica, s = divmod(rest, p)
        groups.setdefault((replica, s) if kind == "tp" else (s, q), []).append(rank)
    return list(groups.values())


def _explicit(kind: str, p: int, d: int, t: int, g: int) -> str:
    within = all(len({r // g for r in group}) == 1 for group in _groups(kind, p, d, t))
    return "intra" if within else "inter"


def test_group_link_matches_an_enumeration_of_the_mesh_ranks():
    seen = set()
    for kind, p, d, t, g in itertools.product(("tp", "dp"), (1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4),
                                              (1, 2, 3, 4, 6, 8, 16)):
        got = group_link(kind, p, d, t, g)
        assert got == _explicit(kind, p, d, t, g), (kind, p, d, t, g)
        seen.add((kind, got))
    assert seen == {(k, link) for k in ("tp", "dp") for link in ("intra", "inter")}   # both answers occur


@pytest.mark.parametrize("kind, p, d, t, g, want", [
    ("dp", 2, 4, 1, 8, "intra"),    # pp 2 x dp 4 on one 8-GPU node: the whole dp group on NVLink
    ("dp", 8, 8, 8, 8, "inter"),    # the 405B layout: each replica is 8 nodes
    ("tp", 8, 8, 8, 8, "intra"),    # tp 8 is one node's 8 GPUs
    ("tp", 1, 1, 16, 8, "inter"),   # tp 16 crosses nodes
    ("tp", 3, 1, 2, 3, "inter"),    # ranks 2, 3 of tp group 1 sit on nodes 0 and 1
    ("dp", 1, 8, 1, 8, "intra"),    # FSDP over one node's 8 GPUs (torchtitan's Table 1)
    ("dp", 1, 2, 1, 1, "inter"),    # one GPU per node
    ("tp", 1, 1, 1, 1, "intra"),    # a group of one rank never leaves it
])
def test_group_link_cases(kind, p, d, t, g, want):
    assert group_link(kind, p, d, t, g) == want


def test_without_a_node_size_tp_is_intra_and_dp_inter():
    for p, d, t in itertools.product((1, 2, 8), repeat=3):
        assert group_link("tp", p, d, t, None) == "intra"
        assert group_link("dp", p, d, t, None) == "inter"


def test_group_link_refuses_bad_arguments():
    with pytest.raises(ValueError, match="use one of"):
        group_link("pp", 2, 2, 2, 8)
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        group_link("dp", 2, 2, 1, 0)
    with pytest.raises(ValueError, match=">= 1"):
        group_link("dp", 0, 2, 1, 8)


def _profile() -> Profile:
    return Profile([LayerCost(1e-3, 2e-3, 40 * MB, 4 * MB, MB, workspace_bytes=0) for _ in range(8)])


def _dp_plan(gpus_per_node: int, tp: int = 1):  # noqa: ANN202
    links = replace(get_device_spec("a100"), gpus_per_node=gpus_per_node).links
    prof = _profile() if tp == 1 else replace(_profile(), meta={"tensor_parallel": tp})
    return partition(prof, 2, microbatches=4, data_parallel=4, zero_stage=0, tensor_parallel=tp, links=links,
                     method="uniform")


def test_a_dp_group_within_one_node_is_charged_on_nvlink():
    # pp 2 x dp 4 x tp 1: ranks d * 2 + s, all 8 on one node of 8; each on its own node with 1
    inside, apart = _dp_plan(8), _dp_plan(1)
    assert [r[1] - r[0] for r in inside.stage_ranges] == [4, 4]
    grad = 4.0 * 40 * MB / 4                           # one layer's fp32 gradient: 10 Mi elements x 4 B
    ring = 2 * 3 / 4 * grad                            # ring all-reduce over 4 replicas: 2 (n-1)/n of it
    nvlink = 4 * (NVLINK_LAT + ring / (NVLINK * EFF))  # 4 layers per rank: 4 x 287.144 us
    nic = 4 * (NIC_LAT + ring / (NIC * EFF))           # 4 x 3175.728 us
    assert inside.rank_collective_s == pytest.approx([nvlink] * 2, rel=1e-12)
    assert apart.rank_collective_s == pytest.approx([nic] * 2, rel=1e-12)
    assert nvlink == pytest.approx(1.148576e-3) and nic == pytest.approx(12.702912e-3)
    assert inside.step_s < apart.step_s
    assert any("data-parallel on the intra-node link (8 GPUs per node" in n for n in inside.notes)
    assert any("data-parallel on the inter-node link (1 GPU per node" in n for n in apart.notes)


def test_a_tp_group_spanning_nodes_is_charged_on_the_nic():
    # tp 4 on nodes of 2 GPUs: every tp group spans two nodes; on nodes of 8 it stays on one
    one, two = _dp_plan(8, tp=4), _dp_plan(2, tp=4)
    ar_nvlink = NVLINK_LAT + 2 * 3 / 4 * MB / (NVLINK * EFF)   # one all-reduce of a 1 MiB activation
    ar_nic = NIC_LAT + 2 * 3 / 4 * MB / (NIC * EFF)
    base = _dp_plan(8)
    # stage 0 of the uniform split holds 4 layers: megatron_allreduces(8) forward 1 + 2 + 2 + 2
    assert one.stage_forward_s[0] - base.stage_forward_s[0] == pytest.approx(7 * ar_nvlink, rel=1e-9)
    assert two.stage_forward_s[0] - base.stage_forward_s[0] == pytest.approx(7 * ar_nic, rel=1e-9)
    assert any("tensor-parallel on the inter-node link" in n for n in two.notes)
