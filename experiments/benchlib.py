"""Benchmark library: run the peers on one spec, and report rows as a table, JSON and a chart.

A row is a dict with ``system`` (``single``, ``pipeshard``, ``torch-pipelining``,
``deepspeed``), ``schedule``, ``stages``, ``microbatches``, ``virtual_stages``, ``step_s``
(median of the timed steps), ``step_s_all``, ``samples_per_s``, ``peak_rss_bytes`` (one per
rank), ``loss`` (last step), ``losses`` (every step, warm-up included) and, after
:func:`add_ideal`, ``ideal_step_s``. A run that fails still gives a row, with ``error`` (a
one-line cause) and ``traceback``, and ``None`` for the figures.

Example::

    from experiments.benchlib import tiny_spec, run_peers, format_table, bar_chart

    rows = run_peers(tiny_spec(), systems=("single", "pipeshard", "torch-pipelining"))
    print(format_table(rows))
    bar_chart(rows, "bench.png")

or from a shell: ``python -m experiments.benchlib --layers 8 --width 1024 --batch 64``.

:func:`run_bench` is the whole ``python -m experiments.bench`` run on a composed config
(profile, plans, every system in fresh processes, rounds, predictions); :func:`ratios`,
:func:`format_prediction_table` and :func:`format_markdown` report it.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import traceback
from typing import Any, Callable, Iterable, Sequence

from experiments.peers import (PIPESHARD_SCHEDULES, SINGLE_MODES, TORCH_SCHEDULES, BenchSpec,  # noqa: I001
                               WorkerFailure, run_deepspeed, run_pipeshard, run_single,
                               run_torch_pipelining, spawn_workers, tiny_spec, uniform_ranges)

__all__ = [
    "BenchSpec", "tiny_spec", "uniform_ranges", "spawn_workers", "WorkerFailure",
    "run_single", "run_pipeshard", "run_torch_pipelining", "run_deepspeed",
    "SINGLE_MODES", "PIPESHARD_SCHEDULES", "TORCH_SCHEDULES",
    "SYSTEMS", "run_peers", "guarded_row", "error_row", "ideal_step_s", "add_ideal",
    "json_rows", "format_table", "bar_chart", "run_bench", "ratios", "format_prediction_table",
    "TORCH_FOR_PIPESHARD", "format_markdown", "combine_rounds",
]

SYSTEMS = ("single", "pipeshard", "torch-pipelining", "deepspeed")
# torch.distributed.pipelining's schedules run for each pipeshard schedule asked for.
TORCH_FOR_PIPESHARD: dict[str, tuple[str, ...]] = {
    "gpipe": ("gpipe",), "1f1b": ("1f1b",), "interleaved-1f1b": ("interleaved-1f1b",),
    "zb-h1": ("interleaved-zb", "zbv"),
}
_NOT_JSON = ("params",)


def ideal_step_s(single_step_s: float, p: int, m: int) -> float:
    """A perfectly balanced p-stage pipeline with m microbatches and free transfers:
    ``single_step_s / p x (m + p - 1) / m`` (each stage does 1/p of the work, plus the
    (p - 1) / m fill-and-drain bubble of GPipe / 1F1B)."""
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 and m >= 1, got p={p}, m={m}")
    return single_step_s / p * (m + p - 1) / m


def add_ideal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set ``ideal_step_s`` on every row from the ``single`` / ``microbatched`` row with the same
    microbatch count (``None`` when there is none, or it failed). Returns ``rows``."""
    ref = {r["microbatches"]: r["step_s"] for r in rows
           if r["system"] == "single" and r["schedule"] == "microbatched" and r.get("step_s")}
    for r in rows:
        single = ref.get(r["microbatches"])
        r["ideal_step_s"] = ideal_step_s(single, r["stages"], r["microbatches"]) if single else None
    return rows


def error_row(system: str, schedule: str, spec: BenchSpec, exc: BaseException, *,
              stages: int, virtual_stages: int = 1) -> dict[str, Any]:
    """The row of a run that failed: the figures are ``None``, ``error`` says why."""
    if isinstance(exc, WorkerFailure) and exc.rank is not None:
        last = exc.tracebacks[exc.rank].strip().splitlines()[-1]
        cause = f"rank {exc.rank}: {last}"
    else:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {"system": system, "schedule": schedule, "stages": stages,
            "microbatches": spec.microbatches, "virtual_stages": virtual_stages,
            "step_s": None, "step_s_all": [], "samples_per_s": None, "peak_rss_bytes": [],
            "loss": None, "losses": [], "error": cause,
            "traceback": "".join(traceback.format_exception(exc))}


