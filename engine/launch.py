"""Local launcher and torchrun detection, with fast failure propagation.

``launch(fn, nprocs, *args)`` runs ``fn(*args)`` on ``nprocs`` ranks with ``torch.distributed``
initialised (gloo on CPU, NCCL on CUDA) and returns the per-rank return values. Under ``torchrun``,
a submitit job with several tasks or an ``srun`` step (``engine.cluster.detect``) it runs ``fn``
in this process on the rank it was given. ``max_restarts=N`` restarts all workers after a failure
(as ``torchrun --max-restarts``); the workers read their attempt from
``engine.cluster.restart_count()``.

A worker that raises or dies ends the job within seconds: the other workers are terminated and
:class:`WorkerError` names the rank, its pipeline stage (when the runtime registered it) and the
cause with the worker's traceback, or the signal / exit code of a killed one. Each worker reports
on its own pipe, so one killed in the middle of a message cannot stall the others' reports. A
job over ``timeout_s`` reports where each unfinished rank is stuck (faulthandler stacks).

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
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

# torch is imported inside the functions: `import engine` imports this module and stays light.

__all__ = ["launch", "prestart", "WorkerError", "set_worker_info"]

_POLL_S = 0.05
_TERMINATE_GRACE_S = 3.0
_DEFAULT_PG_TIMEOUT_S = 120.0
_TB_LINES = 30
_SETTLE_S = 0.5
_STACK_DUMP_WAIT_S = 1.0

# Set inside a worker started by `launch`: the channel back to the launcher and the rank.
_WORKER_QUEUE: Any = None
_WORKER_RANK: int | None = None


class WorkerError(RuntimeError):
    """A worker of a launched job failed. Attributes: ``rank``, ``stage``, ``cause``,
    ``traceback_text``, ``exitcode``, ``others`` (other ranks that failed afterwards)."""

    def __init__(self, rank: int, stage: int | None, cause: str, traceback_text: str = "",
                 exitcode: int | None = None, others: tuple[int, ...] = (),
                 replica: int | None = None):
        self.rank, self.stage, self.cause = rank, stage, cause
        self.traceback_text, self.exitcode, self.others = traceback_text, exitcode, others
        self.replica = replica
        where = [f"stage {stage}"] if stage is not None else []
        if replica is not None:
            where.append(f"replica {replica}")
        name = f"rank {rank}" + (f" ({', '.join(where)})" if where else "")
        msg = f"{name} failed: {cause}"
        if others:
            msg += f"\n(ranks {list(others)} failed after it, most likely as a consequence)"
        if traceback_text:
            lines = traceback_text.rstrip().splitlines()
            if len(lines) > _TB_LINES:  # the full text stays in .traceback_text
                lines = [f"... ({len(lines) - _TB_LINES} lines omitted; see .traceback_text)"] \
                    + lines[-_TB_LINES:]
            msg += "\n--- worker traceback (last lines) ---\n" + "\n".join(lines)
        super().__init__(msg)

    def __reduce__(self):
        return (WorkerError, (self.rank, self.stage, self.cause, self.traceback_text,
                              self.exitcode, self.others, self.replica))


def set_worker_info(**info: Any) -> None:
    """Tell the launcher facts about this worker (e.g. ``stage=2``) for its error messages.
    A no-op outside launched workers."""
    if _WORKER_QUEUE is not None:
        _WORKER_QUEUE.put(("info", _WORKER_RANK, time.time(), pickle.dumps(info)))


class _Channel:
    """A worker's end of its own pipe to the launcher. One pipe per worker (not a shared
    queue): a worker killed in the middle of a message cannot block the others' messages, and
    the launcher sees end-of-file instead of waiting for the rest of the message."""

    def __init__(self, conn: Any):
        import threading
        self.conn, self.lock = conn, threading.Lock()

    def put(self, item: tuple) -> None:
        data = pickle.dumps(item)
        with self.lock:
            self.conn.send_bytes(data)

    def close(self) -> None:
        with self.lock:
            self.conn.close()


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

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:  # a killed launcher stays a zombie until its parent reaps it: that is gone too
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return False

    def watch() -> None:
        while True:
            if gone():
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="pipeshard-launcher-watch", daemon=True).start()


def _register_stack_dump(dump_dir: str | None, rank: int) -> None:
    # On SIGUSR1 the worker writes every thread's Python stack to a file the launcher reads when
    # the job times out, so a hang is reported with where each rank is stuck.
    if dump_dir is None or not hasattr(signal, "SIGUSR1"):
        return
    import faulthandler
    try:
        f = open(os.path.join(dump_dir, f"stack_{rank}.txt"), "w")  # noqa: SIM115 - lives on
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        pass


def _describe_exception(exc: BaseException) -> str:
    cause = f"{type(exc).__name__}: {exc}"
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or "out of memory" in text:
        cause += (" -- out of memory on this rank: use a smaller microbatch (more "
                  "microbatches), activation_checkpointing, more stages, ZeRO, or a partition "
                  "with a memory limit (partitioner.partition(memory_limit_bytes=...))")
    return cause


def _worker_main(fn: Callable, args: tuple, rank: int, world: int, port: int,
                 conn: Any, pg_timeout_s: float, parent_pid: int, backend: str,
                 environ: dict[str, str], dump_dir: str | None = None) -> None:
    global _WORKER_QUEUE, _WORKER_RANK
    import torch
    import torch.distributed as dist
    _set_parent_death_signal()
    _watch_launcher(parent_pid)
    _register_stack_dump(dump_dir, rank)
    # Ctrl-C reaches the whole process group: the launcher alone handles it and forwards
    # SIGTERM, so that every worker stops the same (graceful) way, e.g. after a checkpoint.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    q = _Channel(conn)
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
        _meet_on_store(store, rank, world)
        q.put(("result", rank, time.time(), payload))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the launcher
        code = 1
        q.put(("error", rank, time.time(),
               pickle.dumps((_describe_exception(exc), traceback.format_exc()))))
    finally:
        try:
            q.close()
        except OSError:
            pass
        # os._exit: skip process-group teardown, which can block when a peer is gone.
        os._exit(code)


def _external(fn: Callable, args: tuple, env: Any, pg_timeout_s: float) -> list[Any]:
    """Run ``fn`` on the rank torchrun, submitit or Slurm gave this process."""
    import torch
    import torch.distributed as dist

    from engine.cluster import export_env, init_process_group
    export_env(env)
    if not dist.is_initialized():
        backend = _device_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_process_group(backend, datetime.timedelta(seconds=pg_timeout_s))
    out: list[Any] = [None] * dist.get_world_size()
    out[dist.get_rank()] = fn(*args)
    from torch.distributed.distributed_c10d import _get_default_store

    _meet_on_store(_get_default_store(), dist.get_rank(), dist.get_world_size())
    return out


def _meet_on_store(store: Any, rank: int, world: int) -> None:
    # No rank leaves while a peer may still be receiving from it. Met on the rendezvous store,
    # not with a collective: a gloo receive that timed out closes its connection.
    store.set(f"pipeshard-done-{rank}", "1")
    store.wait([f"pipeshard-done-{r}" for r in range(world)])


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float | None = None,
           pg_timeout_s: float = _DEFAULT_PG_TIMEOUT_S, backend: str | None = None,
           start_method: str | None = None, max_restarts: int = 0, local: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks (or in-process under torchrun, or on the rank
    Slurm / submitit gave this process: see ``engine.cluster``).

    Returns the list of per-rank return values (under torchrun: a list of world size holding
    only this rank's value). ``fn`` and ``args`` must be picklable (a module-level function);
    as in any multiprocessing program, a script calling it needs ``if __name__ == "__main__":``.
    ``timeout_s`` bounds the whole job; ``pg_timeout_s`` the process group's collectives;
    ``backend`` forces "gloo" or "nccl" (default: env ``PIPESHARD_BACKEND``, else NCCL iff CUDA).
    ``start_method``: ``"spawn"`` starts every worker as a fresh interpreter (nothing imported
    before, e.g. for benchmarks); ``"forkserver"`` forks them from a server that has imported
    torch once (fast). Default: env ``PIPESHARD_START_METHOD``, else forkserver where available.
    Raises :class:`WorkerError` for the first worker that failed (others are terminated): it
    names the rank, its stage (see :func:`set_worker_info`) and the cause (exception and the
    last traceback lines, or the signal / exit code). On ``timeout_s`` the error shows where
    each unfinished rank was stuck (its Python stack). SIGTERM or SIGINT to the launcher is
    forwarded to the workers as SIGTERM; they get ``PIPESHARD_TERM_GRACE_S`` seconds (default
    30, e.g. to checkpoint) before they are killed, then ``KeyboardInterrupt`` is raised here. A
    second signal kills them at once. A killed launcher's workers exit within about a second.

    ``max_restarts``: when a worker fails, stop all of them and start all again, up to this many
    times (as ``torchrun --max-restarts``); each start's workers see their attempt number in
    ``PIPESHARD_RESTART_COUNT`` (``engine.cluster.restart_count()``) and the failure that caused
    it in ``PIPESHARD_LAST_FAILURE``, so they can resume from their newest checkpoint. The
    restart is reported on stderr; the last failure is raised. ``timeout_s`` bounds all attempts.
    ``local=True`` starts local workers even in a process that is itself a rank of a cluster job
    (e.g. a measurement on this node by rank 0 while the others wait).
    """
    from engine.cluster import detect
    env = None if local else detect()
    if env is not None:
        return _external(fn, args, env, pg_timeout_s)
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}")
    if max_restarts < 0:
        raise ValueError(f"launch: max_restarts must be >= 0, got {max_restarts}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failure = ""
    for attempt in range(max_restarts + 1):
        environ = dict(os.environ, PIPESHARD_RESTART_COUNT=str(attempt))
        if attempt:
            environ["PIPESHARD_LAST_FAILURE"] = failure
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return _launch_once(fn, args, nprocs, backend or _device_backend(), environ, left,
                                pg_timeout_s, start_method)
        except WorkerError as err:
            if attempt == max_restarts or err.cause.startswith("job timed out"):
                raise
            failure = str(err).splitlines()[0]
            print(f"pipeshard: {failure}\npipeshard: restarting all {nprocs} ranks "
                  f"(restart {attempt + 1} of {max_restarts}); they resume from the newest "
                  "complete checkpoint", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _launch_once(fn: Callable, args: tuple, nprocs: int, backend: str, environ: dict,
                 timeout_s: float | None, pg_timeout_s: float, start_method: str | None) -> list[Any]:
    """One start of the worker group (see :func:`launch`)."""
    import torch.distributed as dist
    ctx = _mp_context(start_method)
    # The launcher owns the rendezvous store: binding port 0 here cannot race with other jobs.
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout_s))
    pipes = [ctx.Pipe(duplex=False) for _ in range(nprocs)]   # (launcher end, worker end)
    dump_dir = tempfile.mkdtemp(prefix="pipeshard-stacks-")
    # Not daemonic, so workers may start their own children (e.g. DataLoader workers); the
    # `finally` below, the parent-death signal and the launcher watch still leave no orphans.
    procs = [ctx.Process(target=_worker_main, name=f"pipeshard-rank{r}",
                         args=(fn, args, r, nprocs, store.port, pipes[r][1], pg_timeout_s,
                               os.getpid(), backend, environ, dump_dir))
             for r in range(nprocs)]
    stopping: dict[str, Any] = {"signal": None}
    old_handlers: dict[int, Any] = {}
    if _is_main_thread():
        def on_signal(signum, frame):
            if stopping["signal"] is not None:  # a second signal: no more grace
                for p in procs:
                    if p.pid is not None and p.is_alive():
                        p.kill()
                return
            # Forward SIGTERM (a worker may checkpoint its last step), then let the monitor
            # loop wait up to the grace period before the `finally` kills what is left.
            stopping["signal"] = signum
            stopping["deadline"] = time.monotonic() + float(
                os.environ.get("PIPESHARD_TERM_GRACE_S", "30"))
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.terminate()
        for sig in (signal.SIGTERM, signal.SIGINT):
            old_handlers[sig] = signal.signal(sig, on_signal)
    try:
        for p, (_, send_end) in zip(procs, pipes):
            p.start()
            send_end.close()  # the worker holds it now: its death closes the pipe
        return _monitor(procs, [r for r, _ in pipes], timeout_s, stopping, dump_dir)
    finally:
        _stop_all(procs)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        for recv_end, send_end in pipes:
            recv_end.close()
            send_end.close()
        shutil.rmtree(dump_dir, ignore_errors=True)
        del store


