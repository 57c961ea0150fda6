"""Issue 39's MLP check: the search's choice measured against its prediction and its top five.

The model: the project's residual MLP with 12 blocks of 256 -> 1024 -> 256 (plus its input layer
and head), batch 256 on 3 stages, the bench's profile taken at 32 samples (8 microbatches) and
the search's other microbatch sizes profiled each in turn (``experiments.bench.auto``). The
search runs over every schedule, chunk count, microbatch count and zb-h2 cap, and its five
best-predicted layouts are run by the bench's own harness (``python -m experiments.bench`` with
``bench.sweep=true bench.sweep_max=5 bench.sweep_confirm=5``: fresh processes, one thread per
rank, ``--rounds`` alternating rounds, the median of every timed step; then the five again, head
to head, in fresh rounds). The measured figure of the table is that head-to-head median.

Prints one table (layout, search rank, predicted ms, measured ms, error, rank by measured) and
the issue's two checks:

- the chosen layout's measured step is within 10% of its prediction;
- it is no slower than the fastest measured layout of the five (chosen / fastest <= 1), strictly
  on the head-to-head medians, and at the measurement's resolution: the ratio's 95% interval
  from a paired bootstrap over the head-to-head rounds (:func:`ratio_interval`: the same rounds
  resampled for both layouts, then the steps within each). When that interval holds 1, the
  chosen layout is not distinguishable from the fastest at this resolution; the strict verdict
  is printed beside it either way.

Timings need a quiet machine: on a shared one each 3-rank run gets a different share of the
cores, and the check says nothing. Run::

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/mlp_search_check.py            # the issue's case
    PYTHONPATH=. python scripts/mlp_search_check.py --rounds 5 --json out.json
    PYTHONPATH=. python scripts/mlp_search_check.py --tiny                        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from typing import Any, Sequence

__all__ = ["OVERRIDES", "PROBE_MICROBATCHES", "check", "drift", "main", "overrides", "probe_speed", "ratio_interval", "table_rows"]

OVERRIDES = ["experiment=mlp_profile", "model.depth=12", "model.dim=256", "model.width=1024", "model.profile=uniform",
             "data=synthetic", "pipeline.stages=3", "pipeline.microbatches=8", "train.batch_size=256",
             "bench.systems=[pipeshard]", "bench.schedules=[1f1b]", "bench.methods=[]", "bench.sweep=true"]
"""The issue's case as ``python -m experiments.bench`` overrides (profiled at 256 / 8 = 32 samples)."""

TOLERANCE = 0.10
"""The issue's bound on the chosen layout's |measured / predicted - 1|."""


