"""Local launcher and torchrun detection, with fast failure propagation.

``launch(fn, nprocs, *args)`` runs ``fn(*args)`` on ``nprocs`` ranks with ``torch.distributed``
initialised (gloo on CPU, NCCL on CUDA) and returns the per-rank return values. Under ``torchrun``
(``RANK``/``WORLD_SIZE`` set) it runs ``fn`` in this process on the rank it was given.

A worker that raises or dies ends the job within seconds: the other workers are terminated and
:class:`WorkerError` names the rank, its pipeline stage (when the runtime registered it) and the
cause with the worker's traceback.

Example::

    def worker(scale):
        import torch.distributed as dist
        return dist.get_rank() * scale

    from engine import launch
    assert launch(worker, 2, 10) == [0, 10]
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
import time
import traceback
from typing import Any, Callable

# torch is imported inside the functions: `import engine` imports this module and stays light.

__all__ = ["launch", "WorkerError", "set_worker_info", "in_launched_worker"]

_POLL_S = 0.05
_TERMINATE_GRACE_S = 3.0
_DEFAULT_PG_TIMEOUT_S = 120.0

# Set inside a worker started by `launch`: the queue back to the launcher and the rank.
_WORKER_QUEUE: Any = None
_WORKER_RANK: int | None = None


class WorkerError(RuntimeError):
    """A worker of a launched job failed. Attributes: ``rank``, ``stage``, ``cause``,
    ``traceback_text``, ``exitcode``, ``others`` (other ranks that failed afterwards)."""

    def __init__(self, rank: int, stage: int | None, cause: str, traceback_text: str = "",
                 exitcode: int | None = None, others: tuple[int, ...] = ()):
        self.rank, self.stage, self.cause = rank, stage, cause
        self.traceback_text, self.exitcode, self.others = traceback_text, exitcode, others
        where = f"rank {rank}" + (f" (pipeline stage {stage})" if stage is not None else "")
        msg = f"worker {where} failed: {cause}"
        if others:
            msg += f"\n(ranks {list(others)} failed after it, most likely as a consequence)"
        if traceback_text:
            msg += "\n--- worker traceback ---\n" + traceback_text.rstrip()
        super().__init__(msg)

    def __reduce__(self):
        return (WorkerError, (self.rank, self.stage, self.cause, self.traceback_text,
                              self.exitcode, self.others))


def in_launched_worker() -> bool:
    """True inside a worker process started by :func:`launch`."""
    return _WORKER_QUEUE is not None


def set_worker_info(**info: Any) -> None:
    """Tell the launcher facts about this worker (e.g. ``stage=2``) for its error messages.
    A no-op outside launched workers."""
    if _WORKER_QUEUE is not None:
        _WORKER_QUEUE.put(("info", _WORKER_RANK, time.time(), pickle.dumps(info)))


def _device_backend() -> str:
    forced = os.environ.get("PIPESHARD_BACKEND")
    if forced:
        return forced
    import torch
    return "nccl" if torch.cuda.is_available() else "gloo"


def _set_parent_death_signal() -> None:
    # Linux: the worker gets SIGTERM when the launcher dies, so a killed launcher leaves no orphans.
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _watch_launcher(pid: int) -> None:
    # Under forkserver the launcher is not our parent: poll it, and leave if it is gone.
    import threading

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(1.0)

    threading.Thread(target=watch, name="pipeshard-launcher-watch", daemon=True).start()


def _worker_main(fn: Callable, args: tuple, rank: int, world: int, port: int,
                 q: Any, pg_timeout_s: float, parent_pid: int, backend: str,
                 environ: dict[str, str]) -> None:
    global _WORKER_QUEUE, _WORKER_RANK
    import torch
    import torch.distributed as dist
    _set_parent_death_signal()
    _watch_launcher(parent_pid)
    _WORKER_QUEUE, _WORKER_RANK = q, rank
    os.environ.clear()  # a fork server's environment is from when it started: use the launcher's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        result = fn(*args)
        payload = pickle.dumps(result)
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while a peer may still be receiving from it
        q.put(("result", rank, time.time(), payload))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the launcher
        code = 1
        cause = f"{type(exc).__name__}: {exc}"
        q.put(("error", rank, time.time(), pickle.dumps((cause, traceback.format_exc()))))
    finally:
        q.close()
        q.join_thread()
        # os._exit: skip process-group teardown, which can block when a peer is gone.
        os._exit(code)


def _torchrun(fn: Callable, args: tuple, pg_timeout_s: float) -> list[Any]:
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        backend = _device_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=pg_timeout_s))
    out: list[Any] = [None] * dist.get_world_size()
    out[dist.get_rank()] = fn(*args)
    return out


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float | None = None,
           pg_timeout_s: float = _DEFAULT_PG_TIMEOUT_S, backend: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks (or in-process under torchrun).

    Returns the list of per-rank return values (under torchrun: a list of world size holding
    only this rank's value). ``fn`` and ``args`` must be picklable (a module-level function);
    as in any multiprocessing program, a script calling it needs ``if __name__ == "__main__":``.
    ``timeout_s`` bounds the whole job; ``pg_timeout_s`` the process group's collectives;
    ``backend`` forces "gloo" or "nccl" (default: env ``PIPESHARD_BACKEND``, else NCCL iff CUDA).
    Raises :class:`WorkerError` for the first worker that failed (others are terminated).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun(fn, args, pg_timeout_s)
    import torch.distributed as dist
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}")
    backend = backend or _device_backend()
    ctx = _mp_context()
    # The launcher owns the rendezvous store: binding port 0 here cannot race with other jobs.
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout_s))
    q = ctx.Queue()
    # Not daemonic, so workers may start their own children (e.g. DataLoader workers); the
    # `finally` below, the parent-death signal and the launcher watch still leave no orphans.
    procs = [ctx.Process(target=_worker_main, name=f"pipeshard-rank{r}",
                         args=(fn, args, r, nprocs, store.port, q, pg_timeout_s, os.getpid(),
                               backend, dict(os.environ)))
             for r in range(nprocs)]
    stopping = {"signal": None}
    old_handler = None
    if _is_main_thread():
        def on_term(signum, frame):  # forward, then let the monitor loop wind down
            stopping["signal"] = signum
            stopping["deadline"] = time.monotonic() + float(
                os.environ.get("PIPESHARD_TERM_GRACE_S", "30"))
            for p in procs:
                if p.is_alive():
                    p.terminate()
        old_handler = signal.signal(signal.SIGTERM, on_term)
    try:
        for p in procs:
            p.start()
        return _monitor(procs, q, timeout_s, stopping)
    finally:
        _stop_all(procs)
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        q.close()
        q.cancel_join_thread()
        del store


def _mp_context() -> Any:
    # A fork server that has imported torch once starts each later worker in milliseconds instead
    # of re-importing torch (seconds); it forks before any CUDA or thread pool exists. Elsewhere
    # (or with PIPESHARD_START_METHOD=spawn) plain spawn.
    method = os.environ.get("PIPESHARD_START_METHOD")
    if method is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "engine.runtime"])
    return ctx


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _stop_all(procs: list) -> None:
    procs = [p for p in procs if p.pid is not None]  # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _monitor(procs: list, q: Any, timeout_s: float | None, stopping: dict) -> list[Any]:
    n = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, tuple[float, str, str]] = {}
    info: dict[int, dict] = {}
    deaths: dict[int, tuple[float, int]] = {}  # died without reporting: (time seen, exitcode)
    start = time.monotonic()

    def drain(block_s: float) -> None:
        try:
            item = q.get(timeout=block_s) if block_s > 0 else q.get_nowait()
        except (queue_mod.Empty, EOFError, OSError):
            return
        while True:
            kind, rank, t, payload = item
            if kind == "result":
                results[rank] = pickle.loads(payload)
            elif kind == "error":
                cause, tb = pickle.loads(payload)
                errors[rank] = (t, cause, tb)
            elif kind == "info":
                info.setdefault(rank, {}).update(pickle.loads(payload))
            try:
                item = q.get_nowait()
            except (queue_mod.Empty, EOFError, OSError):
                return

    while True:
        drain(_POLL_S)
        if stopping["signal"] is not None:
            # Workers got SIGTERM and may be saving a checkpoint: give them their grace period.
            if all(p.exitcode is not None for p in procs) or \
                    time.monotonic() > stopping["deadline"]:
                raise KeyboardInterrupt(f"launcher received signal {stopping['signal']}; "
                                        "workers were stopped")
            continue
        for r, p in enumerate(procs):
            if p.exitcode is not None and r not in results and r not in errors and r not in deaths:
                drain(0)  # an exited worker's queue data is flushed before it exits
                if r not in results and r not in errors:
                    deaths[r] = (time.time(), p.exitcode)
        if errors or deaths:
            time.sleep(0.3)  # let consequential failures arrive so the root cause can be told
            drain(0)
            raise _root_cause(errors, deaths, info)
        if len(results) == n and all(p.exitcode is not None for p in procs):
            return [results[r] for r in range(n)]
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            pending = [r for r in range(n) if r not in results]
            raise WorkerError(pending[0], info.get(pending[0], {}).get("stage"),
                              f"job timed out after {timeout_s:.0f} s; ranks still running: "
                              f"{pending}. Raise timeout_s or look for a hang (e.g. mismatched "
                              f"schedules).")


def _root_cause(errors: dict, deaths: dict, info: dict) -> WorkerError:
    # A rank that died without reporting (killed, OOM) is the likely root cause; otherwise the
    # earliest reported exception (peers of a failed rank fail later, on a broken connection).
    if deaths:
        rank = min(deaths, key=lambda r: deaths[r][0])
        code = deaths[rank][1]
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown"
            how = f"killed by signal {-code} ({name}; SIGKILL often means out of memory)"
        else:
            how = f"exited with code {code} without reporting an error"
        cause, tb = f"process {how}", ""
    else:
        rank = min(errors, key=lambda r: errors[r][0])
        _, cause, tb = errors[rank]
        code = 1
    others = tuple(sorted((set(errors) | set(deaths)) - {rank}))
    return WorkerError(rank, info.get(rank, {}).get("stage"), cause, tb, code, others)
