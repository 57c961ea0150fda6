"""The pipeline x data-parallel process mesh.

Rank layout: ``rank = replica * num_stages + pipeline_rank`` (a pipeline's neighbours are adjacent
ranks, so under torchrun they share a node when ``num_stages`` divides the node's GPU count).
Groups: one pipeline group per replica (collectives; the world group itself when there is one
replica), one data-parallel group per pipeline stage (created on first use when there is one
replica: only DeepSpeed asks for it then). Point-to-point traffic: on NCCL, activations and
gradients travel on two extra communicators per replica, so that NCCL's in-order matching only
has to hold per direction; on gloo, whose messages carry tags, both use the pipeline group.
Every group is an extra communicator whose progress thread wakes on its own (gloo's TCP loop
does so ~100 times a second), preempting compute on a busy CPU, so no group is made that the
job does not use. Every rank creates every group in the same order, as
``torch.distributed.new_group`` requires.

Without an initialised process group the mesh is the trivial single-process one (1 x 1).

Example::

    mesh = Mesh(num_stages=2, data_parallel=2)   # inside a 4-rank job
    if mesh.pipeline_rank == mesh.num_stages - 1: ...
    dist.all_reduce(t, group=mesh.dp_group)
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["Mesh"]


class Mesh:
    """Process groups and rank arithmetic for ``num_stages`` x ``data_parallel`` ranks."""

    def __init__(self, num_stages: int, data_parallel: int = 1):
        if num_stages < 1 or data_parallel < 1:
            raise ValueError(f"num_stages ({num_stages}) and data_parallel ({data_parallel}) "
                             "must be >= 1")
        self.num_stages, self.data_parallel = num_stages, data_parallel
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        if self.world_size != num_stages * data_parallel:
            raise ValueError(
                f"world size {self.world_size} != num_stages {num_stages} x data_parallel "
                f"{data_parallel}; start {num_stages * data_parallel} processes (e.g. "
                f"launch(fn, {num_stages * data_parallel}) or torchrun --nproc-per-node) or "
                "change the layout")
        self.replica, self.pipeline_rank = divmod(self.rank, num_stages)
        self.backend = dist.get_backend() if self.distributed else "none"
        self.pipeline_group: Any = None
        self.p2p_forward_group: Any = None
        self.p2p_backward_group: Any = None
        self._dp_group: Any = None
        if self.distributed:
            self._make_groups()

    def _make_groups(self) -> None:
        p, d = self.num_stages, self.data_parallel
        if d == 1:
            self.pipeline_group = dist.group.WORLD
        for r in range(d if d > 1 else 0):
            g = dist.new_group([r * p + j for j in range(p)])
            if r == self.replica:
                self.pipeline_group = g
        if self.backend == "nccl":
            for r in range(d):
                fwd, bwd = (dist.new_group([r * p + j for j in range(p)]) for _ in range(2))
                if r == self.replica:
                    self.p2p_forward_group, self.p2p_backward_group = fwd, bwd
            # Older NCCL process groups want a batched point-to-point call's group to have run a
            # collective first: initialise both communicators up front.
            dist.barrier(group=self.p2p_forward_group)
            dist.barrier(group=self.p2p_backward_group)
        else:
            self.p2p_forward_group = self.p2p_backward_group = self.pipeline_group
        for j in range(p if d > 1 else 0):
            g = dist.new_group([r * p + j for r in range(d)])
            if j == self.pipeline_rank:
                self._dp_group = g

    @property
    def dp_group(self) -> Any:
        """This stage's data-parallel group. With one replica it is made on first use, by this
        rank alone (``use_local_synchronization``), so jobs that never use it pay nothing."""
        if self._dp_group is None and self.distributed and self.data_parallel == 1:
            self._dp_group = dist.new_group([self.rank], use_local_synchronization=True)
        return self._dp_group

    @dp_group.setter
    def dp_group(self, group: Any) -> None:
        self._dp_group = group

    # ---- rank arithmetic -------------------------------------------------------------------
    def global_rank(self, pipeline_rank: int, replica: int | None = None) -> int:
        """Global rank of ``pipeline_rank`` in ``replica`` (default: this rank's replica)."""
        rep = self.replica if replica is None else replica
        return rep * self.num_stages + pipeline_rank % self.num_stages

    @property
    def last_rank(self) -> int:
        """Global rank of this replica's last pipeline stage."""
        return self.global_rank(self.num_stages - 1)

    def __repr__(self) -> str:
        return (f"Mesh(rank={self.rank}, pipeline_rank={self.pipeline_rank}/{self.num_stages}, "
                f"replica={self.replica}/{self.data_parallel}, backend={self.backend})")
