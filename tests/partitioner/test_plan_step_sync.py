"""The plan under ``optimizer.step_sync``: ``post_validate`` runs consecutive steps with no
barrier between them, so the plan predicts the steady state (``simulate(..., steps=N)``), and
its ranks hold the rollback snapshot (weights and optimizer state) and the kept gradients."""
from __future__ import annotations

import pytest

from engine.simulate import simulate
from partitioner import LayerCost, Profile, partition

PARAM_BYTES = 1 << 20


def _profile() -> Profile:
    times = [(1.0, 2.0, 0.8), (1.5, 3.0, 1.2), (1.0, 2.0, 0.8), (2.0, 4.0, 1.5),
             (1.0, 2.0, 0.8), (1.5, 3.0, 1.0)]
    return Profile([LayerCost(f * 1e-3, b * 1e-3, PARAM_BYTES, 4 << 20, 1 << 18, weight_grad_s=w * 1e-3)
                    for f, b, w in times])


@pytest.mark.parametrize("schedule", ["zb-h2", "1f1b"])
def test_post_validate_is_predicted_in_the_steady_state(schedule):
    kw = dict(schedule=schedule, microbatches=6, zero_stage=0, optimizer="adamw")
    glob = partition(_profile(), 3, **kw)
    post = partition(_profile(), 3, step_sync="post_validate", **kw)
    assert (glob.step_sync, post.step_sync) == ("global", "post_validate")
    assert post.stage_ranges == glob.stage_ranges   # same split here; only the step's model differs
    sched, f, b, w, c = post._schedule_and_costs(None, None)
    steady = simulate(sched, f, b, w, c, steps=3)
    opt = max(post.rank_optimizer_s, default=0.0)
    assert post.step_s == pytest.approx(steady.steps_s[-1] + opt + post.step_fixed_s)
    assert glob.step_s == pytest.approx(glob.predicted_step_s(simulate(sched, f, b, w, c)))
    if schedule == "zb-h2":   # its fill overlaps the previous step's cool-down
        assert post.step_s < glob.step_s
    assert len(post.simulate().steps_s) == 3 and len(glob.simulate().steps_s) == 1


@pytest.mark.parametrize("clip", [True, False])
def test_post_validate_ranks_hold_the_rollback_snapshot(clip):
    kw = dict(schedule="1f1b", microbatches=6, zero_stage=0, optimizer="adamw")
    glob = partition(_profile(), 3, **kw)
    post = partition(_profile(), 3, step_sync="post_validate", grad_clip=clip, **kw)
    for r, (a, b) in enumerate(post.stage_ranges):
        n = (b - a) * PARAM_BYTES / 4
        # adamw, fp32: weights 4 + moments 8 bytes per parameter snapshotted; gradients 4 kept
        extra = (4 + 8) * n + (4 * n if clip else 0)
        assert post.rank_memory_bytes[r] - glob.rank_memory_bytes[r] == pytest.approx(extra, abs=2), r
        assert (post.rank_memory_breakdown[r]["optimizer_state"]
                - glob.rank_memory_breakdown[r]["optimizer_state"]) == pytest.approx(12 * n, abs=1)
