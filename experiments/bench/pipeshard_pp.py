"""pipeshard itself, measured exactly like the peers: ``engine.Pipeline`` in the same harness.

Each rank builds ``engine.Pipeline(spec.layers, ranges, loss_fn=..., schedule=...,
microbatches=m, virtual_stages=v, optimizer=OptimizerConfig("sgd", lr), seed=spec.seed)``
(the engine builds only its own layers, seeded like every other system) and the shared loop
times ``train_step``. Same SGD on the global-batch mean loss as the other rows. The row also has
``stats``: per rank, the median over timed steps of the engine's own ``StepResult.stats``
(forward_s, backward_s, comm_wait_s, comm_issue_s, idle_s, optimizer_s, peak_activation_bytes,
bytes_sent).

Example::

    from experiments.bench.pipeshard_pp import run_pipeshard
    from experiments.bench.spec import tiny_spec

    run_pipeshard(tiny_spec(stages=2), "zb-h1")["step_s"]
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from experiments.bench.trace import traced
from experiments.bench.measure import launch_fresh, make_row, timed_loop
from experiments.bench.spec import BenchSpec
from experiments.wiring import schedule_chunks

__all__ = ["run_pipeshard", "build_pipeline", "median_stats", "STAT_KEYS"]


# StepResult.stats figures kept per rank (median over the timed steps).
STAT_KEYS = ("forward_s", "backward_s", "comm_wait_s", "comm_issue_s", "idle_s", "optimizer_s",
             "peak_activation_bytes", "bytes_sent")


def median_stats(stats: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The median of each :data:`STAT_KEYS` figure over steps (figures a step lacks are skipped)."""
    out: dict[str, float] = {}
    for key in STAT_KEYS:
        vals = [float(s[key]) for s in stats if s.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def build_pipeline(spec: BenchSpec, schedule: str, **options: Any) -> Any:
    """This rank's ``engine.Pipeline`` for ``spec`` (plain SGD, the spec's split and seed);
    ``options`` go to ``Pipeline`` (``virtual_stages``: default the schedule's), except
    ``schedule_kwargs`` (``Plan.schedule_kwargs()`` as pairs): the schedule is then built with
    them (zb-auto from the plan's costs)."""
    from engine import OptimizerConfig, Pipeline

    v = options.pop("virtual_stages", None) or schedule_chunks(schedule)
    built: Any = schedule
    if options.get("schedule_kwargs"):   # a plan's zb-auto: built from its costs (Plan.schedule_kwargs)
        from engine.schedules import build_schedule
        built = build_schedule(schedule, spec.num_stages, spec.microbatches, v,
                               **dict(options.pop("schedule_kwargs")))
    options.pop("schedule_kwargs", None)
    return Pipeline(spec.layers, spec.ranges_for(v), loss_fn=spec.loss_fn, schedule=built,
                    microbatches=spec.microbatches, virtual_stages=v,
                    optimizer=OptimizerConfig(name="sgd", lr=spec.lr), seed=spec.seed, **options)


def _worker(spec: BenchSpec, schedule: str, return_params: bool, options: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    pipe = build_pipeline(spec, schedule, **options)
    is_last = dist.get_rank() == dist.get_world_size() - 1
    stats: list[dict[str, Any]] = []

    def step(inputs: Any, targets: Any) -> float | None:
        # Diagnostics (activation bytes) on the warm-up steps only: timed steps run lean.
        res = pipe.train_step(inputs, targets, diagnose=len(stats) < max(1, spec.warmup))
        stats.append(res.stats)
        return res.loss if is_last else None

    result = timed_loop(spec, step)
    result["stats"] = median_stats(stats[spec.warmup:])
    # diagnostics come from the warm-up steps (the timed ones do not run them)
    result["stats"].update({k: v for k, v in median_stats(stats[:max(1, spec.warmup)]).items()
                            if k not in result["stats"]})
    if return_params:
        result["params"] = {f"{layer}.{name}": t.detach().clone()
                            for layer, params in pipe.named_layer_parameters().items()
                            for name, t in params.items()}
    return result


def run_pipeshard(spec: BenchSpec, schedule: str = "1f1b", *, virtual_stages: int | None = None,
                  return_params: bool = False, timeout_s: float = 600.0, **options: Any) -> dict[str, Any]:
    """One row: ``spec`` trained by pipeshard's engine with ``schedule`` on p fresh ranks.

    ``virtual_stages``: chunks per rank (default: the schedule's, 2 for interleaved);
    ``options`` go to ``engine.Pipeline`` (e.g. ``recv_lookahead``, ``max_inflight``).
    """
    v = virtual_stages or schedule_chunks(schedule)  # an unknown schedule fails here, naming the ones there are
    p = spec.num_stages
    spec = traced(spec, f"pipeshard_{schedule}_v{v}_m{spec.microbatches}_cap{options.get('max_inflight')}")
    results = launch_fresh(_worker, p, spec, schedule, return_params, dict(options, virtual_stages=v),
                           timeout_s=timeout_s)
    row = make_row("pipeshard", schedule, spec, results, stages=p, microbatches=spec.microbatches,
                   virtual_stages=v)
    if options.get("max_inflight") is not None:
        row["max_inflight"] = options["max_inflight"]
    row["stage_ranges"] = [list(r) for r in spec.ranges_for(v)]
    row["stats"] = [r["stats"] for r in results]  # per rank: medians of StepResult.stats
    return row