def _mp_context(method: str | None = None) -> Any:
    # A fork server that has imported torch once starts each later worker in milliseconds instead
    # of re-importing torch (seconds); it forks before any CUDA or thread pool exists. Elsewhere
    # (or with start_method / PIPESHARD_START_METHOD=spawn) plain spawn.
    method = method or os.environ.get("PIPESHARD_START_METHOD")
    if method not in (None, "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {method!r}")
    if method is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        # torch._dynamo: every optimizer's constructor imports it (about 0.9 s per worker otherwise)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "engine.runtime",
                                    "engine.forkserver_ready"])
    return ctx


def prestart(start_method: str | None = None) -> None:
    """Start the fork server that `launch` will fork its workers from, without waiting for it.

    It imports torch (a few seconds on a small machine) while the caller goes on, e.g. with
    planning; `launch` then finds it ready. A no-op under torchrun / Slurm, with spawn, or when
    the server runs already.

    >>> prestart()  # before the plan; launch(...) afterwards
    """
    from engine.cluster import detect

    if detect() is not None or _mp_context(start_method).get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    forkserver.ensure_running()


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


def _monitor(procs: list, conns: list, timeout_s: float | None, stopping: dict,
             dump_dir: str | None = None) -> list[Any]:
    from multiprocessing.connection import wait as wait_any
    n = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, tuple[float, str, str]] = {}
    info: dict[int, dict] = {}
    deaths: dict[int, tuple[float, int]] = {}  # died without reporting: (time seen, exitcode)
    start = time.monotonic()
    open_conns = {c: r for r, c in enumerate(conns)}

    def drain(block_s: float) -> None:
        if not open_conns:
            time.sleep(block_s)
            return
        timeout = block_s
        while open_conns:
            # also wake up at once when a worker exits (its sentinel)
            ready = wait_any(list(open_conns) + [p.sentinel for p in procs
                                                 if p.exitcode is None], timeout)
            ready = [c for c in ready if c in open_conns]
            if not ready:
                return
            for c in ready:
                try:
                    kind, rank, t, payload = pickle.loads(c.recv_bytes())
                except (EOFError, OSError, pickle.UnpicklingError, ValueError):
                    del open_conns[c]  # the worker exited (or died mid-message)
                    continue
                if kind == "result":
                    results[rank] = pickle.loads(payload)
                elif kind == "error":
                    cause, tb = pickle.loads(payload)
                    errors[rank] = (t, cause, tb)
                elif kind == "info":
                    info.setdefault(rank, {}).update(pickle.loads(payload))
            timeout = 0

    def scan_deaths() -> None:
        for r, p in enumerate(procs):
            if p.exitcode is not None and r not in results and r not in errors \
                    and r not in deaths:
                drain(0)  # what an exited worker sent is still in its pipe
                if r not in results and r not in errors:
                    deaths[r] = (time.time(), p.exitcode)

    while True:
        drain(_POLL_S)
        if stopping["signal"] is not None:
            # Workers got SIGTERM and may be saving a checkpoint: give them their grace period.
            if all(p.exitcode is not None for p in procs) or \
                    time.monotonic() > stopping["deadline"]:
                name = signal.Signals(stopping["signal"]).name
                raise KeyboardInterrupt(f"launcher received signal {stopping['signal']} ({name}); "
                                        "workers were stopped")
            continue
        scan_deaths()
        if errors or deaths:
            # Let the other failures arrive so the root cause can be told: a peer of a killed
            # rank may report "connection closed" before the killed rank's exit is seen.
            settle = time.monotonic() + _SETTLE_S
            while time.monotonic() < settle:
                drain(_POLL_S)
                scan_deaths()
            raise _root_cause(errors, deaths, info)
        if len(results) == n and all(p.exitcode is not None for p in procs):
            return [results[r] for r in range(n)]
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            pending = [r for r in range(n) if r not in results]
            stacks = _dump_stacks([procs[r] for r in pending], pending, dump_dir)
            where = {r: info.get(r, {}).get("stage") for r in pending}
            raise WorkerError(pending[0], where[pending[0]],
                              f"job timed out after {timeout_s:.0f} s; ranks still running: "
                              f"{pending} (stages {[where[r] for r in pending]}). Raise "
                              "timeout_s, or look for a hang (e.g. mismatched schedules); "
                              "where each was stuck is below.", stacks,
                              replica=info.get(pending[0], {}).get("replica"))