def guarded_row(system: str, schedule: str, spec: BenchSpec, run: Callable[[], dict[str, Any]], *,
                stages: int, virtual_stages: int = 1) -> dict[str, Any]:
    """``run()``'s row, or an :func:`error_row` if it raises (so one failure ends no benchmark)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        return error_row(system, schedule, spec, exc, stages=stages, virtual_stages=virtual_stages)


def run_peers(spec: BenchSpec, *, systems: Sequence[str] = SYSTEMS,
              single_modes: Sequence[str] = SINGLE_MODES,
              pipeshard_schedules: Sequence[str] = tuple(PIPESHARD_SCHEDULES),
              torch_schedules: Sequence[str] = tuple(TORCH_SCHEDULES),
              timeout_s: float = 900.0,
              log: Callable[[str], None] | None = print) -> list[dict[str, Any]]:
    """Run every requested peer on ``spec``, one after another, each in fresh processes.

    Returns the rows (with ``ideal_step_s``), failures included as error rows.
    """
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    p = spec.num_stages
    jobs: list[tuple[str, str, int, int, Callable[[], dict[str, Any]]]] = []
    if "single" in systems:
        for mode in single_modes:
            jobs.append(("single", mode, 1, 1,
                         lambda mode=mode: run_single(spec, mode=mode, timeout_s=timeout_s)))
    if "pipeshard" in systems:
        for name in pipeshard_schedules:
            v = PIPESHARD_SCHEDULES.get(name, 1)
            jobs.append(("pipeshard", name, p, v,
                         lambda name=name: run_pipeshard(spec, name, timeout_s=timeout_s)))
    if "torch-pipelining" in systems:
        for name in torch_schedules:
            v = TORCH_SCHEDULES[name][1] if name in TORCH_SCHEDULES else 1
            jobs.append(("torch-pipelining", name, p, v,
                         lambda name=name: run_torch_pipelining(spec, name, timeout_s=timeout_s)))
    if "deepspeed" in systems:
        jobs.append(("deepspeed", "1f1b", p, 1, lambda: run_deepspeed(spec, timeout_s=timeout_s)))

    rows = []
    for system, schedule, stages, v, run in jobs:
        row = guarded_row(system, schedule, spec, run, stages=stages, virtual_stages=v)
        if log:
            figure = f"{row['step_s'] * 1e3:.1f} ms" if row.get("step_s") else f"ERROR {row['error']}"
            log(f"[bench] {system:17s} {schedule:17s} {figure}")
        rows.append(row)
    return add_ideal(rows)


def json_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without what JSON cannot hold (parameters returned for tests)."""
    return [{k: v for k, v in r.items() if k not in _NOT_JSON} for r in rows]


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_table(rows: Sequence[dict[str, Any]], title: str = "pipeline benchmark") -> str:
    """A rich-rendered text table: step time, throughput, ratio to ideal, memory, loss, errors."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name, justify in (("system", "left"), ("schedule", "left"), ("p", "right"), ("m", "right"),
                          ("v", "right"), ("step ms", "right"), ("samples/s", "right"),
                          ("x ideal", "right"), ("peak RSS MiB (max rank)", "right"),
                          ("loss", "right"), ("error", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        ideal, step = r.get("ideal_step_s"), r.get("step_s")
        rss = max(r["peak_rss_bytes"]) if r.get("peak_rss_bytes") else None
        table.add_row(str(r["system"]), str(r["schedule"]), str(r["stages"]), str(r["microbatches"]),
                      str(r.get("virtual_stages", 1)), _fmt(step, 1e3), _fmt(r.get("samples_per_s")),
                      _fmt(step / ideal if step and ideal else None, 1.0, 2),
                      _fmt(rss, 1 / 2**20, 0), _fmt(r.get("loss"), 1.0, 4),
                      (r.get("error") or "")[:80])
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(table)
    return out.getvalue()


def bar_chart(rows: Sequence[dict[str, Any]], path: str, title: str = "step time (median)") -> None:
    """Save a horizontal bar chart of ``step_s`` per row (failed rows marked), ideal as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['system']} {r['schedule']}" for r in rows]
    values = [(r.get("step_s") or 0.0) * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    bars = ax.barh(range(len(rows)), values, color="tab:blue")
    for bar, r in zip(bars, rows):
        if r.get("error"):
            bar.set_color("lightgray")
            ax.text(0, bar.get_y() + bar.get_height() / 2, "  failed", va="center", fontsize=8)
    ideals = {r["ideal_step_s"] for r in rows if r.get("ideal_step_s") and r["stages"] > 1}
    for ideal in sorted(ideals):
        ax.axvline(ideal * 1e3, color="tab:red", linestyle="--", label=f"ideal {ideal * 1e3:.1f} ms")
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title)
    if ideals:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _best(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    ok = [r for r in rows if r.get("step_s") and all(r.get(k) == v for k, v in match.items())]
    return min(ok, key=lambda r: r["step_s"]) if ok else None


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios over the ``systems`` rows (None where a row is missing or failed):
    pipeshard 1f1b / torch 1f1b, deepspeed / pipeshard 1f1b, best pipeshard / its ideal."""
    sysrows = [r for r in rows if r.get("section", "systems") == "systems"]
    ps = _best(sysrows, system="pipeshard", schedule="1f1b")
    tp = _best(sysrows, system="torch-pipelining", schedule="1f1b")
    ds = _best(sysrows, system="deepspeed")
    best = _best(sysrows, system="pipeshard")
    out: dict[str, Any] = {
        "pipeshard_1f1b_over_torch_1f1b": ps["step_s"] / tp["step_s"] if ps and tp else None,
        "deepspeed_over_pipeshard_1f1b": ds["step_s"] / ps["step_s"] if ps and ds else None,
        "best_pipeshard_schedule": best["schedule"] if best else None,
        "best_pipeshard_over_ideal": (best["step_s"] / best["ideal_step_s"]
                                      if best and best.get("ideal_step_s") else None),
    }
    return out


def format_prediction_table(rows: Sequence[dict[str, Any]], title: str = "predicted vs measured"
                            ) -> str:
    """pipeshard rows: split method, measured and predicted step, error, activation bytes."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name in ("section", "schedule", "method", "stage ranges", "step ms", "predicted ms",
                 "error", "uncal. error", "act. MiB meas/pred per rank", "act. error"):
        table.add_column(name, no_wrap=True)
    for r in rows:
        if r.get("system") != "pipeshard":
            continue
        meas, pred = r.get("measured_activation_bytes"), r.get("predicted_activation_bytes")
        act = "-" if not meas or not pred else " ".join(
            f"{a / 2**20:.1f}/{b / 2**20:.1f}" for a, b in zip(meas, pred))
        err = r.get("activation_error")
        table.add_row(str(r.get("section", "")), str(r["schedule"]), str(r.get("method", "")),
                      str(r.get("stage_ranges", "")), _fmt(r.get("step_s"), 1e3),
                      _fmt(r.get("predicted_step_s"), 1e3),
                      _fmt(r.get("step_error"), 100, 1) + ("%" if r.get("step_error") is not None else ""),
                      _fmt(r.get("step_error_uncalibrated"), 100, 1)
                      + ("%" if r.get("step_error_uncalibrated") is not None else ""),
                      act, "-" if not err else " ".join(_fmt(e, 100, 1) + "%" for e in err))
    out = io.StringIO()
    Console(file=out, width=220, force_terminal=False, color_system=None).print(table)
    return out.getvalue()


