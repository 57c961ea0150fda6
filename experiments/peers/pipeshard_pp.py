"""pipeshard itself, measured exactly like the peers: ``engine.Pipeline`` in the same harness.

Each rank builds ``engine.Pipeline(spec.layers, ranges, loss_fn=..., schedule=...,
microbatches=m, virtual_stages=v, optimizer=OptimizerConfig("sgd", lr), seed=spec.seed)``
(the engine builds only its own layers, seeded like every other system) and the shared loop
times ``train_step``. Same SGD on the global-batch mean loss as the other rows.

Example::

    from experiments.peers.pipeshard_pp import run_pipeshard
    from experiments.peers.spec import tiny_spec

    run_pipeshard(tiny_spec(stages=2), "zb-h1")["step_s"]
"""

from __future__ import annotations

from typing import Any

from experiments.peers.common import make_row, timed_loop
from experiments.peers.harness import spawn_workers
from experiments.peers.spec import BenchSpec

__all__ = ["PIPESHARD_SCHEDULES", "run_pipeshard"]

# name -> model chunks per rank
PIPESHARD_SCHEDULES: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1}


def _worker(rank: int, world_size: int, spec: BenchSpec, schedule: str, return_params: bool,
            options: dict[str, Any]) -> dict[str, Any]:
    from engine import OptimizerConfig, Pipeline

    v = PIPESHARD_SCHEDULES[schedule]
    pipe = Pipeline(spec.layers, spec.ranges_for(v), loss_fn=spec.loss_fn, schedule=schedule,
                    microbatches=spec.microbatches, virtual_stages=v,
                    optimizer=OptimizerConfig(name="sgd", lr=spec.lr), seed=spec.seed, **options)
    is_last = rank == world_size - 1

    def step(inputs: Any, targets: Any) -> float | None:
        loss = pipe.train_step(inputs, targets).loss
        return loss if is_last else None

    result = timed_loop(spec, step, rank=rank)
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
    return make_row("pipeshard", schedule, spec, results, stages=p, microbatches=spec.microbatches,
                    virtual_stages=PIPESHARD_SCHEDULES[schedule])
