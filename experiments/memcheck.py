"""`python -m experiments.memcheck [overrides]`: the plan's per-rank peak memory beside MemTracker's.

For each layout of a grid (schedules, ZeRO stages with two replicas, fp32 and bf16, recompute
off / on / auto, SGD with momentum and AdamW) the configured model is profiled and planned as
`experiments.train` would, then trained for a few steps on local ranks; every step is measured
with torch's MemTracker (`engine.memtrack`, independent of the planner's model). A row per
pipeline rank of replica 0: predicted peak (`plan.rank_memory_bytes`), measured peak (the
largest over the steps), their ratio, and the measured breakdown. Layouts of one world size
share one spawned job.

Example:
    python -m experiments.memcheck model.dim=256 model.layers=8
    python -m experiments.memcheck --only "1f1b fp32 adamw"

    >>> [c.name for c in GRID][:2]
    ['gpipe fp32 adamw', '1f1b fp32 adamw']
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Layout", "GRID", "BASE", "measure_layouts", "format_rows", "main", "smallest_limit"]

# The model every layout of the grid trains (small enough for the CPU, large enough that the
# per-parameter terms and activations, not the runtime's constants, make the peak).
BASE: tuple[str, ...] = ("model.dim=128", "model.layers=4", "model.seq_len=64",
                         "model.heads=4", "train.batch_size=16", "pipeline.microbatches=4",
                         "partitioner.repeats=1", "partitioner.sweeps=1", "partitioner.warmup=0", "partitioner.fixed_costs=false",
                         "data=synthetic", "logger.mode=disabled")


@dataclass(frozen=True)
class Layout:
    """One row of the grid: a name and the overrides on top of the base config.
    ``limit_fraction``: run under a memory limit of this fraction of the smallest limit the
    planner fits without recomputation (with ``activation_checkpointing=auto``, so that some
    chunks must recompute)."""

    name: str
    overrides: tuple[str, ...]
    limit_fraction: float | None = None


def _grid() -> list[Layout]:
    out = [Layout(f"{s} fp32 adamw", (f"pipeline.schedule={s}", f"pipeline.virtual_stages={v}"))
           for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1),
                        ("zbv", 2))]
    out.append(Layout("1f1b fp32 sgd(momentum)", ("optimizer=sgd",)))
    out.append(Layout("1f1b fp32 adamw recompute", ("pipeline.activation_checkpointing=true",)))
    for s in ("1f1b", "zb-h1"):
        out.append(Layout(f"{s} fp32 adamw recompute auto",
                          (f"pipeline.schedule={s}", "pipeline.activation_checkpointing=auto"), 0.97))
    for z in (0, 1, 2):
        for prec in ("fp32", "bf16"):
            out.append(Layout(f"1f1b {prec} adamw zero{z} dp2",
                              ("pipeline.data_parallel=2", f"optimizer.zero_stage={z}", f"precision={prec}")))
    out.append(Layout("1f1b bf16-autocast adamw zero1 dp2",
                      ("pipeline.data_parallel=2", "optimizer.zero_stage=1", "precision=bf16-autocast")))
    # DeepSpeed cannot take autograd edges as backward roots: zb-h1 splits I/W per layer there
    out.append(Layout("zb-h1 fp32 adamw zero1 dp2",
                      ("pipeline.schedule=zb-h1", "pipeline.data_parallel=2", "optimizer.zero_stage=1")))
    return out


GRID: list[Layout] = _grid()


def smallest_limit(prof: Any, kwargs: dict[str, Any], checkpointing: str) -> int:
    """The smallest per-rank limit (bytes) the planner fits ``prof`` in with ``kwargs``
    (``experiments.wiring.partition_kwargs``) and ``checkpointing``, by bisection."""
    import partitioner

    def fits(limit: int) -> bool:
        try:
            partitioner.partition(prof, **{**kwargs, "memory_limit_bytes": limit,
                                           "activation_checkpointing": checkpointing})
            return True
        except partitioner.PartitionError:
            return False

    lo, hi = 1, 1 << 34
    while hi - lo > max(1, lo // 2000):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _prepare(layout: Layout, base: Sequence[str]) -> dict[str, Any]:
    """The resolved config and plan of a layout (profiled here, as `experiments.train` does)."""
    from experiments.config import as_config, compose_config
    from experiments.models import build_model
    from experiments.wiring import make_plan, partition_kwargs, profile_model, world_size

    cfg = compose_config(*base, *layout.overrides)
    spec = build_model(cfg.model)
    prof = profile_model(cfg, spec)
    if layout.limit_fraction is not None:
        limit = int(smallest_limit(prof, partition_kwargs(cfg), "off") * layout.limit_fraction)
        cfg = compose_config(*base, *layout.overrides, f"partitioner.memory_limit={limit}B")
    plan = make_plan(cfg, spec, prof)
    return {"name": layout.name, "config": as_config(cfg), "plan": plan, "world": world_size(cfg)}


def _worker(jobs: list[dict], steps: int) -> list[dict]:
    """Train each job for ``steps`` steps, every one measured; this rank's peaks."""
    import os

    import torch

    from engine import OptimizerConfig, Pipeline
    from experiments.data import make_dataset
    from experiments.models import build_model
    from experiments.wiring import engine_optimizer_kwargs, pipeline_kwargs

    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = []
    for job in jobs:
        cfg, plan = job["config"], job["plan"]
        spec = build_model(cfg.model)
        pipe = Pipeline(spec.layers, loss_fn=spec.loss_fn,
                        optimizer=OptimizerConfig(**engine_optimizer_kwargs(cfg)),
                        **pipeline_kwargs(cfg, plan.stage_ranges, ties=spec.ties,
                                          recompute=plan.stage_recompute or None))
        data, batch = make_dataset(cfg), int(cfg.train.batch_size)
        peaks, kinds, losses = [], [], []
        for step in range(steps):
            x, y = data.train_batch(step, batch)
            res = pipe.train_step(x, y, measure_memory=True)
            mem = res.stats["memory_measured"]
            peaks.append(mem["peak_bytes"])
            kinds.append(mem["breakdown"])
            losses.append(res.loss)
        top = max(range(steps), key=peaks.__getitem__)
        out.append({"peak": peaks[top], "breakdown": kinds[top], "peaks": peaks, "losses": losses,
                    "rank": pipe.mesh.pipeline_rank, "replica": pipe.mesh.replica,
                    "numel": sum(p.numel() for p in pipe.layer_module.parameters())})
    return out