def overrides(*, top: int = 5, rounds: int = 3, steps: int = 7, warmup: int = 2, tiny: bool = False) -> list[str]:
    """The bench overrides of the check (``tiny``: 4 blocks, batch 24, one step: a smoke run)."""
    out = OVERRIDES + [f"bench.sweep_max={top}", f"bench.sweep_confirm={top}", f"bench.rounds={rounds}",
                       f"bench.steps={steps}", f"bench.warmup_steps={warmup}"]
    if tiny:
        out += ["model.depth=4", "model.dim=32", "model.width=64", "train.batch_size=24",
                "pipeline.microbatches=4", "partitioner.search.max_microbatches=8"]
    return out


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per layout of the sweep: its search rank and prediction, its first-pass and
    head-to-head medians (``measured_s``: the head-to-head one where it ran again), the error
    of the prediction and its rank by measured step (1 = fastest)."""
    again = {x["layout"]: x for x in (result.get("auto", {}).get("confirmation") or {}).get("layouts", [])}
    rows = []
    for r in result["rows"]:
        if r.get("section") != "sweep":
            continue
        conf = again.get(r["layout"], {})
        measured = conf.get("step_s") or r.get("step_s")
        pred = r.get("predicted_step_s")
        rows.append({"layout": r["layout"], "chosen": bool(r.get("chosen")), "search_rank": r.get("search_rank"),
                     "predicted_s": pred, "predicted_without_cpu_load_s": r.get("predicted_without_cpu_load_s"), "first_pass_s": r.get("step_s"), "measured_s": measured,
                     "measured_rounds_s": conf.get("step_s_rounds") or r.get("step_s_rounds"),
                     "measured_steps_by_round": conf.get("step_s_by_round") or [],
                     "error": (measured / pred - 1) if measured and pred else None,
                     "stage_ranges": r.get("plan_stage_ranges"), "run_error": r.get("error")})
    ok = sorted((x for x in rows if x["measured_s"]), key=lambda x: x["measured_s"])
    for i, x in enumerate(ok):
        x["measured_rank"] = i + 1
    return sorted(rows, key=lambda x: x["search_rank"] or 0)


def ratio_interval(a_rounds: Sequence[Sequence[float] | None], b_rounds: Sequence[Sequence[float] | None], *,
                   level: float = 0.95, reps: int = 4000, seed: int = 0) -> tuple[float, float, float] | None:
    """``median(a) / median(b)`` over every step of the rounds both ran, and its ``level``
    percentile interval from a paired, two-level bootstrap: each replicate draws rounds with
    replacement (the same rounds for a and b: round k of both ran minutes apart at most, under
    the same spell of the machine), then each drawn round's steps with replacement. None
    when no round has steps of both.

    >>> ratio_interval([[2.0, 2.0], [2.0]], [[1.0], [1.0, 1.0]])
    (2.0, 2.0, 2.0)
    """
    pairs = [(list(a), list(b)) for a, b in zip(a_rounds, b_rounds) if a and b]
    if not pairs:
        return None
    ratio = statistics.median([t for a, _ in pairs for t in a]) / statistics.median([t for _, b in pairs for t in b])
    rng = random.Random(seed)
    out = []
    for _ in range(reps):
        drawn = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        a = [x for r, _ in drawn for x in rng.choices(r, k=len(r))]
        b = [x for _, r in drawn for x in rng.choices(r, k=len(r))]
        out.append(statistics.median(a) / statistics.median(b))
    out.sort()
    lo = out[int((1 - level) / 2 * (reps - 1))]
    hi = out[int((1 + level) / 2 * (reps - 1) + 0.5)]
    return ratio, lo, hi


def check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two checks on :func:`table_rows` (None where the chosen layout did not run):
    strictly on the medians, and chosen / fastest with its paired 95% interval
    (:func:`ratio_interval`, over at least two paired rounds; ``not_distinguishable_from_best``:
    the interval holds 1)."""
    chosen = next((x for x in rows if x["chosen"]), None)
    ok = [x for x in rows if x["measured_s"]]
    if chosen is None or not chosen["measured_s"] or not ok:
        return {"chosen": chosen and chosen["layout"], "within_tolerance": None, "no_slower_than_best": None}
    best = min(ok, key=lambda x: x["measured_s"])
    others = [x for x in ok if x is not chosen]
    # the interval against the fastest, or where the chosen layout is the fastest, the next one
    ref = best if best is not chosen else min(others, key=lambda x: x["measured_s"], default=None)
    steps = lambda x: x.get("measured_steps_by_round") or []  # noqa: E731
    paired = 0 if ref is None else sum(1 for a, b in zip(steps(chosen), steps(ref)) if a and b)
    ci = ratio_interval(steps(chosen), steps(ref)) if paired >= 2 else None
    strict = chosen["measured_s"] <= best["measured_s"]
    return {"chosen": chosen["layout"], "predicted_s": chosen["predicted_s"], "measured_s": chosen["measured_s"],
            "error": chosen["error"], "within_tolerance": abs(chosen["error"]) <= TOLERANCE,
            "fastest": best["layout"], "fastest_s": best["measured_s"],
            "chosen_over_fastest": chosen["measured_s"] / best["measured_s"],
            "no_slower_than_best": strict, "interval_against": None if ci is None else ref["layout"],
            "interval_rounds": paired, "chosen_over_fastest_95": None if ci is None else [ci[1], ci[2]],
            "not_distinguishable_from_best": True if strict else (None if ci is None else ci[1] <= 1.0)}


def _verdict(v: dict[str, Any]) -> str:
    """The checks in words: the strict verdict first, then the one at the measurement's resolution."""
    if v.get("within_tolerance") is None:
        return "the chosen layout did not run: no verdict"
    lines = [f"prediction: {v['error']:+.1%} off ({'within' if v['within_tolerance'] else 'NOT within'} "
             f"{TOLERANCE:.0%})",
             f"strictly: chosen / fastest ({v['fastest']}) = {v['chosen_over_fastest']:.3f}: "
             + ("no slower than the fastest" if v["no_slower_than_best"] else "SLOWER than the fastest")]
    ci = v.get("chosen_over_fastest_95")
    if ci is None:
        lines.append("at this resolution: no interval (fewer than 2 paired rounds)")
    elif v["no_slower_than_best"]:
        lines.append(f"at this resolution: chosen / next fastest ({v['interval_against']}) 95% interval "
                     f"{ci[0]:.3f}-{ci[1]:.3f} (paired bootstrap over {v['interval_rounds']} rounds): "
                     + ("ahead of it" if ci[1] < 1.0 else "not distinguishable from it"))
    else:
        lines.append(f"at this resolution: 95% interval {ci[0]:.3f}-{ci[1]:.3f} (paired bootstrap over "
                     f"{v['interval_rounds']} rounds): "
                     + ("not distinguishable from the fastest" if v["not_distinguishable_from_best"]
                        else "slower than the fastest"))
    return "\n".join(lines)


