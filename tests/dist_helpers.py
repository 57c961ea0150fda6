"""Shared helper for multi-process tests: run a function on N local gloo ranks.

``run_workers(fn, nprocs, *args)`` starts ``nprocs`` processes with ``torch.distributed``
initialised on gloo (a private rendezvous port, one thread each) and returns the per-rank
return values. A worker exception is re-raised here as ``engine.launch.WorkerError`` carrying
the worker's traceback; a hang ends after ``timeout_s`` and the workers are stopped.
``fn`` must be a module-level function of an importable module (workers are spawned).

Example::

    def _worker(x):
        import torch.distributed as dist
        return dist.get_rank() + x

    def test_ranks():
        assert run_workers(_worker, 2, 10) == [10, 11]
"""
from __future__ import annotations

import os
from typing import Any, Callable

from engine.launch import WorkerError, launch

__all__ = ["run_workers", "WorkerError", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 120.0


def run_workers(fn: Callable[..., Any], nprocs: int, *args: Any,
                timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo",
                pg_timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` gloo ranks; per-rank results, or WorkerError."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch(fn, nprocs, *args, timeout_s=timeout_s, backend=backend,
                  pg_timeout_s=pg_timeout_s)
