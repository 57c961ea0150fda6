"""`python -m experiments.partition [overrides]`: profile and partition a model, without training.

Profiles the configured model once (`partitioner.profile`, measured here with one thread or
analytic), splits it with every method (`optimal` and the baselines `uniform`, `parameters`,
`greedy`) under the configured schedule, microbatches, replicas, ZeRO stage and memory limit,
and prints the configured method's plan followed by a comparison table: predicted step time,
bubble, per-stage memory and whether each stage fits. Writes into the Hydra run directory:
`plan.json` (the configured method's plan, as `experiments.train` would run it),
`partition_comparison.json` (every method's plan, or its error) and `profile.json`.

With `pipeline.schedule=auto` (or `pipeline.microbatches=auto`) the planner first chooses the
layout (`partitioner.search`, the model profiled at each microbatch size it tries): the search
table (the choice and the next best, with predicted step and memory) is printed with the plan,
`plan.json` keeps it, and the methods are compared at the chosen layout.

Example:
    python -m experiments.partition experiment=mlp_profile
    python -m experiments.partition model.vocab=32000 partitioner.memory_limit=64MiB pipeline.stages=4
    python -m experiments.partition pipeline.schedule=auto pipeline.microbatches=auto

    >>> rows = comparison_rows({"uniform": "PartitionError: nothing fits"})
    >>> rows[0]["method"], rows[0]["fits"]
    ('uniform', False)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from experiments.app import hydra_entry
from experiments.config import as_config, checkpointing_mode, searches, sequence_parallel_setting, validate_config
from experiments.fields import choice_text as _text
from experiments.wiring import (make_plan, microbatch_size, profile_model, resolve_layout, search_layout,
                                tp_model_spec)

__all__ = ["compare_plans", "comparison_rows", "format_comparison", "run", "main", "COMPARISON_FILE",
           "validate_plan_config", "layout_line"]

COMPARISON_FILE = "partition_comparison.json"


def compare_plans(cfg: Any, spec: Any = None, prof: Any = None) -> dict[str, Any]:
    """Every method's `Plan` for the config (one profile shared), or the error text where a method
    has no feasible split (the optimal method under a memory limit nothing fits)."""
    import partitioner

    cfg = as_config(cfg)
    spec = spec if spec is not None else tp_model_spec(cfg)
    prof = prof if prof is not None else profile_model(cfg, spec)
    out: dict[str, Any] = {}
    for method in partitioner.METHODS:
        try:
            out[method] = make_plan(cfg, spec, prof, method=method)
        except partitioner.PartitionError as exc:
            out[method] = f"PartitionError: {exc}"
    return out


def comparison_rows(plans: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per method: predicted step, bubble, bottleneck, per-stage memory, fits, and the step
    relative to the optimal plan (`vs_optimal`, 1.0 = as fast)."""
    best = plans.get("optimal")
    best_step = best.step_s if best is not None and not isinstance(best, str) else None
    rows = []
    for method, plan in plans.items():
        if isinstance(plan, str):
            rows.append({"method": method, "stage_ranges": None, "step_s": None, "bubble_fraction": None,
                         "bottleneck_s": None, "stage_memory_bytes": None, "fits": False,
                         "vs_optimal": None, "error": plan})
            continue
        rows.append({
            "method": method, "stage_ranges": [list(r) for r in plan.stage_ranges], "step_s": plan.step_s,
            "bubble_fraction": plan.bubble_fraction, "bottleneck_s": plan.bottleneck_s,
            "stage_memory_bytes": list(plan.stage_memory_bytes), "fits": bool(plan.fits),
            "vs_optimal": plan.step_s / best_step if best_step else None, "error": None,
        })
    return rows


def _mib(values: list[int] | None) -> str:
    return "-" if not values else " / ".join(f"{v / 2**20:.1f}" for v in values)


def format_comparison(rows: list[dict[str, Any]], title: str = "methods compared") -> str:
    """The comparison as a text table (rich)."""
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for head in ("method", "stage ranges", "step ms", "vs optimal", "bubble", "bottleneck ms",
                 "memory per stage MiB", "fits"):
        table.add_column(head, justify="left" if head in ("method", "stage ranges") else "right")
    for r in rows:
        if r["error"]:
            table.add_row(r["method"], "infeasible", "-", "-", "-", "-", "-", "NO")
            continue
        table.add_row(
            r["method"], " ".join(f"{a}-{b - 1}" for a, b in r["stage_ranges"]), f"{r['step_s'] * 1e3:.3f}",
            f"{r['vs_optimal']:.3f}x" if r["vs_optimal"] else "-", f"{r['bubble_fraction']:.1%}",
            f"{r['bottleneck_s'] * 1e3:.3f}", _mib(r["stage_memory_bytes"]), "yes" if r["fits"] else "NO")
    buf = io.StringIO()
    Console(file=buf, width=140, force_terminal=False, color_system=None).print(table)
    text = buf.getvalue()
    for r in rows:
        if r["error"]:
            text += f"{r['method']}: {r['error']}\n"
    return text


