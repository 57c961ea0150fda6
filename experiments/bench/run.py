"""Whole benchmark runs: `run_peers` (systems on one spec) and `run_bench` (`python -m experiments.bench`).

`run_bench(cfg)` on a composed config: the model is profiled (one fresh process) and the link
speed measured; the splits are planned from that profile before anything runs; every job of
the table (single, pipeshard per schedule, torch.distributed.pipelining, DeepSpeed, and
pipeshard 1f1b on each `bench.methods` split) runs in fresh processes, `bench.rounds` times in
alternating order; then the profile is calibrated from the single-process step and each
pipeshard row gets its plan's prediction (`Plan.simulate` through `partitioner.partition`).

Example::

    rows = run_peers(tiny_spec(), systems=("single", "pipeshard"), pipeshard_schedules=("1f1b",))
    result = run_bench(compose_config("experiment=bench"))    # {"rows", "ratios", ...}
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

from engine.schedules import SCHEDULE_INFO, SCHEDULES
from experiments.bench.jobs import SINGLE_MODES, SPLIT_MODE, SYSTEMS, check_systems, job_table, pipeshard_key, run_jobs
from experiments.bench.report import add_ideal, json_rows, ratios
from experiments.bench.spec import BenchSpec
from experiments.bench.torch_pp import TORCH_SCHEDULES

__all__ = ["run_peers", "run_bench", "TORCH_FOR_PIPESHARD"]

# torch.distributed.pipelining's schedules run for each pipeshard schedule asked for.
TORCH_FOR_PIPESHARD: dict[str, tuple[str, ...]] = {
    "gpipe": ("gpipe",), "1f1b": ("1f1b",), "interleaved-1f1b": ("interleaved-1f1b",),
    "zb-h1": ("interleaved-zb", "zbv"), "zb-h2": ("interleaved-zb", "zbv"), "zbv": ("zbv",),
    "zb-auto": ("interleaved-zb", "zbv"), "dualpipev": ("dualpipev",),
}
_PREDICTION_KEYS = ("section", "schedule", "method", "step_s", "predicted_step_s", "step_error",
                    "predicted_step_uncalibrated_s", "step_error_uncalibrated", "predicted_activation_bytes",
                    "measured_activation_bytes", "activation_error")


def run_peers(spec: BenchSpec, *, systems: Sequence[str] = SYSTEMS, single_modes: Sequence[str] = SINGLE_MODES,
              pipeshard_schedules: Sequence[str] = SCHEDULES, torch_schedules: Sequence[str] = tuple(TORCH_SCHEDULES),
              timeout_s: float = 900.0, log: Callable[[str], None] | None = print) -> list[dict[str, Any]]:
    """Run every requested system on ``spec``, one after another, each in fresh processes.

    Returns the rows (with ``ideal_step_s``), failures included as error rows.
    """
    systems = check_systems(systems)
    jobs = job_table(spec, single_modes=single_modes if "single" in systems else (),
                     pipeshard=[(s, spec) for s in pipeshard_schedules] if "pipeshard" in systems else (),
                     torch_schedules=torch_schedules if "torch-pipelining" in systems else (),
                     deepspeed="deepspeed" in systems, timeout_s=timeout_s)
    return add_ideal(list(run_jobs(jobs, spec, log=log).values()))


def run_bench(cfg: Any, *, rounds: int | None = None, log: Callable[[str], None] | None = print,
              trace_dir: str | None = None) -> dict[str, Any]:
    """The whole ``python -m experiments.bench`` run (see the module docstring); returns
    ``{"rows", "ratios", "prediction", "meta", "plans", "profile"}``."""
    from experiments.bench.problem import bench_spec
    from experiments.config import as_config

    c = as_config(cfg)
    bc = c.bench
    systems = check_systems(bc.systems)
    schedules = [str(s) for s in bc.schedules]
    methods = [str(x) for x in (bc.methods or ())]
    rounds = max(1, int(rounds if rounds is not None else bc.rounds))
    timeout = float(bc.timeout_s)
    meta = _meta(c, rounds)
    prof, link = _profile_and_link(c, meta, timeout, log)
    spec0 = bench_spec(c)
    meta["model_name"] = spec0.name
    raw_plans = _plans(prof, meta, schedules, methods, link)
    spec = _spec_for_peers(spec0, raw_plans, prof, meta, link)
    if trace_dir:   # every job profiles its timed steps (experiments/bench/trace.py)
        spec = dataclasses.replace(spec, trace_dir=trace_dir)
    pipeshard, entries = _entries(systems, schedules, methods, spec, raw_plans)
    searched = _search(c, prof, link, timeout, spec, pipeshard, entries, log)
    jobs = job_table(spec, single_modes=_single_modes(systems, schedules), pipeshard=pipeshard,
                     torch_schedules=_torch_names(schedules) if "torch-pipelining" in systems else (),
                     deepspeed="deepspeed" in systems, timeout_s=timeout)
    combined = run_jobs(jobs, spec, rounds=rounds, log=log)
    confirmation = _confirm(bc, entries, combined, jobs, spec, rounds, log) if searched is not None else None
    plans = _calibrated_plans(prof, raw_plans, combined, meta, link)
    rows = _rows(entries, combined, plans, raw_plans)
    meta["load_avg_end"] = list(os.getloadavg())
    prediction = [{k: r.get(k) for k in _PREDICTION_KEYS} for r in rows if r["system"] == "pipeshard"]
    out = {"rows": json_rows(rows), "ratios": ratios(rows), "prediction": prediction, "meta": meta,
           "plans": {name: pl.to_dict() for name, pl in plans.items()}, "profile": prof.to_dict()}
    if searched is not None:
        from experiments.bench.auto import sweep_comparison

        out["search"] = searched.record(searched.count("ok"))
        out["auto"] = sweep_comparison(rows)
        if confirmation is not None:
            out["auto"]["confirmation"] = confirmation
    return out


def _confirm(bc: Any, entries: list, combined: dict, jobs: dict, spec: BenchSpec, rounds: int,
             log: Callable[[str], None] | None) -> dict[str, Any] | None:
    """With `bench.sweep` and `bench.sweep_confirm` > 0: auto's choice and the sweep's fastest
    layouts measured again head to head (`experiments.bench.auto.confirm_layouts`)."""
    top = int(bc.sweep_confirm or 0)
    if not (bc.sweep and top > 0):
        return None
    from experiments.bench.auto import confirm_layouts

    return confirm_layouts(entries, combined, jobs, spec, top=top, rounds=rounds, log=log)


def _search(c: Any, prof: Any, link: Any, timeout: float, spec: BenchSpec, pipeshard: list, entries: list,
            log: Callable[[str], None] | None) -> Any:
    """With `bench.auto` / `bench.sweep`: the planner's search, its choice (and the sweep) added
    to the pipeshard runs and the rows; the `SearchResult`, or None."""
    bc = c.bench
    if not (bc.auto or bc.sweep):
        return None
    from experiments.bench.auto import layout_runs, search_layouts

    searched = search_layouts(c, prof, link=link, timeout_s=timeout, sweep=bool(bc.sweep), log=log)
    runs, more = layout_runs(searched, spec, sweep=bool(bc.sweep), sweep_max=bc.sweep_max)
    pipeshard.extend(runs)
    entries.extend(more)
    return searched


def _meta(c: Any, rounds: int) -> dict[str, Any]:
    from experiments.config import to_plain_dict

    return {"load_avg_start": list(os.getloadavg()), "cpus": os.cpu_count(),
            "stages": int(c.pipeline.stages), "microbatches": int(c.pipeline.microbatches),
            "rounds": rounds, "batch_size": int(c.train.batch_size), "model": to_plain_dict(c.model),
            "torch_threads_per_rank": 1, "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _profile_and_link(c: Any, meta: dict, timeout: float, log: Callable[[str], None] | None) -> tuple[Any, Any]:
    """The measured profile, and the link speed (configured, or measured at the boundary's size)."""
    from experiments.bench.problem import measure_link, profile_model

    if log:
        log("[bench] profiling layers (one process, one thread) ...")
    prof = profile_model(c, timeout_s=timeout)
    if c.partitioner.fixed_costs:
        from experiments.config import Device
        from experiments.wiring import with_fixed_costs

        on_cpu = dataclasses.replace(c, train=dataclasses.replace(c.train, device=Device["cpu"]))
        prof = with_fixed_costs(on_cpu, prof)
        meta["fixed_costs"] = dataclasses.asdict(prof.fixed) if prof.fixed is not None else None
    link = c.partitioner.link_bytes_per_s
    if link is None and meta["stages"] > 1 and prof.fixed is None:  # else the fixed costs' link
        nbytes = max(layer.output_bytes for layer in prof.layers[:-1])
        link = measure_link(nbytes)
        meta["link_measured_bytes"] = nbytes
    meta["link_bytes_per_s"] = link
    return prof, link


def _plans(prof: Any, meta: dict, schedules: list[str], methods: list[str], link: Any) -> dict:
    """Splits from the (uncalibrated) profile, before anything runs: per schedule, per method."""
    from experiments.bench.predict import plan_for
    from experiments.wiring import schedule_chunks

    p, m = meta["stages"], meta["microbatches"]
    plans = {name: plan_for(prof, p, name, m, virtual_stages=schedule_chunks(name), link_bytes_per_s=link)
             for name in dict.fromkeys(schedules + ["1f1b"])}
    for method in methods:
        plans[f"1f1b/{method}"] = plan_for(prof, p, "1f1b", m, method=method, link_bytes_per_s=link)
    return plans


def _spec_for_peers(spec0: BenchSpec, plans: dict, prof: Any, meta: dict, link: Any) -> BenchSpec:
    """The spec the peers run: the 1f1b plan's split, and a 2-chunk split (a planned 2-chunk
    schedule's, else interleaved-1f1b's) for the peers' 2-chunk schedules."""
    from experiments.bench.predict import plan_for

    p, m = meta["stages"], meta["microbatches"]
    two = next((pl for pl in plans.values() if pl.virtual_stages == 2), None)
    if two is None and p * 2 <= len(spec0.layers) and m % p == 0:   # interleaving runs microbatches in groups of p
        two = plan_for(prof, p, "interleaved-1f1b", m, virtual_stages=2, link_bytes_per_s=link)
    return dataclasses.replace(spec0, stage_ranges=tuple(plans["1f1b"].stage_ranges),
                               chunk_ranges=None if two is None else tuple(two.stage_ranges))


def _spec_of(spec: BenchSpec, plan: Any) -> BenchSpec:
    if plan.virtual_stages == 1:
        return dataclasses.replace(spec, stage_ranges=tuple(plan.stage_ranges))
    return dataclasses.replace(spec, chunk_ranges=tuple(plan.stage_ranges))


def _single_modes(systems: Sequence[str], schedules: Sequence[str]) -> tuple[str, ...]:
    """The single-process rows: the three references, and the split backward's calibration
    beside a schedule that splits it."""
    if "single" not in systems:
        return ()
    split = any(SCHEDULE_INFO[s].splits_backward for s in schedules if s in SCHEDULE_INFO)
    return (*SINGLE_MODES, SPLIT_MODE) if split else SINGLE_MODES


def _torch_names(schedules: list[str]) -> list[str]:
    return list(dict.fromkeys(t for s in schedules for t in TORCH_FOR_PIPESHARD.get(s, ())))


def _entries(systems: list[str], schedules: list[str], methods: list[str], spec: BenchSpec,
             plans: dict) -> tuple[list[tuple[str, BenchSpec]], list[tuple[dict, tuple, str | None]]]:
    """The pipeshard runs, and the rows: (extra fields, job key, plan key) in report order."""
    pipeshard: list[tuple[str, BenchSpec]] = []
    entries: list[tuple[dict, tuple, str | None]] = []
    entries += [({"section": "systems"}, ("single", mode), None)
                for mode in _single_modes(systems, schedules)]
    if "pipeshard" in systems:
        for name in schedules:
            extra_layout = ({"schedule_kwargs": tuple(sorted(plans[name].schedule_kwargs().items()))}
                            if name == "zb-auto" else None)   # the plan's own zb-auto (its costs)
            pipeshard.append((name, _spec_of(spec, plans[name])) + ((extra_layout,) if extra_layout else ()))
            entries.append(({"section": "systems", "method": "optimal"}, pipeshard_key(*pipeshard[-1]), name))
    if "torch-pipelining" in systems:
        entries += [({"section": "systems"}, ("torch-pipelining", name), None) for name in _torch_names(schedules)]
    if "deepspeed" in systems:
        entries.append(({"section": "systems"}, ("deepspeed", "1f1b"), None))
    for method in methods:  # partition quality: same engine and schedule, only the split differs
        pipeshard.append(("1f1b", _spec_of(spec, plans[f"1f1b/{method}"])))
        entries.append(({"section": "partition", "method": method}, pipeshard_key(*pipeshard[-1]),
                        f"1f1b/{method}"))
    return pipeshard, entries


def _calibrated_plans(prof: Any, raw_plans: dict, combined: dict, meta: dict, link: Any) -> dict:
    """Each split re-predicted from the profile calibrated on the single-process step under load
    (``"loaded"``: p copies at once, the compute as a pipeline's ranks see it), else alone."""
    from experiments.bench.predict import calibrate, plan_for

    p, m = meta["stages"], meta["microbatches"]
    alone = combined.get(("single", "microbatched"), {}).get("step_s")
    loaded = combined.get(("single", "loaded"), {}).get("step_s")
    split = combined.get(("single", SPLIT_MODE), {}).get("step_s") if loaded else None
    single = loaded or alone
    cal, factor = calibrate(prof, single, m, split_step_s=split) if single else (prof, None)
    meta["calibration_factor"] = factor
    meta["split_calibration_factor"] = cal.meta.get("split_calibration_factor")
    meta["calibrated_on"] = None if not single else "single loaded" if loaded else "single microbatched"
    meta["load_slowdown"] = loaded / alone if loaded and alone else None
    plans = {}
    for name, raw in raw_plans.items():
        sched, _, method = name.partition("/")
        plans[name] = plan_for(cal, p, sched, m, virtual_stages=raw.virtual_stages, method=method or "optimal",
                               link_bytes_per_s=link, calibration=factor)
    return plans


def _rows(entries: list, combined: dict, plans: dict, raw_plans: dict) -> list[dict[str, Any]]:
    from experiments.bench.predict import prediction_fields

    rows = []
    for extra, key, plan_key in entries:
        row = dict(combined[key], **extra)
        if plan_key is not None:
            row.update(prediction_fields(plans[plan_key], row, raw_plans[plan_key]))
            row["plan_matches_run"] = [list(r) for r in plans[plan_key].stage_ranges] == row.get("stage_ranges")
        rows.append(row)
    return add_ideal(rows)