def _dump_stacks(procs: list, ranks: list[int], dump_dir: str | None) -> str:
    """Ask hung workers for their Python stacks (SIGUSR1 -> faulthandler) and collect them."""
    if dump_dir is None or not hasattr(signal, "SIGUSR1"):
        return ""
    for p in procs:
        if p.pid is not None and p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(_STACK_DUMP_WAIT_S)
    parts = []
    for r in ranks:
        try:
            with open(os.path.join(dump_dir, f"stack_{r}.txt")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text:
            # the innermost frames of the main thread are what matter; keep them short
            lines = text.splitlines()
            parts.append(f"rank {r}:\n" + "\n".join(lines[:12]))
    return "\n".join(parts)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _root_cause(errors: dict, deaths: dict, info: dict) -> WorkerError:
    # A rank that died without reporting (killed, OOM) is the likely root cause; otherwise the
    # earliest reported exception (peers of a failed rank fail later, on a broken connection).
    if deaths:
        rank = min(deaths, key=lambda r: deaths[r][0])
        code = deaths[rank][1]
        if code < 0:
            name = _signal_name(-code)
            cause = f"the process was killed by {name} (signal {-code}, exit code {code})"
            if -code == signal.SIGKILL:
                cause += (" -- possibly out of memory (the kernel's OOM killer sends SIGKILL; "
                          "see `dmesg`); reduce per-rank memory (smaller microbatches, "
                          "activation_checkpointing, more stages) or find who killed it")
        else:
            cause = (f"the process exited with code {code} without reporting an error "
                     "(os._exit, or a crash in native code); check this rank's stderr")
        tb = ""
    else:
        rank = min(errors, key=lambda r: errors[r][0])
        _, cause, tb = errors[rank]
        code = 1
    others = tuple(sorted((set(errors) | set(deaths)) - {rank}))
    return WorkerError(rank, info.get(rank, {}).get("stage"), cause, tb, code, others,
                       replica=info.get(rank, {}).get("replica"))
