"""pipeshard itself, measured exactly like the peers: ``engine.Pipeline`` in the same harness.

Each rank builds ``engine.Pipeline(spec.layers, ranges, loss_fn=..., schedule=...,
microbatches=m, virtual_stages=v, optimizer=OptimizerConfig("sgd", lr), seed=spec.seed)``
(the engine builds only its own layers, seeded like every other system) and the shared loop
times ``train_step``. Same SGD on the global-batch mean loss as the other rows. The row also has
``stats``: per rank, the median over timed steps of the engine's own ``StepResult.stats``
(forward_s, backward_s, comm_wait_s, idle_s, optimizer_s, peak_activation_bytes, bytes_sent).

Example::

    from experiments.peers.pipeshard_pp import run_pipeshard
    from experiments.peers.spec import tiny_spec

    run_pipeshard(tiny_spec(stages=2), "zb-h1")["step_s"]
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from experiments.peers.common import make_row, timed_loop
from experiments.peers.harness import spawn_workers
from experiments.peers.spec import BenchSpec

__all__ = ["PIPESHARD_SCHEDULES", "run_pipeshard", "median_stats", "STAT_KEYS"]

# name -> model chunks per rank
PIPESHARD_SCHEDULES: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1}


# StepResult.stats figures kept per rank (median over the timed steps).
STAT_KEYS = ("forward_s", "backward_s", "comm_wait_s", "idle_s", "optimizer_s",
             "peak_activation_bytes", "bytes_sent")


def median_stats(stats: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The median of each :data:`STAT_KEYS` figure over steps (figures a step lacks are skipped)."""
    out: dict[str, float] = {}
    for key in STAT_KEYS:
        vals = [float(s[key]) for s in stats if s.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def _worker(rank: int, world_size: int, spec: BenchSpec, schedule: str, return_params: bool,
            options: dict[str, Any]) -> dict[str, Any]:
    from engine import OptimizerConfig, Pipeline

    v = PIPESHARD_SCHEDULES[schedule]
    pipe = Pipeline(spec.layers, spec.ranges_for(v), loss_fn=spec.loss_fn, schedule=schedule,
                    microbatches=spec.microbatches, virtual_stages=v,
                    optimizer=OptimizerConfig(name="sgd", lr=spec.lr), seed=spec.seed, **options)
    is_last = rank == world_size - 1
    stats: list[dict[str, Any]] = []

    def step(inputs: Any, targets: Any) -> float | None:
        # Diagnostics (activation bytes) on the warm-up steps only: timed steps run lean.
        res = pipe.train_step(inputs, targets, diagnose=len(stats) < max(1, spec.warmup))
        stats.append(res.stats)
        return res.loss if is_last else None

    result = timed_loop(spec, step, rank=rank)
    result["stats"] = median_stats(stats[spec.warmup:])
    # diagnostics come from the warm-up steps (the timed ones do not run them)
    result["stats"].update({k: v for k, v in median_stats(stats[:max(1, spec.warmup)]).items()
                            if k not in result["stats"]})
    if return_params:
        result["params"] = {f"{layer}.{name}": t.detach().clone()
                            for layer, params in pipe.named_layer_parameters().items()
                            for name, t in params.items()}
    return result


def run_pipeshard(spec: BenchSpec, schedule: str = "1f1b", *, return_params: bool = False,
                  timeout_s: float = 600.0, **options: Any) -> dict[str, Any]:
    """One row: ``spec`` trained by pipeshard's engine with ``schedule`` on p fresh ranks.

    ``options`` go to ``engine.Pipeline`` (e.g. ``recv_lookahead``).
    """
    if schedule not in PIPESHARD_SCHEDULES:
        raise ValueError(f"unknown pipeshard schedule {schedule!r}; choose from {list(PIPESHARD_SCHEDULES)}")
    p = spec.num_stages
    results = spawn_workers(_worker, p, spec, schedule, return_params, options, timeout_s=timeout_s)
    row = make_row("pipeshard", schedule, spec, results, stages=p, microbatches=spec.microbatches,
                   virtual_stages=PIPESHARD_SCHEDULES[schedule])
    row["stage_ranges"] = [list(r) for r in spec.ranges_for(PIPESHARD_SCHEDULES[schedule])]
    row["stats"] = [r["stats"] for r in results]  # per rank: medians of StepResult.stats
    return row
