"""The process mesh: pipeline (pp) x data-parallel (dp) x tensor-parallel (tp) axes, on torch's
``init_device_mesh``.

World = ``num_stages x data_parallel x tensor_parallel``. Rank order (the same under torchrun,
Slurm and ``engine.launch``: it depends only on the global rank)::

    rank = (replica * num_stages + pipeline_rank) * tensor_parallel + tp_rank

tp is innermost (a tp group is adjacent ranks, so it shares a node whenever tp divides the
node's GPU count), then pp, and dp outermost: with ``tensor_parallel=1`` this is the order the
pipeline has always used (``rank = replica * num_stages + pipeline_rank``), so a pipeline's
neighbours share a node when ``num_stages`` divides the node's GPU count. (torchtitan puts pp
outermost instead, so that its heavy FSDP traffic stays on the node; keeping the established
order keeps every launcher, checkpoint and test layout as it was.)

The torch ``DeviceMesh`` (``Mesh.device_mesh``) is built by ``init_device_mesh`` over the axes
of size > 1 only, in memory order ``(dp, pp, tp)`` with those names: an axis of size 1 would make
one process group per rank that nothing uses, and every group is an extra communicator whose
progress thread wakes on its own (gloo's TCP loop does so ~100 times a second), preempting
compute on a busy CPU. ``submesh(axis)`` gives any axis as a 1-D DeviceMesh (what FSDP2 and
DTensor take); a trivial axis's group is made on first use, by this rank alone
(``use_local_synchronization``), so jobs that never use it pay nothing. A mesh axis that spans
the whole world reuses the default group.

Point-to-point traffic: on NCCL, activations and gradients travel on two extra communicators
per pipeline (one per (replica, tp rank)), so that NCCL's in-order matching only has to hold
per direction; on gloo, whose messages carry tags, both use the pipeline group. Every rank
creates every group in the same order, as ``torch.distributed.new_group`` requires.

Without an initialised process group the mesh is the trivial single-process one (1 x 1 x 1).

Example::

    mesh = Mesh(num_stages=2, data_parallel=2)   # inside a 4-rank job
    if mesh.pipeline_rank == mesh.num_stages - 1: ...
    dist.all_reduce(t, group=mesh.dp_group)
    fully_shard(layer, mesh=mesh.submesh("dp"))
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .ranks import mesh_rank

__all__ = ["Mesh", "AXES", "mesh_rank"]

AXES = ("pp", "dp", "tp")


class Mesh:
    """Process groups and rank arithmetic for ``num_stages x data_parallel x tensor_parallel``
    ranks (see the module docstring for the rank order)."""

    def __init__(self, num_stages: int, data_parallel: int = 1, tensor_parallel: int = 1):
        if num_stages < 1 or data_parallel < 1 or tensor_parallel < 1:
            raise ValueError(f"num_stages ({num_stages}), data_parallel ({data_parallel}) and "
                             f"tensor_parallel ({tensor_parallel}) must be >= 1")
        self.num_stages, self.data_parallel = num_stages, data_parallel
        self.tensor_parallel = tensor_parallel
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        want = num_stages * data_parallel * tensor_parallel
        if self.world_size != want:
            raise ValueError(
                f"world size {self.world_size} != num_stages {num_stages} x data_parallel "
                f"{data_parallel} x tensor_parallel {tensor_parallel}; start {want} processes "
                f"(e.g. launch(fn, {want}) or torchrun --nproc-per-node) or change the layout")
        rest, self.tp_rank = divmod(self.rank, tensor_parallel)
        self.replica, self.pipeline_rank = divmod(rest, num_stages)
        self.backend = dist.get_backend() if self.distributed else "none"
        self.device_type = "cuda" if self.backend == "nccl" else "cpu"
        self.device_mesh: Any = None
        self._groups: dict[str, Any] = {}
        self._submeshes: dict[str, Any] = {}
        self._p2p: tuple[Any, Any] | None = None   # NCCL's per-direction groups
        if self.distributed:
            self._make_groups()

    @property
    def sizes(self) -> dict[str, int]:
        """Axis sizes by name: ``{"pp": num_stages, "dp": data_parallel, "tp": tensor_parallel}``."""
        return {"pp": self.num_stages, "dp": self.data_parallel, "tp": self.tensor_parallel}

    def _make_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        order = [a for a in ("dp", "pp", "tp") if self.sizes[a] > 1]
        if order:
            self.device_mesh = init_device_mesh(
                self.device_type, tuple(self.sizes[a] for a in order),
                mesh_dim_names=tuple(order))
            for a in order:
                self._groups[a] = self.device_mesh[a].get_group()
        if self.num_stages == self.world_size:
            self._groups["pp"] = dist.group.WORLD
        if self.backend == "nccl":
            p, t = self.num_stages, self.tensor_parallel
            for r in range(self.data_parallel):
                for k in range(t):
                    ranks = [mesh_rank(r, j, k, p, t) for j in range(p)]
                    fwd, bwd = (dist.new_group(ranks) for _ in range(2))
                    if (r, k) == (self.replica, self.tp_rank):
                        self._p2p = (fwd, bwd)
            # Older NCCL process groups want a batched point-to-point call's group to have run a
            # collective first: initialise both communicators up front.
            dist.barrier(group=self.p2p_forward_group)
            dist.barrier(group=self.p2p_backward_group)

    @property
    def p2p_forward_group(self) -> Any:
        """Activations' group: NCCL's own forward communicator, else the pipeline group."""
        return self._p2p[0] if self._p2p is not None else self.pipeline_group

    @property
    def p2p_backward_group(self) -> Any:
        """Gradients' group: NCCL's own backward communicator, else the pipeline group."""
        return self._p2p[1] if self._p2p is not None else self.pipeline_group

    def group(self, axis: str) -> Any:
        """This rank's process group along ``axis`` ("pp", "dp" or "tp"); an axis of size 1 gets
        a one-rank group made on first use by this rank alone. None without a process group."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; use one of {AXES}")
        if axis not in self._groups and self.distributed:
            if self.sizes[axis] != 1:
                raise RuntimeError(f"internal: mesh axis {axis} of size {self.sizes[axis]} "
                                   "has no group")
            self._groups[axis] = dist.new_group([self.rank], use_local_synchronization=True)
        return self._groups.get(axis)

    def submesh(self, axis: str) -> Any:
        """``axis`` as a 1-D torch ``DeviceMesh`` (for FSDP2 / DTensor), named ``axis``."""
        if axis not in self._submeshes:
            if self.device_mesh is not None and axis in (self.device_mesh.mesh_dim_names or ()):
                self._submeshes[axis] = self.device_mesh[axis]
            else:
                from torch.distributed.device_mesh import DeviceMesh

                if not self.distributed:
                    raise RuntimeError("a DeviceMesh needs an initialised process group")
                self._submeshes[axis] = DeviceMesh.from_group(
                    self.group(axis), self.device_type, mesh_dim_names=(axis,))
        return self._submeshes[axis]

    @property
    def pipeline_group(self) -> Any:
        """This pipeline's group (the world group when there is one pipeline)."""
        return self.group("pp")

    @property
    def dp_group(self) -> Any:
        """This stage's data-parallel group. With one replica it is made on first use, by this
        rank alone (``use_local_synchronization``), so jobs that never use it pay nothing."""
        return self.group("dp")

    @dp_group.setter
    def dp_group(self, group: Any) -> None:
        self._groups["dp"] = group

    @property
    def tp_group(self) -> Any:
        """This rank's tensor-parallel group (one rank, made on first use, when tp is 1)."""
        return self.group("tp")

    # ---- rank arithmetic -------------------------------------------------------------------
    def global_rank(self, pipeline_rank: int, replica: int | None = None) -> int:
        """Global rank of ``pipeline_rank`` in ``replica`` (default: this rank's replica), at
        this rank's tp rank."""
        rep = self.replica if replica is None else replica
        return mesh_rank(rep, pipeline_rank % self.num_stages, self.tp_rank, self.num_stages,
                         self.tensor_parallel)

    @property
    def last_rank(self) -> int:
        """Global rank of this replica's last pipeline stage."""
        return self.global_rank(self.num_stages - 1)

    def __repr__(self) -> str:
        return (f"Mesh(rank={self.rank}, pipeline_rank={self.pipeline_rank}/{self.num_stages}, "
                f"replica={self.replica}/{self.data_parallel}, "
                f"tp_rank={self.tp_rank}/{self.tensor_parallel}, backend={self.backend})")
