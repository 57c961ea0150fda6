"""The runtime's fixed costs on this machine: per action, per message, per step.

A plan predicts a step from its layers' compute times with :func:`engine.simulate`; what the
runtime adds on top of compute is measured here, once per machine, on a model whose layers cost
almost nothing, and charged by the partitioner (``partitioner.FixedCosts``):

- ``message_latency_s`` and ``link_bytes_per_s``: a one-way point-to-point transfer between two
  ranks takes ``latency + bytes / rate`` (ping-pong at several sizes, least-squares line);
- ``action_s``: what each compute action (F, B, I, W) costs beyond its compute: the executor's
  dispatch, posting receives and sends, bookkeeping. Fitted so that the simulator, charging
  ``action_s`` per action and the measured latency per message, reproduces the growth of the
  measured 1F1B step between two microbatch counts;
- ``step_s``: what a step costs beyond its actions (zero_grad, reading the step's verdict, an empty
  optimizer step), the measured step minus the simulated one;
- ``optimizer_s_per_byte``: seconds per parameter byte of each optimizer's update
  (``sgd`` with momentum, ``adam``, ``adamw``), timed on this process's CPU or device.

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

__all__ = ["measure_fixed_costs", "fit_action_cost", "cache_path"]

_SIZES = (256, 64 * 1024, 1024 * 1024)  # message sizes for the latency / rate line


# Bump when the runtime's per-action path changes, so that cached figures are measured again
# (2: receives posted when needed on gloo, recv_lookahead 0; 3: transfers between two computes
# held and issued back to back; 4: no loss all-reduce, the verdict rides the messages).
_RUNTIME_VERSION = 4


def cache_path() -> Path:
    """Where measured costs are kept (``PIPESHARD_CACHE_DIR``, default ~/.cache/pipeshard)."""
    import torch

    root = Path(os.environ.get("PIPESHARD_CACHE_DIR", Path.home() / ".cache" / "pipeshard"))
    key = f"{platform.node()}-torch{torch.__version__}-{os.cpu_count()}cpu-v{_RUNTIME_VERSION}"
    return root / f"fixed_costs-{key}.json"


def measure_fixed_costs(*, microbatches: Sequence[int] = (16, 32), steps: int = 12,
                        use_cache: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
    """Measure (or read from the cache) the fixed costs of the runtime on two local ranks (gloo
    on CPU), one thread each. Returns a dict with the keys of ``partitioner.FixedCosts``."""
    path = cache_path()
    if use_cache and path.exists():
        return json.loads(path.read_text())
    from engine.launch import launch

    results = launch(_worker, 2, tuple(microbatches), steps, timeout_s=timeout_s,
                     backend="gloo", local=True)  # also from rank 0 of a torchrun / Slurm job
    lat, rate = _fit_line(results[0]["link"])
    steps_s = {int(m): t for m, t in results[0]["steps"].items()}
    (m1, t1), (m2, t2) = sorted(steps_s.items())[:2]
    action = fit_action_cost(m1, t1, m2, t2, latency_s=lat)
    from engine.schedules import build_schedule
    from engine.simulate import simulate

    sim = simulate(build_schedule("1f1b", 2, m2), forward_s=action, backward_s=action,
                   comm_s=lat).step_s
    costs = {"action_s": action, "message_latency_s": lat, "link_bytes_per_s": rate,
             "step_s": max(0.0, t2 - sim), "optimizer_s_per_byte": results[0]["optimizer"],
             "measured": {"steps_s": steps_s, "link": results[0]["link"],
                          "when": time.strftime("%Y-%m-%d %H:%M:%S")}}
    text = json.dumps(costs, indent=1)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return json.loads(text)  # the same plain-JSON form as a cached read


def fit_action_cost(m1: int, t1: float, m2: int, t2: float, *, latency_s: float) -> float:
    """The per-action cost ``a`` for which the simulated compute-free 1F1B step on 2 ranks grows
    from ``m1`` to ``m2`` microbatches as the measured one did (``t2 - t1``); bisection, since
    the simulated growth rises with ``a``."""
    from engine.schedules import build_schedule
    from engine.simulate import simulate

    s1, s2 = build_schedule("1f1b", 2, m1), build_schedule("1f1b", 2, m2)

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
    xs, ys = [float(b) for b, _ in points], [float(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    slope = max(slope, 1e-15)
    return max(0.0, my - slope * mx), 1.0 / slope


# ---- the measuring workers (module level: they are pickled) -------------------------------------
def _worker(microbatches: tuple[int, ...], steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    link = [(n, _ping_pong(n)) for n in _SIZES]
    timed = {}
    for m in microbatches:
        timed[m] = _pipeline_step(m, steps)
    opt = _optimizer_cost() if dist.get_rank() == 0 else {}
    torch.distributed.barrier()
    return {"link": link, "steps": timed, "optimizer": opt}


def _ping_pong(nbytes: int, repeats: int = 30) -> float:
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    rank, times = dist.get_rank(), []
    for k in range(repeats + 3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if k >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _pipeline_step(m: int, steps: int) -> float:
    """Median step time of 1F1B on 2 ranks over near-free layers (Linear(4, 4))."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from engine.optim import OptimizerConfig
    from engine.runtime import Pipeline

    pipe = Pipeline([_tiny_layer] * 4, [(0, 2), (2, 4)], loss_fn=nn.functional.mse_loss,
                    schedule="1f1b", microbatches=m, optimizer=OptimizerConfig(name="sgd", lr=1e-3))
    x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
    times = []
    for k in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.train_step(x, y, diagnose=False)
        dist.barrier()
        if k >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
