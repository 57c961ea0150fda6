"""`python -m experiments.memcheck [--grid small|full] [overrides]`: the plan's per-rank peak memory
beside MemTracker's.

For each layout of a grid the configured model is profiled and planned as `experiments.train`
would, then trained for a few steps on local ranks; every step is measured with torch's
MemTracker (`engine.memtrack`, independent of the planner's model). A row per pipeline rank:
predicted peak (`plan.rank_memory_bytes`), measured peak (the largest over the
steps of MemTracker's peak less the tensors alive before the step that are neither
parameters, gradients nor optimizer state: the runner's `rank_memory_measured`, see
`experiments.runner.memory_warning`; of the largest replica, which the plan books), their
ratio, and both breakdowns. Layouts run one
spawned job each.

The full grid (:func:`full_grid`) covers every schedule, fp32 and bf16, measured and analytic
profiles, a small head (vocabulary 2 x dim) and a large one (32 x dim), ZeRO 0/1/2 with two
replicas, recomputation on, off and auto under a limit (the plan recomputes where the limit
needs it, and the run must stay under the limit), SGD with momentum and AdamW, the chunked
loss head, ZeRO-3 (FSDP2) and tensor parallelism (pp2 x tp2 on the GPT and a Hugging Face Llama,
tp2 x dp2 under ZeRO-3 and ZeRO-0; each tp rank a row, with its parameter shards against the
whole tensors). The small grid (:data:`SMALL_GRID`) is a few layouts, the large head under zb-h1
among them, fast enough for a test.

Example:
    python -m experiments.memcheck --grid small
    python -m experiments.memcheck --grid full --json rows.json
    python -m experiments.memcheck --only "1f1b fp32 adamw measure v256"
    python -m experiments.memcheck --match zbv model.layers=6

    >>> [c.name for c in GRID][:2]
    ['gpipe fp32 adamw measure v256', 'gpipe fp32 adamw analytic v256']
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Layout", "GRID", "SMALL_GRID", "ZERO3_GRID", "TP_GRID", "LAYER_RECOMPUTE_GRID", "ZERO_SCHEDULE_GRID", "LLAMA", "BASE",
           "SCHEDULE_CHUNKS", "full_grid", "layout", "measure_layouts", "format_rows", "summary", "select", "main",
           "smallest_limit"]

# The model every layout of the grid trains (small enough for the CPU, large enough that the
# per-parameter terms and activations, not the runtime's constants, make the peak). The head's
# vocabulary is each layout's own (``model.vocab``).
BASE: tuple[str, ...] = ("model.dim=128", "model.layers=4", "model.seq_len=64",
                         "model.heads=4", "train.batch_size=16", "pipeline.microbatches=4",
                         "partitioner.repeats=1", "partitioner.sweeps=1", "partitioner.warmup=0", "partitioner.fixed_costs=false",
                         "data=synthetic", "logger.mode=disabled")
SMALL_VOCAB, LARGE_VOCAB = 256, 4096          # 2 x and 32 x model.dim
# every schedule of engine.schedules.SCHEDULES with the chunks per rank it runs
SCHEDULE_CHUNKS: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zb-h2": 1,
                                   "zbv": 2, "zb-auto": 1, "dualpipev": 2}


@dataclass(frozen=True)
class Layout:
    """One row of the grid: a name and the overrides on top of the base config.
    ``limit_fraction``: run under a memory limit of this fraction of the smallest limit the
    planner fits without recomputation (with ``activation_checkpointing=auto``, so that some
    chunks must recompute)."""

    name: str
    overrides: tuple[str, ...]
    limit_fraction: float | None = None


def layout(schedule: str = "1f1b", precision: str = "fp32", *, optimizer: str = "adamw",
           profile: str = "measure", vocab: int = SMALL_VOCAB, zero: int | None = None,
           recompute: str = "off", loss: str = "full", limit_fraction: float | None = None,
           reshard: str | None = None, granularity: str = "chunk", tp: int = 1, stages: int = 2,
           model: str = "gpt") -> Layout:
    """The layout of one point of the grid, named by its values (``zero``: a ZeRO stage with
    two replicas; None: one replica). ``recompute``: off | on | auto (auto needs
    ``limit_fraction``). ``reshard``: ZeRO-3's ``optimizer.reshard_after_forward`` (true |
    false; None: the config's auto). ``granularity``: `pipeline.recompute_granularity` (named
    " layer" when not the default chunk). ``tp``: ranks per tensor-parallel group; ``stages``:
    pipeline stages; ``model``: "gpt" (the base's) or "llama" (a random Hugging Face Llama of
    the same width and depth, 2 KV heads, untied).

    >>> layout("zbv", "bf16", vocab=4096, zero=1).name
    'zbv bf16 adamw measure v4096 zero1 dp2'
    >>> layout(tp=2, model="llama").name
    '1f1b fp32 adamw measure v256 llama pp2 tp2'
    """
    if recompute == "auto" and limit_fraction is None:
        raise ValueError("recompute='auto' needs limit_fraction (a limit the plan must recompute under)")
    opt = "sgd(momentum)" if optimizer == "sgd" else optimizer
    over = [f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={SCHEDULE_CHUNKS[schedule]}",
            f"precision={precision}", f"partitioner.profile={profile}", f"model.vocab={vocab}"]
    over += ["optimizer=sgd"] if optimizer == "sgd" else []   # conf/optimizer/sgd.yaml: momentum 0.9
    name = f"{schedule} {precision} {opt} {profile} v{vocab}"
    if zero is not None:
        over += ["pipeline.data_parallel=2", f"optimizer.zero_stage={zero}"]
        name += f" zero{zero} dp2"
    if reshard is not None:
        over.append(f"optimizer.reshard_after_forward={reshard}")
        name += f" reshard-{reshard}"
    if recompute != "off":
        over.append(f"pipeline.activation_checkpointing={'true' if recompute == 'on' else 'auto'}")
        name += " recompute" + (" auto" if recompute == "auto" else "")
    if granularity != "chunk":
        over.append(f"pipeline.recompute_granularity={granularity}")
        name += f" {granularity}"
    if loss != "full":
        over.append(f"model.loss={loss}")
        name += f" {loss}"
    if model == "llama":
        over = ["model=hf_llama", *LLAMA, *over]
    if tp > 1 or stages != 2 or model != "gpt":
        over += [f"pipeline.stages={stages}", f"pipeline.tensor_parallel={tp}"]
        name += f"{' llama' if model == 'llama' else ''} pp{stages} tp{tp}"
    return Layout(name, tuple(over), limit_fraction)


# the Hugging Face Llama of the tensor-parallel layouts: the base's width and depth, 2 KV heads,
# untied (tensor parallelism shards the embedding and the head apart)
LLAMA: tuple[str, ...] = ("model.kv_heads=2", "model.intermediate=344", "model.tie_embeddings=false")


# ZeRO-3 (FSDP2) over two replicas: both reshard policies, one and two chunks per rank, whole and
# split backward, fp32 and bf16 (16-bit compute on fp32 sharded masters)
ZERO3_GRID: list[Layout] = [
    layout("1f1b", "fp32", zero=3, reshard="false"), layout("1f1b", "fp32", zero=3, reshard="true"),
    layout("zb-h1", "fp32", zero=3, reshard="false"), layout("zb-h1", "fp32", zero=3, reshard="true"),
    layout("interleaved-1f1b", "fp32", zero=3, reshard="true"), layout("zbv", "fp32", zero=3, reshard="false"),
    layout("1f1b", "bf16", zero=3, reshard="false"), layout("1f1b", "fp32", zero=3, reshard="false", recompute="on"),
]


# Tensor parallelism (fp32, AdamW, untied heads) within 4 ranks: pp2 x tp2 on the GPT and the
# Hugging Face Llama, and one pipeline stage of tp2 x dp2: ZeRO-3 on the Llama, both reshard
# policies (2-D parameters: sharded over tp, then over dp; the GPT's fused q/k/v is not built for
# it), and ZeRO-0 on the GPT (tensor parallelism runs on the torch backend or FSDP2 only)
TP_GRID: list[Layout] = [
    layout("1f1b", "fp32", tp=2), layout("1f1b", "fp32", tp=2, model="llama"),
    layout("1f1b", "fp32", tp=2, stages=1, zero=3, reshard="false", model="llama"),
    layout("1f1b", "fp32", tp=2, stages=1, zero=3, reshard="true", model="llama"),
    layout("1f1b", "fp32", tp=2, stages=1, zero=0),
]


# each layer its own checkpoint (`pipeline.recompute_granularity=layer`): one and two chunks per
# rank, whole and split backward, under a limit (auto) and with ZeRO-3; beside their chunk
# granularity rows (the full grid's recomputing layouts), e.g. --match recompute v4096 model.layers=8
LAYER_RECOMPUTE_GRID: list[Layout] = (
    [layout(s, "fp32", vocab=LARGE_VOCAB, recompute="on", granularity="layer")
     for s in ("1f1b", "zb-h1", "zbv", "interleaved-1f1b")]
    + [layout("1f1b", "fp32", recompute="auto", limit_fraction=0.97, granularity="layer"),
       layout("1f1b", "fp32", zero=3, reshard="false", recompute="on", granularity="layer")]
    # the same split for both granularities (the analytic profile's memory does not vary between
    # runs; its CPU times scale with the matmul rate each process measures, which moves a split
    # only where the refinement has a near tie)
    + [layout(s, "fp32", profile="analytic", vocab=LARGE_VOCAB, recompute="on", granularity=g)
       for s in ("1f1b", "zb-h1") for g in ("chunk", "layer")])


# DeepSpeed's ZeRO-1/2 with the large head on every schedule it was measured on, on the analytic
# profile (a fixed split): e.g. --match "analytic v4096 zero"
ZERO_SCHEDULE_GRID: list[Layout] = [
    layout(s, prec, profile="analytic", vocab=LARGE_VOCAB, zero=z) for z in (1, 2) for prec in ("fp32", "bf16")
    for s in ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv")]


def full_grid() -> list[Layout]:
    """Every schedule in fp32 and bf16 with the small and the large head (measured profile);
    every schedule on the analytic profile (fp32 small head, bf16 large head); every schedule
    recomputing (large head); ZeRO 0/1/2 with two replicas in fp32 and bf16 (1f1b with the
    small head, zb-h1 with the large one); ZeRO-3 (:data:`ZERO3_GRID`); tensor parallelism
    (:data:`TP_GRID`); per-layer recompute (:data:`LAYER_RECOMPUTE_GRID`); ZeRO-1/2 on every
    schedule with the large head (:data:`ZERO_SCHEDULE_GRID`); the chunked loss on
    every schedule (bf16) and in fp32 on both profiles;
    auto recomputation under a limit; SGD with momentum and bf16 autocast."""
    groups = [
        [layout(s, prec, vocab=v) for s in SCHEDULE_CHUNKS for v in (SMALL_VOCAB, LARGE_VOCAB)
         for prec in ("fp32", "bf16")],
        [layout(s, prec, profile="analytic", vocab=v) for s in SCHEDULE_CHUNKS
         for prec, v in (("fp32", SMALL_VOCAB), ("bf16", LARGE_VOCAB))],
        [layout(s, "fp32", vocab=LARGE_VOCAB, recompute="on") for s in SCHEDULE_CHUNKS],
        [layout(s, prec, vocab=v, zero=z) for z in (0, 1, 2) for prec in ("fp32", "bf16")
         for s, v in (("1f1b", SMALL_VOCAB), ("zb-h1", LARGE_VOCAB))],
        [layout(s, "bf16", vocab=LARGE_VOCAB, loss="chunked") for s in SCHEDULE_CHUNKS]
        + [layout("1f1b", "fp32", profile=pm, vocab=LARGE_VOCAB, loss="chunked") for pm in ("measure", "analytic")],
        ZERO3_GRID,
        TP_GRID,
        LAYER_RECOMPUTE_GRID,
        ZERO_SCHEDULE_GRID,
        [layout(s, "fp32", vocab=v, recompute="auto", limit_fraction=0.97)
         for s, v in (("1f1b", SMALL_VOCAB), ("zb-h1", SMALL_VOCAB), ("1f1b", LARGE_VOCAB))]
        + [layout("1f1b", "fp32", optimizer="sgd"), layout("1f1b", "bf16-autocast", zero=1)],
    ]
    # round robin over the groups: a grid cut short still covers every axis
    return [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]


GRID: list[Layout] = full_grid()
# a few layouts of the full grid, fast enough for a test: the analytic profile in bf16 under a
# split backward, recomputation with two chunks per rank, DeepSpeed over two replicas, zbv, and
# the large head under zb-h1 on both I/W split paths (DeepSpeed's per-layer cut in bf16, the
# torch backend's graph-node split in fp32)
SMALL_GRID: list[Layout] = [
    layout("zb-h1", "bf16", profile="analytic"),
    layout("interleaved-1f1b", "fp32", recompute="on"),
    layout("1f1b", "bf16", zero=1),
    layout("zbv", "fp32"),
    layout("zb-h1", "bf16", profile="analytic", vocab=LARGE_VOCAB),
    layout("zb-h1", "fp32", vocab=LARGE_VOCAB),
]


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


def _prepare(lay: Layout, base: Sequence[str]) -> dict[str, Any]:
    """The resolved config and plan of a layout (profiled here, as `experiments.train` does)."""
    from experiments.config import as_config, compose_config
    from experiments.models import build_model
    from experiments.wiring import make_plan, partition_kwargs, profile_model, tp_model_spec, world_size

    cfg = compose_config(*base, *lay.overrides)
    spec = build_model(cfg.model)
    prof = profile_model(cfg, tp_model_spec(cfg))   # one tp rank's shapes (the model itself without tp)
    limit = None
    if lay.limit_fraction is not None:
        limit = int(smallest_limit(prof, partition_kwargs(cfg), "off") * lay.limit_fraction)
        cfg = compose_config(*base, *lay.overrides, f"partitioner.memory_limit={limit}B")
    plan = make_plan(cfg, spec, prof)
    return {"name": lay.name, "config": as_config(cfg), "plan": plan, "world": world_size(cfg),
            "limit": limit}


def _worker(jobs: list[dict], steps: int) -> list[dict]:
    """Train each job for ``steps`` steps, every one measured; this rank's peaks."""
    import os

    import torch

    from engine import OptimizerConfig, Pipeline
    from engine.memtrack import modelled_peak
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
                        optimizer=OptimizerConfig(**engine_optimizer_kwargs(cfg, plan)),
                        **pipeline_kwargs(cfg, plan.stage_ranges, ties=spec.ties,
                                          recompute=plan.stage_recompute or None))
        data, batch = make_dataset(cfg), int(cfg.train.batch_size)
        peaks, kinds, losses = [], [], []
        for step in range(steps):
            x, y = data.train_batch(step, batch)
            res = pipe.train_step(x, y, measure_memory=True)
            mem = res.stats["memory_measured"]
            peaks.append(modelled_peak(mem))
            kinds.append(mem["breakdown"])
            losses.append(res.loss)
        top = max(range(steps), key=peaks.__getitem__)
        params = list(pipe.layer_module.parameters())
        out.append({"peak": peaks[top], "breakdown": kinds[top], "peaks": peaks, "losses": losses,
                    "rank": pipe.mesh.pipeline_rank, "replica": pipe.mesh.replica, "tp_rank": pipe.mesh.tp_rank,
                    "numel": sum(_local(p).numel() for p in params),   # this rank's shards
                    "shard_bytes": sum(_local(p).numel() * p.element_size() for p in params),
                    "whole_bytes": sum(p.numel() * p.element_size() for p in params)})   # un-sharded
    return out