def _rows(job: dict[str, Any], per_rank: list[list[dict]]) -> list[dict[str, Any]]:
    """One row per pipeline rank of replica 0: the plan's peak beside the measured one."""
    plan, rows = job["plan"], []
    for res in (r[0] for r in per_rank):
        if res["replica"] != 0:
            continue
        j = res["rank"]
        pred = float(plan.rank_memory_bytes[j])
        rows.append({"layout": job["name"], "rank": j, "predicted": pred, "measured": res["peak"],
                     "ratio": res["peak"] / pred, "breakdown": res["breakdown"],
                     "predicted_breakdown": plan.rank_memory_breakdown[j],
                     "recompute": list(plan.stage_recompute), "losses": res["losses"],
                     "numel": res["numel"]})
    return sorted(rows, key=lambda r: r["rank"])


def measure_layouts(layouts: Sequence[Layout], base: Sequence[str] = BASE, steps: int = 3,
                    timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """Plan and measure every layout; one row per (layout, pipeline rank of replica 0):
    ``layout``, ``rank``, ``predicted``, ``measured``, ``ratio`` (measured / predicted),
    ``breakdown`` (measured, by kind), ``predicted_breakdown``, ``recompute`` and ``losses``."""
    from engine.launch import launch

    rows: list[dict[str, Any]] = []
    for job in (_prepare(lay, base) for lay in layouts):
        # one job per layout: a finished layout's optimizer (DeepSpeed keeps references to
        # its engine) must not be alive, and counted, while the next one is measured
        per_rank = launch(_worker, job["world"], [job], steps, timeout_s=timeout_s, backend="gloo")
        rows += _rows(job, per_rank)
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (MiB; measured / predicted)."""
    head = "| layout | rank | predicted MiB | measured MiB | measured / predicted |\n|---|---|---|---|---|\n"
    return head + "".join(f"| {r['layout']} | {r['rank']} | {r['predicted'] / 2**20:.2f} | "
                          f"{r['measured'] / 2**20:.2f} | {r['ratio']:.3f} |\n" for r in rows)


def main(argv: Sequence[str] | None = None) -> None:
    """Measure the grid (or the layouts named by ``--only``) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides on top of the grid's base")
    ap.add_argument("--only", action="append", default=[], help="a layout name (repeatable)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows (with breakdowns) here")
    args = ap.parse_args(argv)
    layouts = [lay for lay in GRID if not args.only or lay.name in args.only]
    rows = measure_layouts(layouts, (*BASE, *args.overrides), steps=args.steps)
    print(format_rows(rows), flush=True)
    if args.json:
        import json
        from pathlib import Path
        Path(args.json).write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"largest deviation: {worst['layout']} rank {worst['rank']}: {worst['ratio'] - 1:+.1%}")


if __name__ == "__main__":
    main()
