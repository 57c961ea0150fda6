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
"""

from __future__ import annotations

import argparse
import io
import json
import traceback
from typing import Any, Callable, Iterable, Sequence

from experiments.peers import (PIPESHARD_SCHEDULES, SINGLE_MODES, TORCH_SCHEDULES, BenchSpec,
                               WorkerFailure, run_deepspeed, run_pipeshard, run_single,
                               run_torch_pipelining, spawn_workers, tiny_spec, uniform_ranges)

__all__ = [
    "BenchSpec", "tiny_spec", "uniform_ranges", "spawn_workers", "WorkerFailure",
    "run_single", "run_pipeshard", "run_torch_pipelining", "run_deepspeed",
    "SINGLE_MODES", "PIPESHARD_SCHEDULES", "TORCH_SCHEDULES",
    "SYSTEMS", "run_peers", "guarded_row", "error_row", "ideal_step_s", "add_ideal",
    "json_rows", "format_table", "bar_chart",
]

SYSTEMS = ("single", "pipeshard", "torch-pipelining", "deepspeed")
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