def _local(t: Any) -> Any:
    """A DTensor's local shard (tensor parallel, FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(job: dict[str, Any], per_rank: list[list[dict]]) -> list[dict[str, Any]]:
    """One row per pipeline rank and tp rank: the plan's peak beside the largest measured one over
    the replicas (the plan books each rank's largest replica: under ZeRO the replicas own
    different partitions, and differ). ``replica`` is the replica measured; MemTracker's
    parameter bytes at the peak (``params``: under ZeRO-3 with the gathered layers), and the bytes
    of the rank's own parameter shards (``shard_bytes``, what it keeps between steps) beside its
    layers' whole tensors (``whole_bytes``)."""
    plan, top = job["plan"], {}
    for res in (r[0] for r in per_rank):
        key = (res["rank"], res["tp_rank"])
        if key not in top or res["peak"] > top[key]["peak"]:
            top[key] = res
    rows = []
    for (j, tp_rank), res in sorted(top.items()):
        pred = float(plan.rank_memory_bytes[j])
        rows.append({"layout": job["name"], "rank": j, "tp_rank": tp_rank, "replica": res["replica"],
                     "predicted": pred, "measured": res["peak"], "params": res["breakdown"]["parameters"],
                     "shard_bytes": res["shard_bytes"], "whole_bytes": res["whole_bytes"],
                     "ratio": res["peak"] / pred, "error": pred / res["peak"] - 1,
                     "breakdown": res["breakdown"], "predicted_breakdown": plan.rank_memory_breakdown[j],
                     "recompute": list(plan.stage_recompute), "losses": res["losses"],
                     "stage_ranges": [list(r) for r in plan.stage_ranges],
                     "numel": res["numel"], "limit": job["limit"]})
    return rows


