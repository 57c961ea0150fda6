"""The overhead benchmark: each engine's fixed cost per microbatch action.

A model whose layers cost almost nothing (two ``nn.Linear(8, 8)`` per rank, two samples per
microbatch) runs 1F1B with ``m = 32`` microbatches on ``p = 2`` and ``p = 4`` ranks under
pipeshard, torch.distributed.pipelining and DeepSpeed's PipelineEngine, in fresh processes, one
thread each, in alternating rounds (the bench's job table). A rank runs ``2m`` actions (m
forwards, m backwards) per step, so ``step / 2m`` is what one action costs an engine beyond
its compute: dispatch, transfers and their waiting, bookkeeping. Rows carry
``per_action_us``; pipeshard's rows also carry the engine's own fitted ``action_s``
(``engine.overhead``), the figure its planner charges.

Example::

    python -m experiments.bench bench.overhead=true bench.rounds=3
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from torch import nn

from experiments.bench.jobs import job_table, run_jobs
from experiments.bench.spec import BenchSpec, RegressionBatches, mse_loss, uniform_ranges

__all__ = ["overhead_spec", "run_overhead", "format_overhead", "OVERHEAD_STAGES", "OVERHEAD_M"]

OVERHEAD_STAGES = (2, 4)
OVERHEAD_M = 32
_WIDTH = 8


def overhead_spec(stages: int, microbatches: int = OVERHEAD_M, *, steps: int = 20,
                  warmup: int = 3) -> BenchSpec:
    """Two ``Linear(8, 8)`` per rank, two samples per microbatch, an even split."""
    layers = 2 * stages
    return BenchSpec(layers=[functools.partial(nn.Linear, _WIDTH, _WIDTH)] * layers, loss_fn=mse_loss,
                     batches=RegressionBatches(2 * microbatches, _WIDTH, 0),
                     stage_ranges=tuple(uniform_ranges(layers, stages)), microbatches=microbatches,
                     steps=steps, warmup=warmup, lr=1e-3, name=f"overhead linear{_WIDTH} x{layers}")


def run_overhead(*, stages: Sequence[int] = OVERHEAD_STAGES, microbatches: int = OVERHEAD_M,
                 rounds: int = 3, steps: int = 20, warmup: int = 3,
                 systems: Sequence[str] = ("pipeshard", "torch-pipelining", "deepspeed"),
                 timeout_s: float = 600.0, log: Callable[[str], None] | None = print) -> list[dict[str, Any]]:
    """One row per (system, p): ``step_s`` (median over rounds), ``per_action_us``."""
    from engine.overhead import measure_fixed_costs

    rows = []
    for p in stages:
        spec = overhead_spec(p, microbatches, steps=steps, warmup=warmup)
        jobs = job_table(spec, pipeshard=[("1f1b", spec)] if "pipeshard" in systems else (),
                         torch_schedules=["1f1b"] if "torch-pipelining" in systems else (),
                         deepspeed="deepspeed" in systems, timeout_s=timeout_s)
        for row in run_jobs(jobs, spec, rounds=rounds, log=log).values():
            step = row.get("step_s")
            row.update(section="overhead", per_action_us=step / (2 * microbatches) * 1e6 if step else None)
            rows.append(row)
    if "pipeshard" in systems:
        fitted = measure_fixed_costs()["action_s"]
        for row in rows:
            if row["system"] == "pipeshard":
                row["fitted_action_us"] = fitted * 1e6
    return rows


def format_overhead(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: per p, each system's step and cost per action, and the ratio to torch."""
    torch_us = {r["stages"]: r.get("per_action_us") for r in rows if r["system"] == "torch-pipelining"}
    out = ["| p | system | step ms | per action us | x torch |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["stages"], r["system"])):
        us, ref = r.get("per_action_us"), torch_us.get(r["stages"])
        ratio = f"{us / ref:.2f}" if us and ref else "-"
        step = f"{r['step_s'] * 1e3:.1f}" if r.get("step_s") else f"failed: {r.get('error', '')[:50]}"
        out.append(f"| {r['stages']} | {r['system']} | {step} | {us:.0f} | {ratio} |" if us else
                   f"| {r['stages']} | {r['system']} | {step} | - | - |")
    return "\n".join(out)
