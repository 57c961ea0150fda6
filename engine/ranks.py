"""The rank order of the process mesh, without torch: ``(pp, dp, tp)`` with tp innermost, then
pp, dp outermost (``engine.mesh`` builds its groups on it; the planner reads it to tell which
pipeline neighbours share a node). Importing this module imports nothing heavy."""

from __future__ import annotations

from typing import Any

__all__ = ["mesh_rank"]


def mesh_rank(replica: Any, pipeline_rank: Any, tp_rank: Any, num_stages: int, tensor_parallel: int) -> Any:
    """The global rank of (``replica``, ``pipeline_rank``, ``tp_rank``): the one rank-order rule
    (module docstring), read by :class:`engine.mesh.Mesh` and by the planner (which pipeline neighbours share
    a node, ``partitioner.collectives.pipeline_hops``). Ints or numpy arrays (broadcast).

    >>> mesh_rank(1, 2, 1, num_stages=4, tensor_parallel=2)   # (1 * 4 + 2) * 2 + 1
    13
    """
    return (replica * num_stages + pipeline_rank) * tensor_parallel + tp_rank