def measure_layouts(layouts: Sequence[Layout], base: Sequence[str] = BASE, steps: int = 3,
                    timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """Plan and measure every layout; one row per (layout, pipeline rank), its largest replica:
    ``layout``, ``rank``, ``predicted``, ``measured`` (MemTracker's peak less the "other"
    tensors alive before the step, :func:`engine.memtrack.modelled_peak`; the largest over the
    steps), ``ratio`` (measured / predicted), ``error`` (predicted / measured - 1),
    ``breakdown`` (measured, by kind, at that peak), ``predicted_breakdown``, ``recompute``,
    ``losses`` and ``limit`` (bytes, for a layout run under a limit)."""
    from engine.launch import launch

    rows: list[dict[str, Any]] = []
    for job in (_prepare(lay, base) for lay in layouts):
        # one job per layout: a finished layout's optimizer (DeepSpeed keeps references to
        # its engine) must not be alive, and counted, while the next one is measured
        per_rank = launch(_worker, job["world"], [job], steps, timeout_s=timeout_s, backend="gloo")
        rows += _rows(job, per_rank)
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (MiB; the error is predicted / measured - 1; the replica
    measured, the largest; MemTracker's parameter bytes at the peak, and the rank's parameter
    shards over its layers' whole tensors, where the rows have them).

    >>> print(format_rows([{"layout": "1f1b", "rank": 0, "predicted": 2**20, "measured": 2**20,
    ...                     "error": 0.0, "limit": None}]).splitlines()[2])
    | 1f1b | 0 | 0 | 0 | 1.00 | 1.00 | +0.0% |  |  |  |
    """
    head = ("| layout | rank | tp rank | replica | predicted MiB | measured MiB | error | limit MiB | parameters MiB "
            "at the peak | shards / whole MiB |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(f"| {r['layout']} | {r['rank']} | {r.get('tp_rank', 0)} | {r.get('replica', 0)} | "
                          f"{r['predicted'] / 2**20:.2f} | {r['measured'] / 2**20:.2f} | {r['error']:+.1%} | "
                          f"{'' if r['limit'] is None else format(r['limit'] / 2**20, '.2f')} | "
                          f"{_params(r)} |\n" for r in rows)


def _params(row: dict[str, Any]) -> str:
    """``"0.85 | 0.85 / 1.67 (0.51)"``: MemTracker's parameter MiB at the peak | the rank's
    shards over its layers' whole tensors (MiB, and the fraction)."""
    if not row.get("whole_bytes"):
        return " | "
    mib = 2**20
    return (f"{row['params'] / mib:.2f} | {row['shard_bytes'] / mib:.2f} / {row['whole_bytes'] / mib:.2f} "
            f"({row['shard_bytes'] / row['whole_bytes']:.2f})")


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """How many ranks are within 5% and 10%, the largest error, and every layout run under a
    limit whose measured peak exceeded it."""
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = [sum(abs(r["error"]) <= tol for r in rows) for tol in (0.05, 0.10)]
    over = [f"{r['layout']} rank {r['rank']}" for r in rows if r["limit"] and r["measured"] > r["limit"]]
    return (f"{len(rows)} ranks: {within[0]} within 5%, {within[1]} within 10%; largest error "
            f"{worst['error']:+.1%} ({worst['layout']} rank {worst['rank']}.{worst.get('tp_rank', 0)}); "
            f"measured peak over the limit: {', '.join(over) or 'none'}")


def select(grid: str, only: Sequence[str] = (), match: Sequence[str] = ()) -> list[Layout]:
    """The layouts of ``grid`` ("small" or "full") named in ``only`` or containing every
    substring of ``match`` (all of them when both are empty)."""
    if grid not in ("small", "full"):
        raise ValueError(f"unknown grid {grid!r}; use small or full")
    pool = SMALL_GRID if grid == "small" else GRID
    out = [lay for lay in pool if (not only or lay.name in only) and all(m in lay.name for m in match)]
    if not out:
        names = "; ".join(lay.name for lay in pool)
        raise ValueError(f"no layout of the {grid} grid matches --only {list(only)} --match {list(match)}; "
                         f"the grid's layouts: {names}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Measure the grid (or the layouts selected by ``--only`` / ``--match``) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides on top of the grid's base")
    ap.add_argument("--grid", default="full", help="small (a few layouts) or full (default)")
    ap.add_argument("--only", action="append", default=[], help="a layout name (repeatable)")
    ap.add_argument("--match", action="append", default=[],
                    help="keep layouts whose name contains this (repeatable: all must match)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows (with breakdowns) here")
    args = ap.parse_args(argv)
    try:
        layouts = select(args.grid, args.only, args.match)
    except ValueError as exc:
        ap.error(str(exc))
    rows: list[dict[str, Any]] = []
    for lay in layouts:   # each layout's rows as soon as they are measured (a long grid)
        got = measure_layouts([lay], (*BASE, *args.overrides), steps=args.steps)
        print(format_rows(got).split("\n", 2)[2] if rows else format_rows(got), end="", flush=True)
        rows += got
        if args.json:
            import json
            from pathlib import Path
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print(summary(rows))


if __name__ == "__main__":
    main()
