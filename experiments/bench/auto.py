"""The planner's own choice in the benchmark: the `auto` row and the `sweep` (`bench.auto`, `bench.sweep`).

`search_layouts` runs `partitioner.search` on the benchmark's problem (plain SGD, no ZeRO, one
replica, the configured memory limit and `partitioner.search` bounds), the model profiled at
each microbatch size the search tries (one fresh single-threaded process per size, like the
bench's own profile, with the same fixed costs), before anything is measured. `layout_runs`
turns its choice into one pipeshard run (`section="auto"`) and, with `bench.sweep=true`, every
layout it solved into runs too (`section="sweep"`; `bench.sweep_max` keeps the best-predicted
N), so the choice can be set beside the fastest layout actually measured: `sweep_comparison`.

The fastest of many noisy measurements is biased low (the luckiest run wins), so a choice set
beside it looks worse than it is. `confirm_layouts` (`bench.sweep_confirm=N`) therefore runs
the choice and the sweep's N fastest layouts again, head to head in fresh alternating rounds,
and compares those medians only: the sweep selects, the confirmation measures.

Example::

    res = search_layouts(cfg, profile, link=None, timeout_s=600, sweep=True)
    runs, entries = layout_runs(res, spec, sweep=True)      # for experiments.bench.jobs.job_table
    ...                                                     # run, then rows
    print(format_sweep(rows)); sweep_comparison(rows)["auto_over_best_sweep"]
    confirm_layouts(entries, combined, jobs, spec, top=3, rounds=2)["auto_over_best"]
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Callable

from experiments.bench.jobs import Job, pipeshard_key, run_jobs
from experiments.bench.spec import BenchSpec

__all__ = ["search_layouts", "layout_runs", "sweep_comparison", "comparison_line", "format_sweep", "rank_correlation",
           "confirm_layouts", "confirmation_line"]


def _profile_at(c: Any, fixed: Any, timeout_s: float) -> Callable[[int], Any]:
    """`size -> Profile` measured like the bench's own profile, with the bench's fixed costs."""
    from experiments.bench.problem import profile_model

    batch = int(c.train.batch_size)

    def at(size: int) -> Any:
        c2 = dataclasses.replace(c, pipeline=dataclasses.replace(c.pipeline, microbatches=batch // size))
        return dataclasses.replace(profile_model(c2, timeout_s=timeout_s), fixed=fixed)

    return at


def search_layouts(c: Any, prof: Any, *, link: float | None, timeout_s: float, sweep: bool = False,
                   log: Callable[[str], None] | None = print) -> Any:
    """`partitioner.search` for the bench problem (see the module docstring); `prof` is the
    bench's profile at the configured microbatch size (reused for that size). With `sweep`,
    every layout is solved (no pruning)."""
    import partitioner
    from experiments.config import as_config
    from experiments.wiring import search_kwargs

    c = as_config(c)
    batch, m = int(c.train.batch_size), int(c.pipeline.microbatches)
    measure = _profile_at(c, prof.fixed, timeout_s)

    def profiles(size: int) -> Any:
        if size == batch // m:
            return prof
        if log:
            log(f"[bench] profiling layers at microbatch size {size} for the search ...")
        return measure(size)

    listed = c.partitioner.search.schedules
    kw = search_kwargs(c)
    kw.update(batch_per_replica=batch, schedules=list(listed) if listed else None, microbatches=None,
              virtual_stages=None, max_inflight=None, optimizer="sgd", zero_stage=0, data_parallel=1,
              link_bytes_per_s=link, method="optimal", prune=not sweep)
    result = partitioner.search(profiles, **kw)
    if log:
        log(result.table())
    return result


def _layout(cand: Any) -> dict[str, Any]:
    """`run_pipeshard` keywords of a searched layout."""
    out: dict[str, Any] = {"virtual_stages": cand.virtual_stages}
    if cand.max_inflight is not None:
        out["max_inflight"] = cand.max_inflight
    if any(cand.recompute):
        out["activation_checkpointing"] = (True if all(cand.recompute) else [bool(x) for x in cand.recompute])
        out["recompute_granularity"] = getattr(cand.plan, "recompute_granularity", "chunk")
    return out


def _spec_of(spec: BenchSpec, cand: Any) -> BenchSpec:
    ranges = tuple(tuple(r) for r in cand.plan.stage_ranges)
    if cand.virtual_stages == 1:
        return dataclasses.replace(spec, microbatches=cand.microbatches, stage_ranges=ranges)
    return dataclasses.replace(spec, microbatches=cand.microbatches, chunk_ranges=ranges)


def layout_runs(result: Any, spec: BenchSpec, *, sweep: bool = False, sweep_max: int | None = None
                ) -> tuple[list[tuple], list[tuple[dict, tuple, None]]]:
    """The pipeshard runs (`job_table` entries) and the row entries (extra fields, job key, no
    plan key) of the choice (`section="auto"`) and, with `sweep`, of every solved layout."""
    solved = [c for c in result.candidates if c.status == "ok"]
    picks = [("auto", result.chosen)] + [("sweep", c) for c in (solved[:sweep_max] if sweep_max else solved)
                                         if sweep]
    runs, entries = [], []
    for section, cand in picks:
        run = (cand.schedule, _spec_of(spec, cand), _layout(cand))
        runs.append(run)
        extra = {"section": section, "layout": cand.label, "max_inflight": cand.max_inflight,
                 "search_rank": result.candidates.index(cand) + 1, "chosen": cand is result.chosen,
                 "predicted_step_s": cand.step_s, "recompute": list(cand.recompute),
                 "predicted_without_cpu_load_s": cand.plan.step_without_cpu_load_s() if cand.plan.shares_cores else None,
                 "plan_stage_ranges": [list(r) for r in cand.plan.stage_ranges]}
        entries.append((extra, pipeshard_key(*run), None))
    return runs, entries


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (None under 3 pairs or a constant list)."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    a, b = ranks(xs), ranks(ys)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else None


def sweep_comparison(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The choice measured beside the fastest measured layout of the sweep (and the best
    pipeshard schedule row); `auto_over_best_sweep` is the acceptance figure (<= 1.05)."""
    auto = next((r for r in rows if r.get("section") == "auto"), None)
    sweep = [r for r in rows if r.get("section") == "sweep" and r.get("step_s")]
    systems = [r for r in rows if r.get("section") == "systems" and r["system"] == "pipeshard" and r.get("step_s")]
    best = min(sweep, key=lambda r: r["step_s"]) if sweep else None
    best_sys = min(systems, key=lambda r: r["step_s"]) if systems else None
    a = auto.get("step_s") if auto else None
    return {
        "auto_layout": auto.get("layout") if auto else None, "auto_step_s": a,
        "auto_predicted_step_s": auto.get("predicted_step_s") if auto else None,
        "best_sweep_layout": best["layout"] if best else None, "best_sweep_step_s": best["step_s"] if best else None,
        "auto_over_best_sweep": a / best["step_s"] if a and best else None,
        "best_schedule_row": f"{best_sys['schedule']} m={best_sys['microbatches']}" if best_sys else None,
        "auto_over_best_schedule_row": a / best_sys["step_s"] if a and best_sys else None,
        "sweep_runs": len([r for r in rows if r.get("section") == "sweep"]),
        "sweep_failed": len([r for r in rows if r.get("section") == "sweep" and not r.get("step_s")]),
        "sweep_rank_correlation": rank_correlation([r["predicted_step_s"] for r in sweep], [r["step_s"] for r in sweep]),
    }


