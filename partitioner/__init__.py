"""pipeshard's partitioner: profile layer costs, find the optimal pipeline split, explain it.

Example::

    import torch, torch.nn as nn
    import partitioner
    layers = [lambda: nn.Linear(512, 512) for _ in range(16)]
    prof = partitioner.profile(layers, torch.randn(64, 512), mode="analytic", device_spec="h100")
    plan = partitioner.partition(prof, 4, microbatches=8, memory_limit_bytes=2 << 30)
    print(plan.summary())
    res = partitioner.search(prof, 4, 32, profile_microbatch=64 // 8)  # schedule, m, split chosen
    print(res.table())

Importing this package pulls in numpy only; torch is imported when profiling, and the
engine's simulator when a plan is predicted.
"""

from .costs import FixedCosts, LayerCost, Profile
from .devices import ATTENTION_BACKENDS, DEVICE_PRESETS, DeviceSpec, get_device_spec, measure_cpu_spec
from .memory import SCHEDULES, inflight_per_chunk, static_factor
from .plan import PartitionError, Plan
from .planner import METHODS, partition
from .profile import profile
from .collectives import Links
from .search import AUTO, Candidate, SearchResult, search, search_parallel

__all__ = [
    "LayerCost", "Profile", "FixedCosts", "profile", "partition", "Plan", "PartitionError", "DeviceSpec", "DEVICE_PRESETS",
    "ATTENTION_BACKENDS", "get_device_spec", "measure_cpu_spec", "SCHEDULES", "METHODS", "inflight_per_chunk", "static_factor",
    "search", "SearchResult", "Candidate", "AUTO", "search_parallel", "Links",
]
