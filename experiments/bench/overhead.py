"""The overhead benchmark: each engine's fixed cost per microbatch action.

A model whose layers cost almost nothing (two ``nn.Linear(8, 8)`` per rank, two samples per
microbatch) runs 1F1B with ``m = 32`` microbatches on ``p = 2`` and ``p = 4`` ranks under
pipeshard, torch.distributed.pipelining and DeepSpeed's PipelineEngine, in fresh processes, one
thread each, in alternating rounds (the bench's job table). A rank runs ``2m`` actions (m
forwards, m backwards) per step, so ``step / 2m`` is what one action costs an engine beyond
its compute: dispatch, transfers and their waiting, bookkeeping. Rows carry
``per_action_us``; pipeshard's rows also carry the engine's own fitted ``action_s``
(``engine.overhead``), the figure its planner charges.

Separate runs in fresh processes swing by 30-50% between invocations on a shared machine, so
:func:`run_paired_overhead` also times pipeshard's and torch's 1F1B **in the same processes**:
both engines are built on every rank and run alternating blocks of steps (the order flips every
block); the figure is the median over blocks of pipeshard's block time over torch's
(``paired_ratio``), which a slow spell longer than a block cannot bias. pipeshard's ``Pipeline``
puts gloo's transport thread under SCHED_BATCH for its whole process (``engine.transport``), so
in the paired blocks torch's runtime runs under it too: the paired ratio compares the engines under
the same thread policy, the fresh-process rows compare them as each one ships.

Example::

    python -m experiments.bench bench.overhead=true bench.rounds=3 bench.overhead_blocks=20
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

from torch import nn

from experiments.bench.jobs import job_table, run_jobs
from experiments.bench.spec import BenchSpec, RegressionBatches, mse_loss, uniform_ranges

__all__ = ["overhead_spec", "run_overhead", "run_paired_overhead", "paired_summary", "format_overhead",
           "OVERHEAD_STAGES", "OVERHEAD_M"]

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


def run_paired_overhead(*, stages: Sequence[int] = OVERHEAD_STAGES, microbatches: int = OVERHEAD_M,
                        blocks: int = 20, block_steps: int = 10, warmup: int = 3,
                        timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """One row per p: pipeshard and torch 1F1B in the same processes, alternating blocks of
    ``block_steps`` steps; ``paired_ratio`` (median over blocks of pipeshard / torch) with its
    quartiles, and each engine's median step and cost per action."""
    from experiments.bench.measure import launch_fresh

    rows = []
    for p in stages:
        spec = overhead_spec(p, microbatches, steps=block_steps, warmup=warmup)
        ranks = launch_fresh(_paired_worker, p, spec, blocks, timeout_s=timeout_s)
        # a block ends when its slowest rank does
        per_block = {k: [max(r[k][b] for r in ranks) for b in range(blocks)] for k in ranks[0]}
        rows.append(dict(paired_summary(per_block["pipeshard"], per_block["torch-pipelining"]),
                         section="overhead-paired", system="pipeshard / torch-pipelining",
                         schedule="1f1b", stages=p, microbatches=microbatches, blocks=blocks,
                         block_steps=block_steps, per_block_s=per_block))
        rows[-1]["per_action_us"] = rows[-1]["step_s"] / (2 * microbatches) * 1e6
    return rows


def paired_summary(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Median and quartiles of the per-block ratio ``ours / theirs``, and each side's median
    seconds per step (``step_s``, ``torch_step_s``).

    >>> paired_summary([2.0, 3.0, 4.0, 10.0], [2.0, 2.0, 2.0, 5.0])["paired_ratio"]
    1.75
    """
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"paired_ratio": statistics.median(ratios), "paired_ratio_p25": q[0], "paired_ratio_p75": q[2],
            "step_s": statistics.median(ours), "torch_step_s": statistics.median(theirs)}


def _paired_worker(spec: BenchSpec, blocks: int) -> dict[str, list[float]]:
    """Both engines on this rank; per block, seconds per step of each (barrier before and after
    a block, none between its steps, so overlap across steps counts as in training)."""
    import torch.distributed as dist

    from experiments.bench.pipeshard_pp import build_pipeline
    from experiments.bench.torch_pp import torch_step_fn

    pipe = build_pipeline(spec, "1f1b")
    engines = {"pipeshard": lambda x, y: pipe.train_step(x, y, diagnose=False),
               "torch-pipelining": torch_step_fn(spec, "1f1b")[0]}
    data = [spec.batches(s) for s in range(spec.steps)]
    for step in engines.values():
        for x, y in data[:spec.warmup]:
            step(x, y)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for b in range(blocks):
        for name in (list(engines) if b % 2 == 0 else list(reversed(engines))):
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in data:
                engines[name](x, y)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / len(data))
    return times


def format_overhead(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: per p, each system's step and cost per action, and the ratio to torch."""
    paired = [r for r in rows if r.get("section") == "overhead-paired"]
    rows = [r for r in rows if r.get("section") != "overhead-paired"]
    torch_us = {r["stages"]: r.get("per_action_us") for r in rows if r["system"] == "torch-pipelining"}
    out = ["| p | system | step ms | per action us | x torch |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["stages"], r["system"])):
        us, ref = r.get("per_action_us"), torch_us.get(r["stages"])
        ratio = f"{us / ref:.2f}" if us and ref else "-"
        step = f"{r['step_s'] * 1e3:.1f}" if r.get("step_s") else f"failed: {r.get('error', '')[:50]}"
        out.append(f"| {r['stages']} | {r['system']} | {step} | {us:.0f} | {ratio} |" if us else
                   f"| {r['stages']} | {r['system']} | {step} | - | - |")
    if paired:
        out += ["", "Same processes, alternating blocks (`run_paired_overhead`):", "",
                "| p | pipeshard ms | torch ms | pipeshard / torch per block: median (quartiles) | blocks x steps |",
                "|---|---|---|---|---|"]
        out += [f"| {r['stages']} | {r['step_s'] * 1e3:.1f} | {r['torch_step_s'] * 1e3:.1f} | "
                f"{r['paired_ratio']:.3f} ({r['paired_ratio_p25']:.3f}-{r['paired_ratio_p75']:.3f}) | "
                f"{r['blocks']} x {r['block_steps']} |" for r in paired]
    return "\n".join(out)