def comparison_line(cmp: dict[str, Any]) -> str:
    """One sentence: "auto's choice (...) measured X ms, fastest of the sweep Y ms (...), ratio R"."""
    if not cmp.get("auto_step_s"):
        return "auto: the chosen layout did not run (see its row's error)"
    text = (f"auto's choice ({cmp['auto_layout']}) measured {cmp['auto_step_s'] * 1e3:.1f} ms "
            f"(predicted {cmp['auto_predicted_step_s'] * 1e3:.1f} ms)")
    if cmp.get("best_sweep_step_s"):
        text += (f", fastest of the sweep {cmp['best_sweep_step_s'] * 1e3:.1f} ms ({cmp['best_sweep_layout']}), "
                 f"ratio {cmp['auto_over_best_sweep']:.3f}")
        if cmp.get("sweep_rank_correlation") is not None:
            text += f"; predicted vs measured rank correlation {cmp['sweep_rank_correlation']:.2f} over {cmp['sweep_runs']} layouts"
    if cmp.get("auto_over_best_schedule_row"):
        text += (f"; vs the best pipeshard schedule row ({cmp['best_schedule_row']}): "
                 f"ratio {cmp['auto_over_best_schedule_row']:.3f}")
    return text


def format_sweep(rows: list[dict[str, Any]], title: str = "auto and sweep: predicted vs measured") -> str:
    """The auto and sweep rows, fastest measured first: layout, predicted and measured step, error."""
    from rich.console import Console
    from rich.table import Table

    picked = [r for r in rows if r.get("section") in ("auto", "sweep")]
    picked.sort(key=lambda r: (r["section"] != "auto", r.get("step_s") or float("inf")))
    table = Table(title=title)
    for name in ("section", "layout", "search rank", "predicted ms", "measured ms", "error", "stage ranges", "note"):
        table.add_column(name, no_wrap=True)
    for r in picked:
        pred, meas = r.get("predicted_step_s"), r.get("step_s")
        table.add_row(r["section"], str(r.get("layout")), str(r.get("search_rank")),
                      "-" if pred is None else f"{pred * 1e3:.1f}", "-" if meas is None else f"{meas * 1e3:.1f}",
                      "-" if not (pred and meas) else f"{(pred / meas - 1) * 100:+.1f}%",
                      str(r.get("plan_stage_ranges")), (r.get("error") or "")[:60])
    out = io.StringIO()
    Console(file=out, width=220, force_terminal=False, color_system=None).print(table)
    return out.getvalue()


