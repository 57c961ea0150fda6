"""`python -m experiments.bench [overrides]`: pipeshard and its peers on one model, one run.

With no `experiment=` override the `bench` preset (conf/experiment/bench.yaml) is used. In one
invocation, each in fresh processes with one thread per rank, on the same model, data, global
batch, microbatches and stage boundaries:

1. the configured model is profiled (`partitioner.profile(mode="measure")`, one worker, one
   thread, the microbatch size, the loss folded into the last layer) and the gloo loopback link
   speed is measured at the boundary's message size;
2. `single` (microbatched: the reference for `ideal_step_s`; full-batch; and loaded: the
   microbatched step on p processes at once, the compute as busy as under a pipeline);
3. the profile is calibrated from the loaded single-process step and partitioned
   (`method=optimal`);
   pipeshard runs every schedule of `bench.schedules` (default: all of
   `engine.schedules.SCHEDULES`) on the plans' splits, and every pipeshard row carries the
   plan's `predicted_step_s` (`Plan.simulate`) and predicted vs
   measured peak activation bytes per rank;
4. torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and its
   zero-bubble schedules ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble where they run)
   and DeepSpeed's PipelineEngine (1F1B) on the same split;
5. partition quality: pipeshard 1f1b with each of `bench.methods` (optimal, uniform,
   parameters), measured (rows with `section="partition"` and `method`);
6. the planner's choice (`bench.auto`, on by default): `partitioner.search` over schedule,
   chunks, microbatches, zb-h2's max_inflight, recompute and split, from the model profiled at
   each microbatch size, run as a pipeshard row with `section="auto"`; `bench.sweep=true` runs
   every layout the search solved as well (`section="sweep"`) and prints "auto's choice
   measured X ms, fastest of the sweep Y ms (layout), ratio" (`bench.json` `auto`, `search`).

Every run is started by `engine.launch` with fresh interpreters (`start_method="spawn"`); a run
that fails becomes a row with `error`. Writes into the Hydra run directory: `bench.json`
(`{"rows": [...], "ratios", "prediction", "meta", "plans", "profile"}`), `bench.png` (bar
chart) and prints the tables.

Example::

    python -m experiments.bench                                  # the bench preset
    python -m experiments.bench bench.steps=10 model.vocab=16384
    python -m experiments.bench experiment=mlp_profile bench.systems=[single,pipeshard]
    python -m experiments.bench bench.sweep=true                 # the choice beside every layout, measured
    python -m experiments.bench experiment=bench_gpt8 bench.sweep=true   # the second model
    python -m experiments.bench bench.overhead=true bench.rounds=3   # fixed cost per action
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from experiments.app import hydra_entry
from experiments.config import validate_config

__all__ = ["main", "run", "write_outputs"]


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """Write `bench.json` and `bench.png` into `out_dir`; return their paths."""
    from experiments.bench.report import bar_chart

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    png = out_dir / "bench.png"
    rows = [r for r in result["rows"] if r.get("section") == "systems"]
    bar_chart(rows, str(png), title=f"{result['meta'].get('model_name', 'model')}: step time (median)")
    return [path, png]


def run(cfg: Any, run_dir: str) -> dict:
    """The benchmark on a composed config, its tables printed and its files written to `run_dir`."""
    from experiments.bench.report import format_prediction_table, format_rank_times, format_table
    from experiments.bench.run import run_bench

    cfg = validate_config(cfg)
    if cfg.bench.overhead:
        return _run_overhead(cfg, run_dir)
    trace = bool(cfg.bench.trace)
    result = run_bench(cfg, trace_dir=str(Path(run_dir) / "traces") if trace else None)
    result["meta"]["command"] = " ".join(["python -m experiments.bench", *sys.argv[1:]])
    paths = write_outputs(result, Path(run_dir))
    rows, m = result["rows"], result["meta"]
    title = (f"{m.get('model_name')}: batch {m['batch_size']}, {m['stages']} stages, "
             f"{m['microbatches']} microbatches, 1 thread per rank")
    print(format_table([r for r in rows if r.get("section") == "systems"], title=title))
    print(format_prediction_table(rows))
    print("where each pipeshard step went, per rank (ms; medians of StepResult.stats):")
    print(format_rank_times(rows))
    if "auto" in result:
        from experiments.bench.auto import comparison_line, format_sweep

        print(format_sweep(rows))
        print(comparison_line(result["auto"]))
        if result["auto"].get("confirmation"):
            from experiments.bench.auto import confirmation_line
            print(confirmation_line(result["auto"]["confirmation"]))
    print("ratios:", json.dumps(result["ratios"], indent=1))
    if trace:
        from experiments.bench.trace import format_trace
        print("ms per microbatch, main thread, from torch.profiler (traces in", Path(run_dir) / "traces", ")")
        print(format_trace([r for r in rows if r.get("trace")]))
    print(f"load average start {m['load_avg_start']} end {m['load_avg_end']}")
    print("wrote", *map(str, paths))
    return result


def _run_overhead(cfg: Any, run_dir: str) -> dict:
    """`bench.overhead=true`: each engine's fixed cost per action (experiments/bench/overhead.py)."""
    from experiments.bench.overhead import format_overhead, run_overhead, run_paired_overhead
    from experiments.bench.report import json_rows

    b = cfg.bench
    systems = [s for s in b.systems if s != "single"]
    rows = run_overhead(rounds=int(b.rounds), steps=int(b.steps), warmup=int(b.warmup_steps),
                        systems=systems, timeout_s=float(b.timeout_s))
    blocks = int(b.overhead_blocks or 0)
    if blocks > 0 and {"pipeshard", "torch-pipelining"} <= set(systems):
        rows += run_paired_overhead(blocks=blocks, block_steps=int(b.steps), warmup=int(b.warmup_steps),
                                    timeout_s=float(b.timeout_s))
    result = {"rows": json_rows(rows), "meta": {"mode": "overhead",
                                               "command": " ".join(["python -m experiments.bench", *sys.argv[1:]])}}
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_overhead.json").write_text(json.dumps(result, indent=1, default=str))
    print(format_overhead(rows))
    print("wrote", out / "bench_overhead.json")
    return result


def _default_experiment(argv: list[str]) -> list[str]:
    """`experiment=bench` unless the command line picks an experiment itself."""
    if any(a.split("=", 1)[0].lstrip("+~") == "experiment" for a in argv[1:]):
        return argv
    return [argv[0], "experiment=bench", *argv[1:]]


def main() -> None:
    """The Hydra entry point (`python -m experiments.bench [overrides]`; the bench preset by default)."""
    sys.argv = _default_experiment(sys.argv)
    hydra_entry(run)


if __name__ == "__main__":
    main()
