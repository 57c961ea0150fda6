"""pipeshard's plan for torchtitan's Table 5 layout (Llama 3.1 405B, pp8 x tp8 x dp8 on 512 H100s).

torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 5: Llama 3.1 405B (126
layers, d 16384, 128 heads, 8 KV heads, FFN 53248, vocabulary 128,256, sequence 8192), FSDP 8 x
TP 8 x PP 8, local batch 32 (global 256), full activation checkpointing, torch.compile + Float8 +
AsyncTP; 1F1B 100 tokens/s/GPU at 82.5 GiB, interleaved 1F1B 128 at 72.7 GiB. torchtitan of
then (9dec370) splits the batch into as many microbatches as pipeline stages (8) and, with
pipeline parallelism, keeps FSDP's layers unsharded for the step (``reshard_after_forward=False``).

For each schedule, five rows: the plan as pipeshard's engine runs it (``experiments.partition``
with these overrides) with the whole chunk checkpointed (``pipeline.recompute_granularity=chunk``)
and with each layer checkpointed on its own as torchtitan does
(``pipeline.recompute_granularity=layer``), each without and with sequence parallelism
(``model.sequence_parallel=true``: ``partitioner.recompute.sequence_parallel_profile``, the one
rule dividing the residual stream by tp); and torchtitan's way as a what-if: the blocks alone
checkpointed (embedding and head not recomputed), on the sequence-parallel profile (the engine
recomputes whole chunks' layers; the row is a prediction to put beside the published figures).
bf16 compute on the analytic ``h100`` spec (SXM datasheet; the benchmark's GPUs were 96 GB HBM2e
parts at 500 W, 2.4 TB/s); no Float8, no torch.compile, no AsyncTP. ``--auto`` also runs the 3-D
search (``pipeline.schedule=auto pipeline.microbatches=auto``, tp in 1/2/4/8, ZeRO 1/3, under
``--limit``, recompute per chunk where needed at the granularity and with or without sequence
parallelism the search chooses) and prints its choice.

Usage::

    PYTHONPATH=. python scripts/llama405_plan.py                 # the rows (markdown)
    PYTHONPATH=. python scripts/llama405_plan.py --auto          # and the search's choice
    PYTHONPATH=. python scripts/llama405_plan.py --tiny          # a smoke run (tests/test_scripts.py)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = ["model=hf_llama", "model.layers=126", "model.dim=16384", "model.heads=128", "model.kv_heads=8",
         "model.vocab=128256", "model.seq_len=8192", "model.intermediate=53248", "model.tie_embeddings=false"]
TINY = ["model=hf_llama", "model.layers=6", "model.dim=64", "model.heads=8", "model.kv_heads=4",
        "model.vocab=256", "model.seq_len=32", "model.intermediate=128", "model.tie_embeddings=false"]
LAYOUT = ["pipeline.stages=8", "pipeline.data_parallel=8", "pipeline.tensor_parallel=8",
          "pipeline.activation_checkpointing=true", "partitioner.profile=analytic", "partitioner.device_spec=h100",
          "precision=bf16", "optimizer.zero_stage=3", "optimizer.reshard_after_forward=false",
          "train.batch_size=256", "pipeline.microbatches=8"]
SCHEDULES = {"1F1B": ["pipeline.schedule=1f1b"],
             "Interleaved 1F1B": ["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2"]}
PUBLISHED = {"1F1B": (100, 82.5), "Interleaved 1F1B": (128, 72.7)}
AUTO = ["pipeline.schedule=auto", "pipeline.microbatches=auto", "pipeline.activation_checkpointing=auto",
        "pipeline.recompute_granularity=auto", "model.sequence_parallel=auto",
        "partitioner.search.tensor_parallel=[1,2,4,8]", "partitioner.search.zero_stages=[1,3]",
        "optimizer.reshard_after_forward=auto"]

__all__ = ["plan_rows", "auto_choice", "main"]


def _gpus(cfg) -> int:
    p = cfg.pipeline
    return int(p.stages) * int(p.data_parallel) * int(p.tensor_parallel)


def _tokens_per_gpu(cfg, step_s: float) -> float:
    return int(cfg.train.batch_size) * int(cfg.model.seq_len) / (step_s * _gpus(cfg))


def plan_rows(model: list[str], layout: list[str]) -> list[dict]:
    """Per schedule, the plans as the engine runs them (chunk and per-layer recompute, each without
    and with sequence parallelism) and torchtitan's blocks-only recompute on the SP profile."""
    import partitioner
    from experiments.config import compose_config
    from experiments.partition import validate_plan_config
    from experiments.wiring import partition_kwargs, profile_model, tp_model_spec
    from partitioner.recompute import checkpoint_each_layer, sequence_parallel_profile

    rows = []
    for name, sched in SCHEDULES.items():
        cfg = validate_plan_config(compose_config(*model, *layout, *sched))
        prof = profile_model(cfg, tp_model_spec(cfg))   # the residual stream whole
        sp = sequence_parallel_profile(prof, int(cfg.pipeline.tensor_parallel))   # divided once
        kw = partition_kwargs(cfg)
        runs = {}
        for label, profile in (("no SP", prof), ("SP", sp)):
            for how in ("chunk", "layer"):
                runs[f"as the engine runs it: {how} recompute, {label}"] = partitioner.partition(
                    profile, **dict(kw, recompute_granularity=how))
        runs["torchtitan's way: blocks only recomputed, SP (what-if)"] = partitioner.partition(
            checkpoint_each_layer(sp), **dict(kw, activation_checkpointing=False))
        for how, plan in runs.items():
            rows.append({"schedule": name, "recompute": how, "step_s": plan.step_s,
                         "tokens_per_s_per_gpu": _tokens_per_gpu(cfg, plan.step_s),
                         "peak_gib": max(plan.rank_memory_bytes) / 2**30, "bubble": plan.bubble_fraction,
                         "stage_ranges": [list(r) for r in plan.stage_ranges],
                         "published": PUBLISHED[name], "breakdown_rank0": plan.rank_memory_breakdown[0]})
    return rows