def run(cfg: Any, run_dir: str | os.PathLike) -> dict[str, Any]:
    """Profile, partition with every method, print and save (see the module docstring).

    Returns `{"plans": {method: Plan | error text}, "rows": [...], "run_dir": ...}`. Raises the
    configured method's `PartitionError` (after printing the comparison) when it has no split.
    """
    import partitioner

    cfg = validate_plan_config(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    method = _text(cfg.partitioner.method)
    cfg, spec, prof, searched = _layout(cfg)
    prof.to_json(run_dir / "profile.json")
    plans = compare_plans(cfg, spec, prof)
    if searched is not None:
        plans[method] = searched  # the same split, with the search's record
    chosen = plans[method]
    print(f"model {spec.name}: {len(spec.layers)} pipeline layers, {spec.num_params:,} parameters; "
          f"profile: {_text(cfg.partitioner.profile)}", flush=True)
    print(layout_line(cfg, None if isinstance(chosen, str) else chosen), flush=True)
    if not isinstance(chosen, str):
        print(chosen.summary(), flush=True)
        chosen.to_json(run_dir / "plan.json")
    rows = comparison_rows(plans)
    print(format_comparison(rows, title=f"{method} beside the baselines (predicted)"), flush=True)
    (run_dir / COMPARISON_FILE).write_text(json.dumps({
        "configured_method": method, "rows": rows,
        "plans": {k: (v if isinstance(v, str) else v.to_dict()) for k, v in plans.items()},
    }, indent=1))
    saved = ([run_dir / "plan.json"] if not isinstance(chosen, str) else []) + [run_dir / COMPARISON_FILE]
    print("saved " + " and ".join(str(x) for x in saved), flush=True)
    if isinstance(chosen, str):
        raise partitioner.PartitionError(chosen.split(": ", 1)[1])
    return {"plans": plans, "rows": rows, "run_dir": str(run_dir)}


def _layout(cfg: Any) -> tuple[Any, Any, Any, Any]:
    """(the config with a plain layout, the model spec of one tensor-parallel rank, the profile
    at its microbatch size, the searched plan or None): under `auto` the planner chooses first (a
    PartitionError propagates), the tensor-parallel degree and ZeRO stage too when
    `partitioner.search.tensor_parallel` / `zero_stages` list several."""
    if not searches(cfg):
        spec = tp_model_spec(cfg)
        return cfg, spec, profile_model(cfg, spec), None
    plan = search_layout(cfg, None).plan
    resolved = resolve_layout(cfg, plan)
    spec = tp_model_spec(resolved)
    return resolved, spec, profile_model(resolved, spec, microbatch_size(resolved)), plan


def validate_plan_config(cfg: Any) -> Any:
    """`validate_config` for planning only: a `pipeline.tensor_parallel` above 1 is planned (the
    model's tp-sharded shapes, `experiments.wiring.tp_model_spec`, check that it divides the heads,
    KV heads, MLP and vocabulary) though the engine does not train it yet, so the rest of the
    config is validated at tp = 1."""
    import dataclasses

    cfg = as_config(cfg)
    tp = int(cfg.pipeline.tensor_parallel)
    if tp <= 1:
        return validate_config(cfg)
    flat = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, tensor_parallel=1))
    out = validate_config(flat)
    return dataclasses.replace(out, pipeline=dataclasses.replace(out.pipeline, tensor_parallel=tp))


def layout_line(cfg: Any, plan: Any) -> str:
    """The 3-D layout in one line: pp x dp x tp (GPUs), the ZeRO stage and, under ZeRO-3, the
    reshard policy; with tp > 1 whether the sequence is split (sequence parallelism); where
    chunks may recompute, the recompute granularity and how many chunks recompute. Each is the
    plan's choice, or the configured value without a plan.

    >>> from experiments.config import Config, GPTConfig, TextDataConfig
    >>> layout_line(Config(model=GPTConfig(), data=TextDataConfig()), None)
    'layout: pp2 x dp1 x tp1 = 2 GPUs; ZeRO-0'
    """
    cfg = as_config(cfg)
    p = cfg.pipeline
    pp, dp, tp = int(p.stages), int(p.data_parallel), int(p.tensor_parallel)
    zero = int(cfg.optimizer.zero_stage)
    text = f"layout: pp{pp} x dp{dp} x tp{tp} = {pp * dp * tp} GPUs; ZeRO-{zero}"
    if zero == 3:
        got = plan.reshard_after_forward if plan is not None else None
        chosen = str(cfg.optimizer.reshard_after_forward).lower() if got is None else str(bool(got)).lower()
        text += f" (FSDP2), reshard_after_forward={chosen}"
    if tp > 1:
        sp = plan.sequence_parallel if plan is not None else sequence_parallel_setting(cfg.model)
        text += f"; sequence_parallel={str(sp).lower()}"
    if checkpointing_mode(p.activation_checkpointing) is not False:
        granularity = plan.recompute_granularity if plan is not None else _text(p.recompute_granularity)
        text += f"; recompute_granularity={granularity}"
        if plan is not None:
            text += f" ({sum(map(bool, plan.stage_recompute))} of {plan.num_chunks} chunks recompute)"
    return text


def main() -> None:
    """The Hydra entry point (`python -m experiments.partition [overrides]`)."""
    hydra_entry(run)


if __name__ == "__main__":
    main()
