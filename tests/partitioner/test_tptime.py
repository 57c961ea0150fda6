"""partitioner.tptime: tensor-parallel layers timed as DTensor over a real gloo tp group (the
rank's compute, without the collectives), and the planner charging the tp collectives once on top."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from _layers import TpMLP
from partitioner import LayerCost, Links, Profile, partition, profile
from partitioner.tptime import measure_tp_times, with_tp_times

MB = 1 << 20
LINKS = Links(intra_bytes_per_s=100e9, inter_bytes_per_s=10e9, efficiency=1.0)


def _plain_shard(dim: int, hidden: int) -> TpMLP:
    from engine.tp import shard_shapes

    return shard_shapes(TpMLP(dim, hidden), 2)


def test_a_tp2_profile_of_a_tiny_block_is_timed_as_dtensor_and_dearer_than_its_plain_shapes():
    """Two tiny MLP blocks sharded with the engine's ``parallelize_layer`` on 2 gloo ranks: every
    figure is measured (the second block, whose input needs a gradient, with its split I / W),
    and each block's forward + backward costs more CPU than the same tp rank's shapes as plain
    modules (DTensor's dispatch and redistribution); the bytes stay the plain shapes'."""
    x = torch.randn(2, 8, 32)
    whole = [functools.partial(TpMLP, 32, 64)] * 2
    times = measure_tp_times(whole, x, 2, repeats=3, warmup=1, min_time_s=0.0)
    plain = profile([functools.partial(_plain_shard, 32, 64)] * 2, x, mode="measure", repeats=3,
                    warmup=1, min_time_s=0.0)
    assert len(times) == 2
    assert times[0]["input_grad_s"] is None and times[0]["weight_grad_s"] == times[0]["backward_s"]
    assert times[1]["input_grad_s"] > 0 and times[1]["weight_grad_s"] > 0
    for t, c in zip(times, plain.layers):
        assert t["forward_s"] + t["backward_s"] > 3 * (c.forward_s + c.backward_s), (t, c)   # about 9x here
    timed = with_tp_times(dataclasses.replace(plain, meta={**plain.meta, "tensor_parallel": 2}), times, 2)
    assert timed.meta["tp_time"] == "dtensor" and "tp_time" not in plain.meta
    assert [(c.param_bytes, c.activation_bytes, c.output_bytes) for c in timed.layers] == \
        [(c.param_bytes, c.activation_bytes, c.output_bytes) for c in plain.layers]
    assert timed.layers[1].forward_s == times[1]["forward_s"]


def test_measure_tp_times_refuses_one_rank_and_a_loss_without_target():
    with pytest.raises(ValueError, match="tensor_parallel >= 2"):
        measure_tp_times([TpMLP(4, 8)], torch.randn(1, 4), 1)
    with pytest.raises(ValueError, match="go together"):
        measure_tp_times([TpMLP(4, 8)], torch.randn(1, 4), 2, loss_fn=torch.sum)


def _profile(tp_time: str | None) -> Profile:
    layers = [LayerCost(1e-3, 2e-3, 40 * MB, 4 * MB, MB, workspace_bytes=0) for _ in range(4)]
    meta = {"tensor_parallel": 4, **({"tp_time": tp_time} if tp_time else {})}
    return Profile(layers, meta=meta)


def test_a_dtensor_timed_profile_is_charged_the_tp_all_reduces_once():
    """The same numbers: the layers' times are compute only whether timed as DTensor
    (``meta["tp_time"] == "dtensor"``, the rank's CPU time without the collectives) or as plain
    tp-rank shapes, so the planner adds the links' all-reduces to forward and backward exactly
    once in both (not zero times for a DTensor profile, not twice)."""
    base = partition(Profile(_profile(None).layers), 2, microbatches=4, simulate=False)
    ar = 2 * 3 / 4 * MB / 100e9   # one ring all-reduce of a 1 MiB activation over 4 ranks
    for tp_time in ("shapes", "dtensor"):
        plan = partition(_profile(tp_time), 2, microbatches=4, tensor_parallel=4, links=LINKS, simulate=False)
        assert plan.stage_forward_s[0] - base.stage_forward_s[0] == pytest.approx(3 * ar)   # embedding 1 + block 2
        assert plan.stage_backward_s[1] - base.stage_backward_s[1] == pytest.approx(3 * ar)   # block 2 + head 1
        note = next(n for n in plan.notes if n.startswith("tensor parallel 4"))
        assert ("DTensor's compute" in note) == (tp_time == "dtensor"), note
