import pytest

from partitioner import LayerCost, Profile, partition


@pytest.mark.slow
def test_deepspeed_pipeline_module_uses_the_plan_boundaries():
    from dist_helpers import run_workers

    import _ds_worker

    # unequal layers, so the plan differs from DeepSpeed's own uniform/parameters splits
    prof = Profile([LayerCost(1e-3 * (5 if i == 0 else 1), 2e-3, 80, 64, 64) for i in range(7)])
    plan = partition(prof, 2, microbatches=4)
    parts = plan.to_deepspeed_parts()
    assert parts != [0, 4, 7] and parts[0] == 0 and parts[-1] == 7
    out = run_workers(_ds_worker.build_planned_module, 2, parts, 2, timeout_s=240)
    for rank, got in enumerate(out):
        assert got["parts"] == parts
        assert got["stage"] == rank
        assert got["own"] == list(range(parts[rank], parts[rank + 1]))
        assert (got["start"], got["stop"]) == (parts[rank], parts[rank + 1])