def confirm_layouts(entries: list[tuple], combined: dict[tuple, dict[str, Any]], jobs: dict[tuple, Job],
                    spec: BenchSpec, *, top: int = 3, rounds: int = 2,
                    log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run auto's choice and the sweep's ``top`` fastest layouts (by their first measurement)
    again for ``rounds`` fresh alternating rounds; ``auto_over_best`` compares only these new
    medians (the acceptance figure: <= 1.05)."""
    labels = {key: extra["layout"] for extra, key, _ in entries if extra.get("section") in ("auto", "sweep")}
    auto_key = next((key for extra, key, _ in entries if extra.get("section") == "auto"), None)
    swept = sorted({key for extra, key, _ in entries
                    if extra.get("section") == "sweep" and combined[key].get("step_s")},
                   key=lambda k: combined[k]["step_s"])
    keys = list(dict.fromkeys(([auto_key] if auto_key is not None else []) + swept[:top]))
    if log:
        log(f"[bench] confirming {len(keys)} layouts head to head ({rounds} fresh rounds): "
            + ", ".join(labels[k] for k in keys))
    again = run_jobs({k: jobs[k] for k in keys}, spec, rounds=rounds, log=log)
    layouts = [{"layout": labels[k], "auto": k == auto_key, "step_s": again[k].get("step_s"),
                "step_s_rounds": again[k].get("step_s_rounds", []),
                "step_s_by_round": again[k].get("step_s_by_round", []), "first_step_s": combined[k].get("step_s"),
                "error": again[k].get("error")} for k in keys]
    ok = [x for x in layouts if x["step_s"]]
    best = min(ok, key=lambda x: x["step_s"]) if ok else None
    auto = next((x for x in layouts if x["auto"]), None)
    a = auto["step_s"] if auto else None
    return {"rounds": rounds, "layouts": layouts, "auto_layout": auto["layout"] if auto else None,
            "auto_step_s": a, "best_layout": best["layout"] if best else None,
            "best_step_s": best["step_s"] if best else None,
            "auto_over_best": a / best["step_s"] if a and best else None}


def confirmation_line(conf: dict[str, Any]) -> str:
    """One sentence on the head-to-head confirmation (:func:`confirm_layouts`)."""
    if not conf.get("auto_step_s"):
        return "confirmation: auto's choice did not run again (see its error)"
    others = "; ".join(f"{x['layout']} {x['step_s'] * 1e3:.1f}" for x in conf["layouts"]
                       if not x["auto"] and x["step_s"])
    n = conf["rounds"]
    return (f"confirmation ({n} fresh round{'s' if n != 1 else ''}, head to head): auto ({conf['auto_layout']}) "
            f"{conf['auto_step_s'] * 1e3:.1f} ms; {others or 'no other layout'}; fastest "
            f"{conf['best_layout']}: auto / fastest = {conf['auto_over_best']:.3f}")
