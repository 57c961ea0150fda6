"""How every benchmark run is started and measured, and how per-rank results become one row.

Start: `launch_fresh(fn, nprocs, *args)` runs ``fn(*args)`` on ``nprocs`` ranks with
`engine.launch` in fresh interpreters (``start_method="spawn"``: nothing imported before, the
same for every system), gloo, one thread per rank; a failed or hung run raises
`engine.launch.WorkerError` (the benchmark turns it into an error row).

Timing: before each step all ranks meet at a barrier, the clock starts, the system runs one
full training step (forward, backward, optimizer), and the clock stops after a second barrier,
so a step's time is the pipeline's wall time, not one rank's share. Batches are made before
the first barrier (not timed). The first ``warmup`` steps are dropped; the row reports the
per-step maximum over ranks, its median, and each rank's peak RSS.

Example::

    def _worker(spec):                                   # module level: picklable
        result = timed_loop(spec, step_fn)               # step_fn(inputs, targets) -> loss or None
        return result
    results = launch_fresh(_worker, 2, spec)
    row = make_row("single", "microbatched", spec, results, stages=1, microbatches=m)
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from experiments.bench.spec import BenchSpec

__all__ = ["launch_fresh", "timed_loop", "make_row", "peak_rss_bytes", "named_params"]

StepFn = Callable[[Tensor, Tensor], "float | None"]


def launch_fresh(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """``fn(*args)`` on ``nprocs`` fresh gloo ranks (`engine.launch`); the results by rank.

    Raises `engine.launch.WorkerError` when a rank fails or the run takes over ``timeout_s``.
    """
    from engine.launch import launch

    return launch(fn, nprocs, *args, timeout_s=timeout_s, pg_timeout_s=max(timeout_s, 10.0),
                  backend="gloo", start_method="spawn")


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed_loop(spec: BenchSpec, step_fn: StepFn) -> dict[str, Any]:
    """Run ``warmup + steps`` steps; return this rank's times, losses and peak RSS."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    times: list[float] = []
    losses: list[float | None] = []
    prof = None
    for step in range(spec.warmup + spec.steps):
        inputs, targets = spec.batches(step)
        if step == spec.warmup and spec.trace_dir:
            from experiments.bench.trace import start_profiler
            prof = start_profiler()
        _barrier()
        t0 = time.perf_counter()
        loss = step_fn(inputs, targets)
        _barrier()
        times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
    out = {"rank": rank, "times": times[spec.warmup:], "losses": losses,
           "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads()}
    if prof is not None:
        from experiments.bench.trace import finish_profiler
        out["trace"] = finish_profiler(prof, f"{spec.trace_dir}/r{rank}.json", sum(out["times"]))
    return out


def named_params(modules: list[nn.Module]) -> dict[str, Tensor]:
    """Parameters keyed by global names (chunks are built with global layer indices as names)."""
    out: dict[str, Tensor] = {}
    for m in modules:
        for name, p in m.named_parameters():
            out[name] = p.detach().clone()
    return out


def make_row(system: str, schedule: str, spec: BenchSpec, results: list[dict[str, Any]], *,
             stages: int, microbatches: int, virtual_stages: int = 1) -> dict[str, Any]:
    """Combine the per-rank results of one run into a bench row."""
    steps = len(results[0]["times"])
    step_s_all = [max(r["times"][k] for r in results) for k in range(steps)]
    step_s = statistics.median(step_s_all)
    losses = next((r["losses"] for r in results if r["losses"] and r["losses"][-1] is not None), [])
    batch = int(spec.batches(0)[0].shape[0])
    row: dict[str, Any] = {
        "system": system, "schedule": schedule, "stages": stages, "microbatches": microbatches,
        "virtual_stages": virtual_stages,
        "step_s": step_s, "step_s_all": step_s_all, "samples_per_s": batch / step_s,
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in results],
        "threads": [r["threads"] for r in results],
        "loss": losses[-1] if losses else None, "losses": losses,
    }
    if all("trace" in r for r in results):
        row["trace"] = [r["trace"] for r in results]
    params: dict[str, Tensor] = {}
    for r in results:
        params.update(r.get("params") or {})
    if params:
        row["params"] = params  # only when asked for (tests); not JSON
    return row

