"""Benchmark rows reported: the ideal step, a table, JSON, a bar chart, ratios and Markdown.

A row is a dict with ``system`` (``single``, ``pipeshard``, ``torch-pipelining``,
``deepspeed``), ``schedule``, ``stages``, ``microbatches``, ``virtual_stages``, ``step_s``
(median of the timed steps), ``step_s_all``, ``samples_per_s``, ``peak_rss_bytes`` (one per
rank), ``loss`` (last step), ``losses`` (every step, warm-up included) and, after
:func:`add_ideal`, ``ideal_step_s``. A run that failed has ``error`` (a one-line cause) and
``traceback``, and ``None`` for the figures.

Example::

    from experiments.bench import format_table, bar_chart, run_peers, tiny_spec

    rows = run_peers(tiny_spec(), systems=("single", "pipeshard", "torch-pipelining"))
    print(format_table(rows))
    bar_chart(rows, "bench.png")
"""

from __future__ import annotations

import io
from typing import Any, Iterable, Sequence

__all__ = ["ideal_step_s", "add_ideal", "json_rows", "format_table", "bar_chart", "ratios",
           "format_prediction_table", "format_rank_times", "format_markdown"]

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
    pipeshard 1f1b / torch 1f1b, deepspeed / pipeshard 1f1b, best pipeshard / its ideal, best
    pipeshard schedule / best torch schedule, pipeshard zbv / torch zbv."""
    sysrows = [r for r in rows if r.get("section", "systems") == "systems"]
    ps = _best(sysrows, system="pipeshard", schedule="1f1b")
    tp = _best(sysrows, system="torch-pipelining", schedule="1f1b")
    ds = _best(sysrows, system="deepspeed")
    best = _best(sysrows, system="pipeshard")
    best_torch = _best(sysrows, system="torch-pipelining")
    pz, tz = _best(sysrows, system="pipeshard", schedule="zbv"), _best(sysrows, system="torch-pipelining", schedule="zbv")
    out: dict[str, Any] = {
        "pipeshard_1f1b_over_torch_1f1b": ps["step_s"] / tp["step_s"] if ps and tp else None,
        "deepspeed_over_pipeshard_1f1b": ds["step_s"] / ps["step_s"] if ps and ds else None,
        "best_pipeshard_schedule": best["schedule"] if best else None,
        "best_pipeshard_over_ideal": (best["step_s"] / best["ideal_step_s"]
                                      if best and best.get("ideal_step_s") else None),
        "best_torch_schedule": best_torch["schedule"] if best_torch else None,
        "best_pipeshard_over_best_torch": best["step_s"] / best_torch["step_s"] if best and best_torch else None,
        "pipeshard_zbv_over_torch_zbv": pz["step_s"] / tz["step_s"] if pz and tz else None,
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


_RANK_PARTS = (("forward_s", "forward"), ("backward_s", "backward"), ("comm_wait_s", "p2p wait"),
               ("comm_issue_s", "p2p issue"), ("optimizer_s", "after the actions"))


def format_rank_times(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: per pipeshard schedule and rank, where its step went (ms, medians over the
    timed steps of the engine's ``StepResult.stats``): compute, waiting on transfers, inside the
    calls that issue them, everything after the last action (gradient sync, loss all-reduce,
    update), and the rest (the engine's dispatch, and where the parts' medians do not add up).

    >>> row = dict(system="pipeshard", section="systems", schedule="1f1b", step_s=0.1, stats=[dict(
    ...     forward_s=0.02, backward_s=0.04, comm_wait_s=0.01, comm_issue_s=0.005, optimizer_s=0.01)])
    >>> format_rank_times([row]).splitlines()[-1]
    '| 1f1b | 0 | 100.0 | 20.0 | 40.0 | 10.0 | 5.0 | 10.0 | 15.0 |'
    """
    out = ["| pipeshard schedule | rank | step | " + " | ".join(n for _, n in _RANK_PARTS) + " | rest |",
           "|---" * (len(_RANK_PARTS) + 4) + "|"]
    for r in rows:
        if r.get("system") != "pipeshard" or r.get("section") != "systems" or not r.get("step_s"):
            continue
        for rank, st in enumerate(r.get("stats") or []):
            parts = [float(st.get(k) or 0.0) for k, _ in _RANK_PARTS]
            cells = [r["step_s"]] + parts + [r["step_s"] - sum(parts)]
            out.append(f"| {r['schedule']} | {rank} | " + " | ".join(f"{c * 1e3:.1f}" for c in cells) + " |")
    return "\n".join(out)


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
    out.append(format_rank_times(rows))
    out.append("")
    rat = result.get("ratios", {})
    for key, val in rat.items():
        out.append(f"- `{key}`: " + (f"{val:.3f}" if isinstance(val, float) else str(val)))
    return "\n".join(out) + "\n"