def auto_choice(model: list[str], layout: list[str], limit: str) -> dict:
    """The 3-D search's choice (``experiments.wiring.search_layout``) under ``limit``."""
    from experiments.config import compose_config
    from experiments.partition import validate_plan_config
    from experiments.wiring import resolve_layout, search_layout

    import partitioner

    extra = [] if limit == "none" else [f"partitioner.memory_limit={limit}"]
    cfg = validate_plan_config(compose_config(*model, *layout, *AUTO, *extra))
    try:
        res = search_layout(cfg, None)
    except partitioner.PartitionError as exc:
        return {"limit": limit, "error": str(exc)}
    plan = res.plan
    chosen = resolve_layout(cfg, plan)
    return {"limit": limit, "layout": res.chosen.label, "step_s": plan.step_s, "tokens_per_s_per_gpu": _tokens_per_gpu(chosen, plan.step_s),
            "peak_gib": max(plan.rank_memory_bytes) / 2**30, "reshard_after_forward": plan.reshard_after_forward,
            "sequence_parallel": plan.sequence_parallel, "recompute_granularity": plan.recompute_granularity,
            "recompute": plan.stage_recompute, "seconds": res.seconds, "table": res.table()}


def markdown(rows: list[dict]) -> str:
    out = ["| schedule | recompute | predicted tok/s/GPU | predicted peak GiB | published tok/s/GPU | published GiB | bubble |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['schedule']} | {r['recompute']} | {r['tokens_per_s_per_gpu']:.1f} | {r['peak_gib']:.1f} | "
                   f"{r['published'][0]} | {r['published'][1]} | {r['bubble']:.1%} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--auto", action="store_true", help="also run the 3-D search and print its choice")
    ap.add_argument("--limit", nargs="+", default=["80GiB"],
                    help="memory limits of the search, one search each (default 80GiB; none: no limit)")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama (smoke run)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    model = TINY if args.tiny else MODEL
    layout = LAYOUT + (["train.batch_size=16", "pipeline.data_parallel=2", "pipeline.tensor_parallel=2",
                        "pipeline.stages=2", "pipeline.microbatches=2"] if args.tiny else [])
    rows = plan_rows(model, layout)
    print(markdown(rows), flush=True)
    out = {"rows": rows}
    for limit in args.limit if args.auto else []:
        got = auto_choice(model, layout, limit)
        if "error" in got:
            print(f"schedule=auto under {limit}: {got['error']}", flush=True)
        else:
            print(got.pop("table"))
            print(f"schedule=auto under {limit} chose {got['layout']}: {got['tokens_per_s_per_gpu']:.1f} tok/s/GPU, "
                  f"peak {got['peak_gib']:.1f} GiB, reshard_after_forward={got['reshard_after_forward']}, "
                  f"sequence_parallel={got['sequence_parallel']}, recompute_granularity={got['recompute_granularity']} "
                  f"({sum(got['recompute'])} of {len(got['recompute'])} chunks recompute); searched in "
                  f"{got['seconds']:.1f} s", flush=True)
        out.setdefault("auto", []).append(got)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
