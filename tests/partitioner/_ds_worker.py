"""Worker for the DeepSpeed export test (spawned processes need an importable function)."""
from __future__ import annotations

import os


def build_planned_module(parts: list[int], num_stages: int) -> dict:
    import torch.distributed as dist
    import torch.nn as nn

    import deepspeed
    from partitioner import Plan

    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    deepspeed.init_distributed(dist_backend="gloo")
    ranges = [(parts[i], parts[i + 1]) for i in range(num_stages)]
    plan = Plan(stage_ranges=ranges, stage_time_s=[0.0] * num_stages, stage_memory_bytes=[0] * num_stages,
                bottleneck_s=0.0, step_s=0.0, bubble_fraction=0.0, lower_bound_s=0.0, num_stages=num_stages)
    layers = [nn.Linear(4, 4) for _ in range(parts[-1])]
    mod = plan.to_deepspeed_module(layers, loss_fn=nn.MSELoss())
    own = [i for i, layer in enumerate(layers) if any(layer is f for f in mod.forward_funcs)]
    return {"parts": list(mod.parts), "stage": mod.stage_id, "own": own, "start": mod._local_start,
            "stop": mod._local_stop}
