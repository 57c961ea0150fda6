"""Run one function in N fresh worker processes (one per rank) and collect what each returns.

Each worker is a new interpreter (``spawn``), single-threaded, with ``torch.distributed``
initialised over gloo on a free port of 127.0.0.1 and the usual launcher variables set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) so that libraries
such as DeepSpeed find them. A worker that raises ends the job: the others are killed and
:class:`WorkerFailure` names the rank and carries its traceback. A job that outlives
``timeout_s`` is killed and reported the same way.

Example::

    from experiments.peers.harness import spawn_workers

    def hello(rank: int, world_size: int, greeting: str) -> str:   # module level: picklable
        return f"{greeting} from {rank}/{world_size}"

    spawn_workers(hello, 2, "hi")   # ['hi from 0/2', 'hi from 1/2']
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

__all__ = ["WorkerFailure", "spawn_workers", "free_port"]

_ERROR_GRACE_S = 1.5  # after a first failure, wait this long for the other ranks' errors


class WorkerFailure(RuntimeError):
    """A worker raised, died, or the job timed out.

    ``rank`` is the first rank that failed (``None`` for a timeout), ``tracebacks`` maps every
    rank that reported an error to its traceback text.
    """

    def __init__(self, message: str, rank: int | None, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (spawned children inherit them at start)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_main(rank: int, world_size: int, port: int, timeout_s: float,
                 fn: Callable[..., Any], args: tuple, results: Any) -> None:
    try:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(timeout_s, 10.0)))
        try:
            value = fn(rank, world_size, *args)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die with us.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _stop(procs: list[Any], grace_s: float = 0.0) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def spawn_workers(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 300.0,
                  threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` fresh processes; return the results by rank.

    ``fn`` and ``args`` must be picklable (module-level functions, classes, ``functools.partial``;
    not lambdas or closures). Raises :class:`WorkerFailure` when any rank fails or the job takes
    longer than ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    thread_env = {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    procs = []
    with _environ(thread_env):
        for rank in range(nprocs):
            p = ctx.Process(target=_worker_main, args=(rank, nprocs, port, timeout_s, fn, args, results),
                            name=f"bench-rank{rank}", daemon=True)
            p.start()
            procs.append(p)

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    first_error: int | None = None
    deadline = time.monotonic() + timeout_s
    error_deadline = float("inf")
    try:
        while len(values) + len(errors) < nprocs:
            now = time.monotonic()
            if now > min(deadline, error_deadline):
                break
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill).
                for rank, p in enumerate(procs):
                    if rank not in values and rank not in errors and p.exitcode not in (None, 0):
                        errors[rank] = f"rank {rank} exited with code {p.exitcode} without reporting"
                        if first_error is None:
                            first_error = rank
                            error_deadline = time.monotonic() + _ERROR_GRACE_S
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                errors[rank] = value
                if first_error is None:
                    first_error = rank
                    error_deadline = time.monotonic() + _ERROR_GRACE_S
    finally:
        # Ranks that reported exit by themselves; anything still running after that is a straggler.
        _stop(procs, grace_s=5.0 if first_error is None and len(values) == nprocs else 0.0)

    if first_error is not None:
        others = ", ".join(str(r) for r in sorted(errors) if r != first_error)
        msg = (f"worker rank {first_error} of {nprocs} failed running {getattr(fn, '__name__', fn)}"
               + (f" (ranks {others} failed too)" if others else "")
               + f":\n{errors[first_error]}")
        raise WorkerFailure(msg, first_error, errors)
    if len(values) < nprocs:
        missing = [r for r in range(nprocs) if r not in values]
        raise WorkerFailure(f"timed out after {timeout_s:.0f} s waiting for ranks {missing} of {nprocs} "
                            f"running {getattr(fn, '__name__', fn)}; raise timeout_s if the job is just slow",
                            None, errors)
    return [values[r] for r in range(nprocs)]
