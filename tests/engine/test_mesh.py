"""engine.mesh: the (pp, dp, tp) mesh on init_device_mesh, on 4 gloo ranks.

Rank order ``rank = (replica * stages + pipeline_rank) * tp + tp_rank``; each axis's group holds
the ranks that differ only along it; the torch DeviceMesh has only the axes of size > 1, and the
mesh makes no group the job does not use (a one-replica pipeline: none at all).
"""
from __future__ import annotations

import pytest

from dist_helpers import run_workers

pytestmark = pytest.mark.slow


def _joined() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _worker(layouts):
    import torch.distributed as dist

    from engine.mesh import Mesh

    out = []
    for p, d, t in layouts:
        before = _joined()
        mesh = Mesh(p, d, t)
        made = _joined() - before
        groups = {a: dist.get_process_group_ranks(mesh.group(a)) for a in ("pp", "dp", "tp")
                  if mesh.sizes[a] > 1}
        dims = mesh.device_mesh.mesh_dim_names if mesh.device_mesh is not None else ()
        out.append({"made": made, "groups": groups, "dims": dims,
                    "coords": (mesh.replica, mesh.pipeline_rank, mesh.tp_rank),
                    "last": mesh.last_rank, "peer0": mesh.global_rank(0),
                    "dp_submesh": mesh.submesh("dp").mesh.tolist(),
                    "p2p_is_pipeline": mesh.p2p_forward_group is mesh.pipeline_group})
    return out


LAYOUTS = [(2, 2, 1), (4, 1, 1), (2, 1, 2), (1, 4, 1)]


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 4, LAYOUTS)


def test_rank_order_and_groups(results):
    for rank, got in enumerate(results):
        for (p, d, t), g in zip(LAYOUTS, got):
            rest, k = divmod(rank, t)
            r, j = divmod(rest, p)
            assert g["coords"] == (r, j, k)
            assert g["last"] == (r * p + p - 1) * t + k
            assert g["peer0"] == (r * p) * t + k
            if p > 1:
                assert g["groups"]["pp"] == [(r * p + i) * t + k for i in range(p)]
            if d > 1:
                assert g["groups"]["dp"] == [(i * p + j) * t + k for i in range(d)]
                assert g["dp_submesh"] == g["groups"]["dp"]
            else:
                assert g["dp_submesh"] == [rank]
            if t > 1:
                assert g["groups"]["tp"] == [(r * p + j) * t + i for i in range(t)]
            assert g["dims"] == tuple(a for a, n in (("dp", d), ("pp", p), ("tp", t)) if n > 1)
            assert g["p2p_is_pipeline"]   # gloo: tagged messages share the pipeline group


def test_no_unused_group(results):
    """Groups this rank joined while building the mesh: one per axis of size > 1 that does not
    span the world (that one is the world group); the lazily made one-rank dp group of a
    one-replica job is not among them (it was made later, by submesh)."""
    for got in results:
        assert [g["made"] for g in got] == [2, 0, 2, 0]


def test_world_size_mismatch_is_refused(tmp_path):
    from engine.mesh import Mesh

    with pytest.raises(ValueError, match="world size 1 != num_stages 2 x data_parallel 1 x "
                                         "tensor_parallel 2; start 4 processes"):
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                    world_size=1)
        try:
            Mesh(2, 1, 2)
        finally:
            dist.destroy_process_group()
