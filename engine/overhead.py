"""The runtime's fixed costs on this machine: per action, per message, per step.

A plan predicts a step from its layers' compute times with :func:`engine.simulate`; what the
runtime adds on top of compute is measured here, once per machine, on a model whose layers cost
almost nothing, and charged by the partitioner (``partitioner.FixedCosts``):

- ``message_latency_s`` and ``link_bytes_per_s``: a one-way point-to-point transfer between two
  ranks takes ``latency + bytes / rate`` (ping-pong at several sizes, least-squares line);
- ``action_s``: what each compute action (F, B, I, W) costs beyond its compute: the executor's
  dispatch, posting receives and sends, bookkeeping. Fitted so that the simulator, charging
  ``action_s`` per action and the measured latency per message, reproduces the growth of the
  measured step with the microbatch count (a least-squares line through four counts, each
  the median of three alternating rounds: on a shared CPU one count measured once moved the fit
  by 2x). Once per mode of the runtime (``engine.schedules.send_mode``), on a schedule that runs
  in it: ``action_s`` for sends waited at the step's end (1F1B forced into it; the zero-bubble
  schedules run so), ``action_s_send_wait`` for sends waited before each compute (1F1B),
  ``action_s_yield`` for a yield to sends not yet waited (interleaved 1F1B, 2 chunks per rank);
- ``step_s`` (and ``step_s_send_wait``, ``step_s_yield``): what a step costs beyond its actions
  (zero_grad, reading the step's verdict, an empty optimizer step), the measured step minus the
  simulated one;
- ``message_busy_s``: what each message end (a send issued, a receive posted) costs a rank *on
  top of* the above when both ranks are computing, as they are in a pipeline's steady state. On
  a CPU the call then competes with the compute of both ranks for the cores (the connection's
  lock, the transport threads it wakes), and takes several times its cost on idle ranks. Measured
  directly, not fitted: both ranks run the same loop of compute units (a matmul of about 2 ms)
  with and without an exchange (one send and one receive) under way during each unit, in
  alternating blocks; the extra time per message end, less the same figure with no compute (the
  idle cost, already inside ``action_s``); the median of three rounds (one reading alone varied
  from 44 to 179 us);
- ``optimizer_s_per_byte``: seconds per parameter byte of each optimizer's update
  (``sgd`` with momentum, ``adam``, ``adamw``), timed on this process's CPU or device.

The figures above are wall times on two ranks with a core each: on a machine whose ranks
outnumber its cores, the CPU a rank spends off its compute is also load on the cores the others
share. :func:`measure_cpu_costs` (its own cache) measures that CPU with thread CPU time (the
main thread's ``time.thread_time``, every thread's ``/proc/self/task/*/schedstat``):

- ``step_cpu_s``: per runtime mode, the main thread's CPU per step outside its actions (the
  intercept of its CPU per step against the microbatch count on the compute-free pipeline);
- ``message_cpu_byte_s`` and ``message_cpu_s``: the CPU of one message end (a send or a receive,
  every thread of the process: gloo's transport thread does the copies) per byte and at zero
  bytes (a least-squares line over ping-pongs of several sizes); ``message_busy_bytes``: the size
  ``message_busy_s`` is measured at (its CPU is inside that figure already);
- ``transport_s_per_step``: per mode and microbatch count, the other threads' CPU per step on the
  compute-free pipeline (a record: what gloo's transport thread costs a step);
- ``shared``: a pipeline of three ranks pinned to two cores, each rank two generic compute layers
  (384 -> 1536 -> 384), its step measured under 1F1B, GPipe and ZB-H2 at 4 and 8 microbatches
  and interleaved 1F1B at 6 (every runtime mode of ``engine.schedules.send_mode``; the runtime's
  defaults, SGD), and one layer's forward, backward and the engine's split backward (I, W)
  timed alone, as a profile times them; a list of two such records, at microbatches of 48 and 12
  samples (alternating in each round). The partitioner fits from them the fraction of the cores'
  time that ranks outnumbering them get and what each compute action costs them beyond its own
  compute (``partitioner.shared.fit_shared_costs``: cores left idle while a woken rank waits for
  one, context switches and the caches they cost, beyond the time-sharing the plan simulates).

Example::

    from engine.overhead import measure_fixed_costs
    costs = measure_fixed_costs()          # dict; cached per machine in ~/.cache/pipeshard
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["measure_fixed_costs", "fit_action_cost", "cache_path", "measure_collectives", "measure_cpu_costs",
           "thread_cpu_s"]

_SIZES = (256, 64 * 1024, 1024 * 1024)  # message sizes for the latency / rate line


# Bump when the runtime's per-action path changes, so that cached figures are measured again
# (2: receives posted when needed on gloo, recv_lookahead 0; 3: transfers between two computes
# held and issued back to back; 4: no loss all-reduce, the verdict rides the messages; 5: the
# busy per-message cost; 6: gloo's transport thread under SCHED_BATCH; 7: the per-action and
# per-step costs of both runtime modes, sends waited at the step's end and, under SCHED_BATCH,
# before each compute; 8: a third mode, yielding to sends in flight, measured on
# interleaved-1f1b; one layer per chunk; 9: a step's first data posted with its header; 10: forward
# outputs checked for NaN/inf on diagnostic steps only, the partial verdict sent down only then;
# 11: on gloo a step's header travels packed with its first data, one message where shapes hold).
_RUNTIME_VERSION = 11
# Bump when the collectives' measurement changes (1: gloo all-reduce, all-gather, reduce-scatter
# on 2 ranks, one thread each; 2: and busy, 4 ranks on 2 cores between compute units).
_COLLECTIVES_VERSION = 2
_COLLECTIVE_SIZES = (4 * 1024, 64 * 1024, 512 * 1024, 2 * 1024 * 1024)  # bytes: the whole tensor
# Bump when the CPU measurement changes (1: main-thread CPU per step, CPU per message end and byte;
# 2: and a pipeline of three ranks on two cores with compute, for the shared cores' efficiency;
# 3: that pipeline at two microbatch sizes, for the efficiency and a cost per action together).
_CPU_VERSION = 3
# the shared-cores pipeline: ranks on cores, microbatch sizes (two, a quarter apart: the efficiency
# and the cost per action are told apart by the actions' size), and (schedule, microbatches, chunks
# per rank) of each run, every runtime mode of engine.schedules.send_mode (interleaved-1f1b: two
# chunks of one layer per rank, microbatches a multiple of the ranks)
_SHARED = {"ranks": 3, "cores": 2, "sizes": (48, 12),
           "runs": (("1f1b", 4, 1), ("gpipe", 4, 1), ("zb-h2", 4, 1), ("1f1b", 8, 1), ("gpipe", 8, 1), ("zb-h2", 8, 1),
                    ("interleaved-1f1b", 6, 2))}
_BUSY_BYTES = 16384   # the message size of the busy per-message cost (``_exchange_cost``)
_CPU_SIZES = (256, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)   # ping-pong sizes of the per-byte CPU


def cache_path(what: str = "fixed_costs") -> Path:
    """Where measured costs are kept (``PIPESHARD_CACHE_DIR``, default ~/.cache/pipeshard):
    ``what`` is ``"fixed_costs"`` (:func:`measure_fixed_costs`), ``"collectives"``
    (:func:`measure_collectives`) or ``"cpu_costs"`` (:func:`measure_cpu_costs`), each with its
    own version."""
    import torch

    version = {"fixed_costs": _RUNTIME_VERSION, "collectives": _COLLECTIVES_VERSION, "cpu_costs": _CPU_VERSION}[what]
    root = Path(os.environ.get("PIPESHARD_CACHE_DIR", Path.home() / ".cache" / "pipeshard"))
    key = f"{platform.node()}-torch{torch.__version__}-{os.cpu_count()}cpu-v{version}"
    return root / f"{what}-{key}.json"


def measure_fixed_costs(*, microbatches: Sequence[int] = (8, 16, 24, 32), steps: int = 12,
                        exchanges: int = 60, use_cache: bool = True,
                        timeout_s: float = 600.0) -> dict[str, Any]:
    """Measure (or read from the cache) the fixed costs of the runtime on two local ranks (gloo
    on CPU), one thread each. Returns a dict with the keys of ``partitioner.FixedCosts``.
    ``steps``: timed steps per microbatch count in each of three alternating rounds;
    ``exchanges``: compute units per block of the busy per-message measurement."""
    path = cache_path()
    if use_cache and path.exists():
        return json.loads(path.read_text())
    from engine.launch import launch

    results = launch(_worker, 2, tuple(microbatches), steps, exchanges, timeout_s=timeout_s,
                     backend="gloo", local=True)  # also from rank 0 of a torchrun / Slurm job
    lat, rate = _fit_line(results[0]["link"])
    steps_s = {mode: {int(m): t for m, t in ts.items()} for mode, ts in results[0]["steps"].items()}
    fitted = {mode: _action_and_step(ts, lat, *_MODES[mode][:2]) for mode, ts in steps_s.items()}
    busy = [r["exchange"] for r in results]
    costs = {"action_s": fitted["step"][0], "message_latency_s": lat, "link_bytes_per_s": rate,
             "step_s": fitted["step"][1], "optimizer_s_per_byte": results[0]["optimizer"],
             "message_busy_s": max(0.0, statistics.fmean(b["busy_s"] - b["idle_s"] for b in busy)),
             "action_s_send_wait": fitted["compute"][0], "step_s_send_wait": fitted["compute"][1],
             "action_s_yield": fitted["yield"][0], "step_s_yield": fitted["yield"][1],
             "measured": {"steps_s": steps_s["step"], "steps_s_send_wait": steps_s["compute"],
                          "steps_s_yield": steps_s["yield"],
                          "link": results[0]["link"], "exchange": busy,
                          "when": time.strftime("%Y-%m-%d %H:%M:%S")}}
    text = json.dumps(costs, indent=1)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return json.loads(text)  # the same plain-JSON form as a cached read


def measure_collectives(*, sizes: Sequence[int] = _COLLECTIVE_SIZES, repeats: int = 20, blocks: int = 4,
                        use_cache: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
    """Measure (or read from the cache) gloo's collectives (``partitioner.collectives.COLLECTIVES``:
    all-reduce, all-gather, reduce-scatter; ``sizes``: bytes of the whole tensor), one thread
    per rank, in two settings:

    - idle: two ranks, nothing else running; ``repeats`` timed calls per collective and size in
      three alternating rounds, the median kept (``points``, fitted as ``latency_s`` and
      ``bytes_per_s``);
    - busy: four ranks on two cores (two pairs, each pair a group), every rank alternating a
      compute unit (about 2 ms of matmul) with a collective on its pair, against the same units
      alone, in ``blocks`` alternating blocks (the median extra seconds per collective). On a CPU
      with more ranks than cores a collective waits for its peer to get a core: several times its
      idle cost. Kept as the time the simulator must charge each collective for the measured step
      (``engine.simulate`` with ``cores``: every rank computing, each progresses at
      cores / ranks, so the charge is the extra wall time x 2 / 4): ``busy_points``.

    Points are ``[kind, ranks, bytes, seconds]``; ``partitioner.collectives.measured_links`` fits
    them (``fit_links``) as the planner's ``Links``."""
    path = cache_path("collectives")
    if use_cache and path.exists():
        return json.loads(path.read_text())
    from engine.launch import launch

    sizes = tuple(int(b) for b in sizes)
    points = launch(_collectives_worker, 2, sizes, int(repeats), timeout_s=timeout_s,
                    backend="gloo", local=True)[0]
    busy = launch(_busy_collectives_worker, 4, sizes[1:], int(blocks), timeout_s=timeout_s,
                  backend="gloo", local=True)[0]
    out = {"points": points, "busy_points": busy, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    text = json.dumps(out, indent=1)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return json.loads(text)


def measure_cpu_costs(*, microbatches: Sequence[int] = (8, 16, 24, 32), steps: int = 12,
                      sizes: Sequence[int] = _CPU_SIZES, use_cache: bool = True,
                      timeout_s: float = 300.0) -> dict[str, Any]:
    """Measure (or read from the cache) the CPU a rank spends off its compute actions, on two
    local gloo ranks, one thread each (the module docstring's list): ``step_cpu_s`` per runtime
    mode, ``message_cpu_s`` and ``message_cpu_byte_s`` per message end, ``message_busy_bytes``.
    ``steps``: timed steps per microbatch count and mode in each of three alternating rounds;
    ``sizes``: the ping-pong message sizes (bytes). Returns a dict with those keys (the
    ``partitioner.FixedCosts`` fields) and ``measured`` (the points)."""
    path = cache_path("cpu_costs")
    if use_cache and path.exists():
        return json.loads(path.read_text())
    from engine.launch import launch

    results = launch(_cpu_worker, 2, tuple(int(m) for m in microbatches), int(steps), tuple(int(b) for b in sizes),
                     timeout_s=timeout_s, backend="gloo", local=True)
    shared = launch(_shared_worker, _SHARED["ranks"], max(1, int(steps) // 2), timeout_s=timeout_s,
                    backend="gloo", local=True)[0]
    main = {mode: [(int(m), statistics.fmean(r["main"][mode][m] for r in results)) for m in r0]
            for mode, r0 in results[0]["main"].items()}
    ends = [(b, statistics.fmean(r["message"][b] for r in results)) for b in results[0]["message"]]
    per_end, per_byte = _line(ends)
    costs = {"step_cpu_s": {mode: max(0.0, _line(pts)[0]) for mode, pts in main.items()},
             "message_cpu_s": max(0.0, per_end), "message_cpu_byte_s": max(0.0, per_byte),
             "message_busy_bytes": _BUSY_BYTES, "shared": shared,
             "measured": {"main_cpu_s_per_step": main, "message_end_cpu_s": ends,
                          "transport_s_per_step": {mode: {m: statistics.fmean(r["transport"][mode][m] for r in results)
                                                          for m in r0} for mode, r0 in results[0]["transport"].items()},
                          "when": time.strftime("%Y-%m-%d %H:%M:%S")}}
    text = json.dumps(costs, indent=1)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return json.loads(text)


def thread_cpu_s() -> dict[int, float]:
    """This process's threads' CPU seconds so far, by thread id (``/proc/self/task/*/schedstat``,
    nanoseconds on the CPU; empty where the platform has no /proc)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0]) * 1e-9
        except (OSError, ValueError, IndexError):
            continue
    return out


def _others_cpu_s(before: dict[int, float], main: int) -> float:
    """CPU seconds of this process's threads other than ``main`` since ``before``
    (:func:`thread_cpu_s`; a thread started since counts from zero)."""
    return sum(s - before.get(tid, 0.0) for tid, s in thread_cpu_s().items() if tid != main)


def _action_and_step(steps_s: dict[int, float], latency_s: float, schedule: str = "1f1b",
                     virtual_stages: int = 1) -> tuple[float, float]:
    """(per action, per step) from ``schedule``'s step times per microbatch count: the step's
    growth with m from a least-squares line through every count (not two points), the per-step
    cost what the simulated compute-free step leaves of the largest count's."""
    from engine.schedules import build_schedule
    from engine.simulate import simulate

    base, per_mb = _line(sorted(steps_s.items()))
    m1, m2 = min(steps_s), max(steps_s)
    t1, t2 = base + m1 * per_mb, base + m2 * per_mb
    action = fit_action_cost(m1, t1, m2, t2, latency_s=latency_s, schedule=schedule,
                             virtual_stages=virtual_stages)
    sim = simulate(build_schedule(schedule, 2, m2, virtual_stages), forward_s=action,
                   backward_s=action, comm_s=latency_s).step_s
    return action, max(0.0, t2 - sim)


def fit_action_cost(m1: int, t1: float, m2: int, t2: float, *, latency_s: float,
                    schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """The per-action cost ``a`` for which the simulated compute-free ``schedule`` step on 2
    ranks grows from ``m1`` to ``m2`` microbatches as the measured one did (``t2 - t1``);
    bisection, since the simulated growth rises with ``a``."""
    from engine.schedules import build_schedule
    from engine.simulate import simulate

    s1 = build_schedule(schedule, 2, m1, virtual_stages)
    s2 = build_schedule(schedule, 2, m2, virtual_stages)

    def growth(a: float) -> float:
        return (simulate(s2, forward_s=a, backward_s=a, comm_s=latency_s).step_s
                - simulate(s1, forward_s=a, backward_s=a, comm_s=latency_s).step_s)

    want = max(0.0, t2 - t1)
    lo, hi = 0.0, max(want, 1e-6)
    while growth(hi) < want:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if growth(mid) < want else (lo, mid)
    return (lo + hi) / 2


def _fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = latency + bytes / rate`` through ``(bytes, seconds)`` points."""
    intercept, slope = _line(points)
    if slope < 1e-15:  # flat: the line through the same mean point, at the slowest rate kept
        intercept += (slope - 1e-15) * statistics.fmean(float(b) for b, _ in points)
        slope = 1e-15
    return max(0.0, intercept), 1.0 / slope


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``(x, y)`` points."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


# ---- the measuring workers (module level: they are pickled) -------------------------------------
def _worker(microbatches: tuple[int, ...], steps: int, exchanges: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from engine.transport import set_transport_threads

    # the link, the busy per-message cost and the runtime's modes (engine.schedules.send_mode),
    # alternated with the counts in three rounds, medians kept, so that one slow spell does not
    # skew one figure (one link measurement once read 1 ms for 64 KiB where the others read
    # 0.1 ms, which left no per-action cost to fit)
    pings: dict[int, list[float]] = {n: [] for n in _SIZES}
    times: dict[str, dict[int, list[float]]] = {w: {m: [] for m in microbatches} for w in _MODES}
    busy: dict[str, list[float]] = {"busy_s": [], "idle_s": []}
    for _ in range(3):
        set_transport_threads("normal")  # the busy cost is charged on every schedule
        for n in _SIZES:
            pings[n].append(_ping_pong(n))
        busy["busy_s"].append(_exchange_cost(exchanges, unit_s=2e-3))  # single readings: 44-179 us
        busy["idle_s"].append(_exchange_cost(exchanges, unit_s=0.0))
        for m in microbatches:
            for wait in _MODES:
                times[wait][m] += _pipeline_steps(m, steps, wait)
    link = [(n, statistics.median(t)) for n, t in pings.items()]
    timed = {w: {m: statistics.median(t) for m, t in ts.items()} for w, ts in times.items()}
    exchange = {k: statistics.median(v) for k, v in busy.items()}
    opt = _optimizer_cost() if dist.get_rank() == 0 else {}
    torch.distributed.barrier()
    return {"link": link, "steps": timed, "optimizer": opt, "exchange": exchange}


# send_wait -> (schedule measured, chunks per rank, transport thread policy): each mode of the
# runtime (engine.schedules.send_mode) measured on a schedule it runs, with the thread policy the
# runtime pairs with it; "step" on 1f1b, which the runtime itself never runs in that mode
_MODES = {"step": ("1f1b", 1, "normal"), "compute": ("1f1b", 1, "batch"),
          "yield": ("interleaved-1f1b", 2, "batch")}


def _exchange_cost(n: int, *, unit_s: float, blocks: int = 10, nbytes: int = _BUSY_BYTES) -> float:
    """This rank's extra seconds per message end when each of ``n`` compute units (a matmul loop
    of about ``unit_s``, the same count on both ranks; none for 0) runs while an exchange with the
    other rank is under way (a receive posted and a send issued before the unit, the receive
    waited after it), against the same units alone: the median over alternating blocks."""
    import torch
    import torch.distributed as dist

    peer = 1 - dist.get_rank()
    a, w = torch.randn(128, 512), torch.randn(512, 512)
    reps = _reps_for(lambda: a @ w, unit_s)
    out, inbox = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)

    def block(exchange: bool) -> float:
        dist.barrier()
        t0, sends = time.perf_counter(), []
        for i in range(n):
            recv = dist.irecv(inbox, peer, tag=i) if exchange else None
            if exchange:
                sends.append(dist.isend(out, peer, tag=i))
            for _ in range(reps):
                a @ w
            if recv is not None:
                recv.wait()
        for work in sends:
            work.wait()
        return time.perf_counter() - t0

    block(True)
    extra = []
    for k in range(blocks):
        order = (True, False) if k % 2 else (False, True)
        t = {ex: block(ex) for ex in order}
        extra.append((t[True] - t[False]) / (2 * n))
    return statistics.median(extra)


def _reps_for(fn: Any, seconds: float) -> int:
    """How many calls of ``fn`` take about ``seconds`` (0 for 0), agreed by both ranks (the
    larger count), so that the two ranks' units are equal."""
    import torch
    import torch.distributed as dist

    reps = 0
    if seconds > 0:
        fn()
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < 10 * seconds:
            fn()
            k += 1
        reps = max(1, round(k * seconds / (time.perf_counter() - t0)))
    agreed = torch.tensor([reps])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed)


def _ping_pong(nbytes: int, repeats: int = 30) -> float:
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    rank, times = dist.get_rank(), []
    for k in range(repeats + 3):
        dist.barrier()
        t0 = time.perf_counter()
        _round_trip(buf, rank)
        if k >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _pipeline_steps(m: int, steps: int, send_wait: str = "step", cpu: bool = False) -> list[Any]:
    """Step times on 2 ranks over near-free layers (Linear(4, 4), one per chunk), after 3 warm-up
    steps, of the runtime mode ``send_wait`` on the schedule and with the transport thread policy
    of ``_MODES``; with ``cpu``, per step (main thread's CPU seconds, the other threads')."""
    import threading

    import torch
    import torch.distributed as dist
    from torch import nn

    from engine.optim import OptimizerConfig
    from engine.runtime import Pipeline

    schedule, v, threads = _MODES[send_wait]
    pipe = Pipeline([_tiny_layer] * (2 * v), [(k, k + 1) for k in range(2 * v)],
                    loss_fn=nn.functional.mse_loss, schedule=schedule, microbatches=m,
                    virtual_stages=v, optimizer=OptimizerConfig(name="sgd", lr=1e-3),
                    send_wait=send_wait, transport_threads=threads)
    x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
    times: list[Any] = []
    me = threading.get_native_id()
    for k in range(steps + 3):
        dist.barrier()
        before = thread_cpu_s() if cpu else {}
        t0, c0 = time.perf_counter(), time.thread_time()
        pipe.train_step(x, y, diagnose=False)
        if cpu:
            times.append((time.thread_time() - c0, _others_cpu_s(before, me)))
        dist.barrier()
        if k >= 3 and not cpu:
            times.append(time.perf_counter() - t0)
    return times[3:] if cpu else times


def _cpu_worker(microbatches: tuple[int, ...], steps: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    """Per runtime mode and microbatch count, the main thread's and the other threads' median CPU
    per step on the compute-free pipeline; per message size, the process's CPU per message end
    of a ping-pong (all threads): three alternating rounds, medians kept."""
    import torch.distributed as dist

    from engine.transport import set_transport_threads

    main: dict[str, dict[int, list[float]]] = {w: {m: [] for m in microbatches} for w in _MODES}
    others: dict[str, dict[int, list[float]]] = {w: {m: [] for m in microbatches} for w in _MODES}
    message: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(3):
        set_transport_threads("normal")
        for b in sizes:
            message[b].append(_message_cpu(b))
        for m in microbatches:
            for wait in _MODES:
                cpu = _pipeline_steps(m, steps, wait, cpu=True)
                main[wait][m] += [c for c, _ in cpu]
                others[wait][m] += [o for _, o in cpu]
    dist.barrier()
    med = lambda d: {w: {m: statistics.median(v) for m, v in ts.items()} for w, ts in d.items()}  # noqa: E731
    return {"main": med(main), "transport": med(others),
            "message": {b: statistics.median(v) for b, v in message.items()}}


def _shared_layer() -> Any:
    from torch import nn
    return nn.Sequential(nn.Linear(384, 1536), nn.GELU(), nn.Linear(1536, 384))


def _alone_layer_s(layer: Any, x: Any, repeats: int, out: dict[str, list[float]]) -> None:
    """Time ``layer`` on ``x`` alone ``repeats`` times, as a profile times a layer
    (``partitioner.profile``): its forward, its backward, and the engine's split backward's
    input-gradient (I) and weight-gradient (W) halves (seconds, appended to ``out``'s lists)."""
    import torch

    from engine.stage import Chunk, PlainBackward

    chunk, grads = Chunk(0, 0, [layer], measure_activations=False), [torch.ones(x.shape[0], 384)]
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = layer(x)
        t1 = time.perf_counter()
        y.backward(grads[0])
        t2 = time.perf_counter()
        chunk.forward(0, x, split=True)
        t3 = time.perf_counter()
        chunk.backward_input(0, grads, PlainBackward())
        t4 = time.perf_counter()
        chunk.backward_weight(0, PlainBackward())
        t5 = time.perf_counter()
        for key, t in (("forward_s", t1 - t0), ("backward_s", t2 - t1), ("input_grad_s", t4 - t3),
                       ("weight_grad_s", t5 - t4)):
            out[key].append(t)


def _shared_worker(steps: int, rounds: int = 3, sizes: Sequence[int] = _SHARED["sizes"]) -> list[dict[str, Any]]:
    """The ``shared`` records (module docstring), one per microbatch size of ``sizes``: ranks
    pinned to ``_SHARED["cores"]`` cores; in each of ``rounds`` rounds, for each size in turn, a
    layer timed alone on rank 0 (the others waiting at a barrier), then each run's ``steps``
    timed steps (the runs' order flips every round); medians."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from engine.optim import OptimizerConfig
    from engine.runtime import Pipeline

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) >= _SHARED["cores"]:
        os.sched_setaffinity(0, allowed[:_SHARED["cores"]])
    torch.set_num_threads(1)
    p = dist.get_world_size()
    chunks = {1: [(2 * r, 2 * r + 2) for r in range(p)], 2: [(k, k + 1) for k in range(2 * p)]}
    pipes = [Pipeline([_shared_layer] * (2 * p), chunks[v], loss_fn=nn.functional.mse_loss, schedule=s,
                      microbatches=m, virtual_stages=v, optimizer=OptimizerConfig(name="sgd", lr=1e-3))
             for s, m, v in _SHARED["runs"]]
    layer = _shared_layer()
    alone = {n: {k: [] for k in ("forward_s", "backward_s", "input_grad_s", "weight_grad_s")} for n in sizes}
    times: dict[int, list[list[float]]] = {n: [[] for _ in pipes] for n in sizes}
    for r in range(rounds):
        for size in sizes:
            dist.barrier()
            if dist.get_rank() == 0:
                probe = torch.randn(size, 384, requires_grad=True)
                _alone_layer_s(layer, probe, 3, {k: [] for k in alone[size]})   # warm-up
                _alone_layer_s(layer, probe, 20, alone[size])
            order = range(len(pipes)) if r % 2 == 0 else range(len(pipes) - 1, -1, -1)
            _shared_steps(pipes, order, size, steps, times[size])
    return [{"ranks": p, "cores": _SHARED["cores"], "layers_per_rank": 2, "size": n, "width": 384, "hidden": 1536,
             "layer": {k: statistics.median(v) for k, v in alone[n].items() if v},
             "runs": [{"schedule": s, "microbatches": m, "virtual_stages": v, "step_s": statistics.median(t)}
                      for (s, m, v), t in zip(_SHARED["runs"], times[n])]} for n in sizes]


def _shared_steps(pipes: list[Any], order: Any, size: int, steps: int, times: list[list[float]]) -> None:
    """Time ``steps`` steps (after two untimed) of each pipeline in ``order`` on microbatches of
    ``size`` samples, appending each step's seconds to ``times[i]``."""
    import torch
    import torch.distributed as dist

    for i in order:
        m = _SHARED["runs"][i][1]
        x, y = torch.randn(size * m, 384), torch.randn(size * m, 384)
        for k in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            pipes[i].train_step(x, y, diagnose=False)
            dist.barrier()
            if k >= 2:
                times[i].append(time.perf_counter() - t0)


def _round_trip(buf: Any, rank: int) -> None:
    """One ping-pong of ``buf`` between ranks 0 and 1 (rank 0 sends first)."""
    import torch.distributed as dist

    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _message_cpu(nbytes: int, repeats: int = 20) -> float:
    """This process's CPU seconds (every thread) per message end of a ping-pong of ``nbytes``
    (each round trip: one send and one receive on each rank), after 3 untimed round trips."""
    import threading

    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    rank, me = dist.get_rank(), threading.get_native_id()
    total = 0.0
    for k in range(repeats + 3):
        dist.barrier()
        before, c0 = thread_cpu_s(), time.thread_time()
        _round_trip(buf, rank)
        if k >= 3:
            total += time.thread_time() - c0 + _others_cpu_s(before, me)
    return total / (2 * repeats)


def _collectives_worker(sizes: tuple[int, ...], repeats: int) -> list[list[Any]]:
    """Per collective and size, the median seconds of one call on this group (every rank
    starting together after a barrier): ``[[kind, ranks, bytes, seconds], ...]``."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    ops = _COLLECTIVE_OPS
    times: dict[tuple[str, int], list[float]] = {(k, b): [] for k in ops for b in sizes}
    for _ in range(3):
        for b in sizes:
            numel = max(n, b // 4 // n * n)
            whole, part = torch.ones(numel), torch.ones(numel // n)
            for kind, op in ops.items():
                for k in range(repeats + 2):
                    dist.barrier()
                    t0 = time.perf_counter()
                    op(whole, part)
                    if k >= 2:
                        times[kind, b].append(time.perf_counter() - t0)
    return [[kind, n, b, statistics.median(t)] for (kind, b), t in times.items()]


_COLLECTIVE_OPS = {
    "all_reduce": lambda whole, part, group=None: _dist().all_reduce(whole, group=group),
    "all_gather": lambda whole, part, group=None: _dist().all_gather_into_tensor(whole, part, group=group),
    "reduce_scatter": lambda whole, part, group=None: _dist().reduce_scatter_tensor(part, whole, group=group),
}


def _dist() -> Any:
    import torch.distributed as dist
    return dist


def _busy_collectives_worker(sizes: tuple[int, ...], blocks: int, units: int = 15,
                             unit_s: float = 2e-3) -> list[list[Any]]:
    """Four ranks pinned to two cores, in pairs: per collective and size, the extra seconds per
    collective of ``units`` compute units each followed by a collective on the pair, against the
    units alone (median over ``blocks`` alternating blocks), times cores / ranks (what a
    time-shared simulated rank is charged): ``[[kind, 2, bytes, seconds], ...]``."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = min(2, len(allowed)) if allowed else 1
    if allowed:
        os.sched_setaffinity(0, allowed[:cores])
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = pairs[rank // 2]
    a, w = torch.randn(128, 512), torch.randn(512, 512)
    reps = _reps_for(lambda: a @ w, unit_s)
    out = []
    for b in sizes:
        whole, part = torch.ones(max(2, b // 8 * 2)), torch.ones(max(1, b // 8))
        for kind, op in _COLLECTIVE_OPS.items():
            def block(coll: bool) -> float:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(units):
                    for _ in range(reps):
                        a @ w
                    if coll:
                        op(whole, part, group)
                return time.perf_counter() - t0

            block(True)
            extra = []
            for k in range(blocks):
                t = {c: block(c) for c in ((True, False) if k % 2 else (False, True))}
                extra.append((t[True] - t[False]) / units)
            out.append([kind, 2, b, max(0.0, statistics.median(extra)) * cores / world])
    return out


def _tiny_layer() -> Any:
    from torch import nn
    return nn.Linear(4, 4)


def _optimizer_cost(numel: int = 1 << 20, repeats: int = 5) -> dict[str, float]:
    """Seconds per parameter byte of one update, per optimizer (fp32 parameters)."""
    import torch

    out = {}
    for name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
                       ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3))):
        p = torch.nn.Parameter(torch.zeros(numel))
        p.grad = torch.ones(numel)
        opt = make([p])
        opt.step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) / (numel * 4)
    return out