def _format(rows: list[dict[str, Any]]) -> str:
    head = f"{'layout':34s} {'search':>6s} {'predicted ms':>12s} {'w/o CPU load':>12s} {'measured ms':>11s} " \
           f"{'first pass':>10s} {'error':>7s} {'measured rank':>13s}"
    lines = [head, "-" * len(head)]
    for x in rows:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.1f}"
        lines.append(f"{x['layout'] + (' *' if x['chosen'] else ''):34s} {x['search_rank']!s:>6s} "
                     f"{ms(x['predicted_s']):>12s} {ms(x.get('predicted_without_cpu_load_s')):>12s} "
                     f"{ms(x['measured_s']):>11s} {ms(x['first_pass_s']):>10s} "
                     f"{'-' if x['error'] is None else format(x['error'], '+.1%'):>7s} "
                     f"{x.get('measured_rank', '-')!s:>13s}" + (f"  ERROR {x['run_error'][:60]}" if x['run_error'] else ""))
    return "\n".join(lines)


PROBE_MICROBATCHES = 4
"""The drift probe profiles the microbatch of the batch over this many (64 samples: every choice of
the check's runs so far)."""


def probe_speed(cfg: Any) -> float:
    """The summed forward + backward of every layer at the batch over :data:`PROBE_MICROBATCHES`, profiled as the
    search profiles (``experiments.bench.problem.profile_model``: a fresh single-threaded process,
    ``partitioner.sweeps`` medians): the machine's speed at that moment, for the model at hand."""
    import dataclasses

    from experiments.bench.problem import profile_model
    from experiments.config import as_config

    cfg = as_config(cfg)
    c = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, microbatches=PROBE_MICROBATCHES))
    return sum(x.forward_s + x.backward_s for x in profile_model(c).layers)


def drift(error: float | None, before_s: float, after_s: float) -> dict[str, Any]:
    """How the machine's speed moved between the search's profile and the measurement
    (``drift``: after / before - 1, from :func:`probe_speed`), and the chosen layout's error
    had its prediction moved by as much (``error_drift_scaled``; None without an error). The
    check's verdict stays on the unscaled error: this separates the plan's error from the
    machine's drift, it does not replace it.

    >>> d = drift(0.2, 0.1, 0.12)
    >>> round(d["drift"], 3), round(d["error_drift_scaled"], 3)
    (0.2, 0.0)
    """
    k = after_s / before_s
    return {"drift": k - 1, "probe_before_s": before_s, "probe_after_s": after_s,
            "error_drift_scaled": None if error is None else (1 + error) / k - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=5, help="layouts of the search measured (its best predicted)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per pass (medians pooled)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    ap.add_argument("--tiny", action="store_true", help="a small model, 1 round of 1 step (a smoke run)")
    ap.add_argument("--json", help="write the rows, the checks and the bench's meta here")
    args = ap.parse_args()
    from experiments.bench.run import run_bench
    from experiments.config import compose_config

    tiny = dict(top=2, rounds=1, steps=1, warmup=1) if args.tiny else {}
    kw = {**dict(top=args.top, rounds=args.rounds, steps=args.steps, warmup=args.warmup), **tiny}
    cfg = compose_config(*overrides(tiny=args.tiny, **kw))
    load0 = os.getloadavg()
    before = probe_speed(cfg)
    result = run_bench(cfg)
    after = probe_speed(cfg)
    rows = table_rows(result)
    verdict = check(rows)
    verdict.update(drift(verdict.get("error"), before, after))
    print(f"\nthe search's top {kw['top']}, measured ({kw['rounds']} rounds of {kw['steps']} steps, then again "
          f"head to head; * = chosen; error = measured / predicted - 1):")
    print(_format(rows))
    print("\n" + json.dumps(verdict, indent=1))
    print(_verdict(verdict))
    print(f"drift probe (the model's forward + backward at {int(cfg.train.batch_size) // PROBE_MICROBATCHES} samples, "
          "profiled as the search does): "
          f"{before * 1e3:.1f} ms before the search, {after * 1e3:.1f} ms after the measurement "
          f"({verdict['drift']:+.1%}); the chosen layout's error with its prediction scaled by it: "
          + ("-" if verdict["error_drift_scaled"] is None else f"{verdict['error_drift_scaled']:+.1%}"))
    print(f"load average start {load0[0]:.1f} end {os.getloadavg()[0]:.1f} (2 shared cores: timings under load "
          "measure the neighbours too)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "check": verdict, "overrides": overrides(tiny=args.tiny, **kw),
                       "search": result.get("search"), "meta": result.get("meta")}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