def format_markdown(result: dict[str, Any]) -> str:
    """``bench.json``'s content as Markdown tables (systems, partition quality, predictions, ratios),
    for docs/performance.md and the README."""
    def ms(x: Any) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    def pct(x: Any) -> str:
        return "-" if x is None else f"{x * 100:+.1f}%"

    rows, out = result["rows"], []
    out.append("| system | schedule | v | step ms | samples/s | x ideal | peak RSS MiB (per rank) |")
    out.append("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("section") != "systems":
            continue
        ideal = r.get("ideal_step_s")
        x = f"{r['step_s'] / ideal:.2f}" if r.get("step_s") and ideal else "-"
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r.get("peak_rss_bytes") or [])
        sps = f"{r['samples_per_s']:.1f}" if r.get("samples_per_s") else "-"
        err = f" (failed: {r['error'][:60]})" if r.get("error") else ""
        out.append(f"| {r['system']} | {r['schedule']}{err} | {r.get('virtual_stages', 1)} | {ms(r.get('step_s'))} "
                   f"| {sps} | {x} | {rss} |")
    out.append("")
    out.append("| split method (pipeshard 1f1b) | stage ranges | measured ms | predicted ms | error |")
    out.append("|---|---|---|---|---|")
    for r in rows:
        if r.get("section") == "partition":
            out.append(f"| {r['method']} | {r.get('stage_ranges')} | {ms(r.get('step_s'))} | "
                       f"{ms(r.get('predicted_step_s'))} | {pct(r.get('step_error'))} |")
    out.append("")
    out.append("| pipeshard schedule | measured ms | predicted ms (calibrated) | error | uncalibrated error "
               "| activation MiB measured / predicted per rank | activation error |")
    out.append("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("system") == "pipeshard" and r.get("section") == "systems":
            meas, pred = r.get("measured_activation_bytes") or [], r.get("predicted_activation_bytes") or []
            act = ", ".join(f"{a / 2**20:.1f} / {b / 2**20:.1f}" for a, b in zip(meas, pred)) or "-"
            aerr = ", ".join(pct(e) for e in r.get("activation_error") or []) or "-"
            out.append(f"| {r['schedule']} | {ms(r.get('step_s'))} | {ms(r.get('predicted_step_s'))} | "
                       f"{pct(r.get('step_error'))} | {pct(r.get('step_error_uncalibrated'))} | {act} | {aerr} |")
    out.append("")
    rat = result.get("ratios", {})
    for key, val in rat.items():
        out.append(f"- `{key}`: " + (f"{val:.3f}" if isinstance(val, float) else str(val)))
    return "\n".join(out) + "\n"


def combine_rounds(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same job run in several rounds: ``step_s`` is the median of every timed
    step of every round, ``step_s_rounds`` each round's median, memory the maximum; the other
    fields come from the round whose median is the middle one. A failed round makes the row
    an error row only if every round failed."""
    ok = [r for r in runs if r.get("step_s")]
    if not ok:
        return dict(runs[-1])
    mid = sorted(ok, key=lambda r: r["step_s"])[len(ok) // 2]
    row = dict(mid)
    steps = [t for r in ok for t in r["step_s_all"]]
    row["step_s_all"] = steps
    row["step_s"] = statistics.median(steps)
    row["step_s_rounds"] = [r["step_s"] for r in ok]
    row["samples_per_s"] = mid["samples_per_s"] * mid["step_s"] / row["step_s"]
    row["peak_rss_bytes"] = [max(v) for v in zip(*(r["peak_rss_bytes"] for r in ok))]
    row["rounds"] = len(ok)
    if len(ok) < len(runs):
        row["failed_rounds"] = [r.get("error") for r in runs if not r.get("step_s")]
    return row


def run_bench(cfg: Any, *, rounds: int | None = None, log: Callable[[str], None] | None = print
              ) -> dict[str, Any]:
    """The whole ``python -m experiments.bench`` run on a composed config; returns
    ``{"rows", "ratios", "prediction", "meta", "plans", "profile"}`` (see experiments/bench.py).

    Order: profile (one process) and link speed; plans from the measured profile (so the
    splits are fixed before any pipeline runs); then every job (single, pipeshard, peers,
    partition-quality splits), each in fresh processes, repeated ``rounds`` times
    (``bench.rounds`` when the config has it, else 1) in alternating order (A B C, C B A, ...)
    so that a machine whose load drifts biases no system; a row pools its rounds' steps.
    Finally the profile is calibrated from the single-process step and the predictions are
    made for the splits that ran.
    """
    import dataclasses
    import os
    import time

    from experiments.peers.predict import calibrate, plan_for, prediction_fields
    from experiments.peers.problem import bench_spec, measure_link, plain_config, profile_model

    say = log or (lambda _msg: None)
    c = plain_config(cfg)
    bc = c["bench"]
    rounds = max(1, int(rounds if rounds is not None else bc.get("rounds", 1)))
    p, m = int(c["pipeline"]["stages"]), int(c["pipeline"]["microbatches"])
    systems = list(bc["systems"])
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"bench.systems has unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
    schedules = [str(s) for s in bc["schedules"]]
    timeout = float(bc["timeout_s"])
    meta: dict[str, Any] = {"load_avg_start": list(os.getloadavg()), "cpus": os.cpu_count(),
                            "stages": p, "microbatches": m, "rounds": rounds,
                            "batch_size": int(c["train"]["batch_size"]), "model": c["model"],
                            "torch_threads_per_rank": 1, "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    say("[bench] profiling layers (one process, one thread) ...")
    prof = profile_model(c, timeout_s=timeout)
    link = c["partitioner"].get("link_bytes_per_s")
    if link is None and p > 1:
        nbytes = max(layer.output_bytes for layer in prof.layers[:-1])
        link = measure_link(nbytes)
        meta["link_measured_bytes"] = nbytes
    meta["link_bytes_per_s"] = link
    spec0 = bench_spec(c)
    meta["model_name"] = spec0.name

    # Splits from the (uncalibrated) profile, before anything runs.
    def v_of(name: str) -> int:
        return PIPESHARD_SCHEDULES.get(name, 1)

    raw_plans = {name: plan_for(prof, p, name, m, virtual_stages=v_of(name), link_bytes_per_s=link)
                 for name in dict.fromkeys(schedules + ["1f1b"])}
    methods = [str(x) for x in (bc.get("methods") or ())]
    for method in methods:
        raw_plans[f"1f1b/{method}"] = plan_for(prof, p, "1f1b", m, method=method, link_bytes_per_s=link)
    inter = next((pl for pl in raw_plans.values() if pl.virtual_stages == 2), None)
    chunk_ranges = inter.stage_ranges if inter is not None else (
        plan_for(prof, p, "interleaved-1f1b", m, virtual_stages=2, link_bytes_per_s=link).stage_ranges
        if p * 2 <= len(spec0.layers) else None)
    spec = dataclasses.replace(spec0, stage_ranges=tuple(raw_plans["1f1b"].stage_ranges),
                               chunk_ranges=None if chunk_ranges is None else tuple(chunk_ranges))

    def spec_for(plan: Any) -> BenchSpec:
        if plan.virtual_stages == 1:
            return dataclasses.replace(spec, stage_ranges=tuple(plan.stage_ranges))
        return dataclasses.replace(spec, chunk_ranges=tuple(plan.stage_ranges))

    # jobs: key -> (system, schedule, stages, v, run); rows refer to a job by key.
    jobs: dict[tuple, tuple[str, str, int, int, Callable[[], dict[str, Any]]]] = {}
    entries: list[tuple[dict[str, Any], tuple, str | None]] = []  # (extra fields, job key, plan key)

    def job(key: tuple, system: str, schedule: str, stages: int, v: int, run: Callable[[], dict[str, Any]]) -> tuple:
        jobs.setdefault(key, (system, schedule, stages, v, run))
        return key

    if "single" in systems:
        for mode in SINGLE_MODES:
            k = job(("single", mode), "single", mode, 1, 1,
                    lambda mode=mode: run_single(spec0, mode=mode, timeout_s=timeout))
            entries.append(({"section": "systems"}, k, None))
    if "pipeshard" in systems:
        for name in schedules:
            s_ = spec_for(raw_plans[name])
            k = job(("pipeshard", name, tuple(map(tuple, raw_plans[name].stage_ranges))), "pipeshard", name, p,
                    v_of(name), lambda name=name, s_=s_: run_pipeshard(s_, name, timeout_s=timeout))
            entries.append(({"section": "systems", "method": "optimal"}, k, name))
    if "torch-pipelining" in systems:
        for name in dict.fromkeys(t for s_ in schedules for t in TORCH_FOR_PIPESHARD.get(s_, ())):
            k = job(("torch-pipelining", name), "torch-pipelining", name, p, TORCH_SCHEDULES[name][1],
                    lambda name=name: run_torch_pipelining(spec, name, timeout_s=timeout))
            entries.append(({"section": "systems"}, k, None))
    if "deepspeed" in systems:
        k = job(("deepspeed", "1f1b"), "deepspeed", "1f1b", p, 1, lambda: run_deepspeed(spec, timeout_s=timeout))
        entries.append(({"section": "systems"}, k, None))
    for method in methods:  # partition quality: same engine and schedule, only the split differs
        pl = raw_plans[f"1f1b/{method}"]
        s_ = spec_for(pl)
        k = job(("pipeshard", "1f1b", tuple(map(tuple, pl.stage_ranges))), "pipeshard", "1f1b", p, 1,
                lambda s_=s_: run_pipeshard(s_, "1f1b", timeout_s=timeout))
        entries.append(({"section": "partition", "method": method}, k, f"1f1b/{method}"))

    runs: dict[tuple, list[dict[str, Any]]] = {k: [] for k in jobs}
    order = list(jobs)
    for rnd in range(rounds):
        for k in (order if rnd % 2 == 0 else order[::-1]):
            system, schedule, stages, v, run = jobs[k]
            row = guarded_row(system, schedule, spec, run, stages=stages, virtual_stages=v)
            figure = f"{row['step_s'] * 1e3:.1f} ms" if row.get("step_s") else f"ERROR {row.get('error')}"
            say(f"[bench] round {rnd + 1}/{rounds} {system:17s} {schedule:17s} {figure}")
            runs[k].append(row)
    combined = {k: combine_rounds(v) for k, v in runs.items()}

    single = combined.get(("single", "microbatched"), {}).get("step_s")
    cal, factor = calibrate(prof, single, m) if single else (prof, None)
    meta["calibration_factor"] = factor
    plans = {}
    for name, raw in raw_plans.items():
        sched, _, method = name.partition("/")
        plans[name] = plan_for(cal, p, sched, m, virtual_stages=raw.virtual_stages, method=method or "optimal",
                               link_bytes_per_s=link, calibration=factor)
    rows: list[dict[str, Any]] = []
    for extra, k, plan_key in entries:
        row = {kk: vv for kk, vv in combined[k].items()}
        row.update(extra)
        if plan_key is not None:
            row.update(prediction_fields(plans[plan_key], row, raw_plans[plan_key]))
            row["plan_matches_run"] = [list(r) for r in plans[plan_key].stage_ranges] == row.get("stage_ranges")
        rows.append(row)

    add_ideal(rows)
    meta["load_avg_end"] = list(os.getloadavg())
    prediction = [{k_: r.get(k_) for k_ in ("section", "schedule", "method", "step_s", "predicted_step_s",
                                            "step_error", "predicted_step_uncalibrated_s",
                                            "step_error_uncalibrated", "predicted_activation_bytes",
                                            "measured_activation_bytes", "activation_error")}
                  for r in rows if r["system"] == "pipeshard"]
    return {"rows": json_rows(rows), "ratios": ratios(rows), "prediction": prediction, "meta": meta,
            "plans": {name: pl.to_dict() for name, pl in plans.items()}, "profile": prof.to_dict()}


def _main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run the peer systems on a residual MLP.")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--single-modes", default=",".join(SINGLE_MODES))
    ap.add_argument("--pipeshard-schedules", default=",".join(PIPESHARD_SCHEDULES))
    ap.add_argument("--torch-schedules", default=",".join(TORCH_SCHEDULES))
    ap.add_argument("--json", default=None, help="write {'rows': [...]} here")
    ap.add_argument("--png", default=None, help="write the bar chart here")
    a = ap.parse_args(argv)
    spec = tiny_spec(layers=a.layers, width=a.width, batch=a.batch, stages=a.stages,
                     microbatches=a.microbatches, steps=a.steps, warmup=a.warmup)
    rows = run_peers(spec, systems=a.systems.split(","), single_modes=a.single_modes.split(","),
                     pipeshard_schedules=a.pipeshard_schedules.split(","),
                     torch_schedules=a.torch_schedules.split(","))
    print(format_table(rows, title=f"{spec.name}, batch {a.batch}"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": json_rows(rows)}, f, indent=1)
    if a.png:
        bar_chart(rows, a.png)


if __name__ == "__main__":
    _main()
