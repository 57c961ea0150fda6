"""Ranks that outnumber the CPU cores they share: the fraction of the cores' time they get.

The plan time-shares the cores between the computing ranks (``engine.simulate``'s ``cores``: each
of ``k`` computing ranks progresses at ``cores / k``), which assumes that a core never idles while
a rank could run and that a rank computes as fast as its layers did alone. Neither holds on a host
with more ranks than cores: a rank woken by a message waits for a core (the scheduler lets the
running task finish its slice), every switch refills the caches, and gloo's transport threads
need a core to move a message. Measured on this machine's 2 cores, a 3-rank pipeline fed its own
actions' CPU times simulates 14-17% short on every schedule, and one smaller core count fits
them all (docs/performance.md).

:func:`fit_shared_efficiency` fits that fraction on a generic pipeline measured once per machine
(``engine.overhead.measure_cpu_costs``'s ``shared`` records: three ranks on two cores, two layers
each, 1F1B, GPipe and ZB-H2 at 4 and 8 microbatches and interleaved 1F1B at 6, so every way the
runtime waits for its sends, ``engine.schedules.send_mode``): the efficiency ``e`` such that the
plan of the same pipeline, with this machine's fixed costs and the layers' times measured alone,
predicts the measured steps on ``e x cores`` cores (a geometric mean over the runs).

A switch between ranks costs per action, not per unit of compute (the woken rank refills its
caches): an efficiency fitted on large actions overstates what ranks with small ones get. The
pipeline is measured at two microbatch sizes, 48 and 12 samples, and :func:`fit_shared_costs`
fits the efficiency and a cost per compute action together (the pair that predicts both sizes'
runs alike, on average); one size cannot tell them apart. At that cost it fits the efficiency
of each runtime mode apart: the schedules that wait for their sends before each compute (1F1B,
GPipe) get less of the cores than those that wait once per step (the zero-bubble ones), on the
generic pipeline and on issue 39's MLP alike (docs/performance.md). The planner simulates a
pipeline whose ranks outnumber its cores on ``FixedCosts.shared_efficiency_for(mode) x cores``,
each compute action charged ``FixedCosts.shared_action_s`` more.

Example::

    >>> from partitioner.costs import FixedCosts
    >>> rec = {"ranks": 3, "cores": 2, "layers_per_rank": 2, "size": 8, "width": 16, "hidden": 64,
    ...        "layer": {"forward_s": 1e-3, "backward_s": 2e-3},
    ...        "runs": [{"schedule": "1f1b", "microbatches": 4, "step_s": 0.03}]}
    >>> 0.3 <= fit_shared_efficiency(rec, FixedCosts(cores=2)) <= 1.0
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from .costs import FixedCosts, LayerCost, Profile

__all__ = ["fit_shared_efficiency", "fit_shared_costs", "SharedFit", "shared_pipeline_steps", "EFFICIENCY_RANGE",
           "ACTION_RANGE_S"]

EFFICIENCY_RANGE = (0.3, 1.0)
"""The fitted efficiency is clamped to this range (1.0: the ranks get all of the cores' time)."""

ACTION_RANGE_S = (0.0, 4e-3)
"""The per-action cost :func:`fit_shared_costs` searches (seconds): up to about three times what
this machine's shared pipeline fitted (1.2 ms, docs/performance.md)."""


def _profile(rec: Mapping[str, Any], fixed: FixedCosts) -> Profile:
    """The measured pipeline's layers as a profile: each layer's alone times, its fp32 bytes."""
    w, h, size = int(rec["width"]), int(rec["hidden"]), int(rec["size"])
    t = rec["layer"]
    layer = LayerCost(forward_s=float(t["forward_s"]), backward_s=float(t["backward_s"]),
                      input_grad_s=t.get("input_grad_s"), weight_grad_s=t.get("weight_grad_s"), param_bytes=(2 * w * h + w + h) * 4, activation_bytes=(w + 2 * h) * size * 4,
                      output_bytes=w * size * 4)
    n = int(rec["ranks"]) * int(rec["layers_per_rank"])
    return Profile([layer] * n, meta={"what": "engine.overhead shared pipeline"},
                   fixed=replace(fixed, cores=int(rec["cores"]), shared_efficiency=1.0, shared_efficiency_by_mode={},
                                 shared_action_s=0.0))


def _plans(rec: Mapping[str, Any], fixed: FixedCosts) -> list[Any]:
    """Per run of ``rec`` (in order), the plan of the measured pipeline (its ranks' own layers)."""
    from .planner import partition

    prof = _profile(rec, fixed)
    n, p = len(prof), int(rec["ranks"])
    out = []
    for run in rec["runs"]:
        v = int(run.get("virtual_stages", 1))
        plan = partition(prof, p, schedule=str(run["schedule"]), microbatches=int(run["microbatches"]), virtual_stages=v,
                         optimizer="sgd", method="uniform", precision="fp32", grad_clip=False)
        if [tuple(r) for r in plan.stage_ranges] != [(k * n // (p * v), (k + 1) * n // (p * v)) for k in range(p * v)]:
            raise ValueError(f"the shared pipeline's plan split {plan.stage_ranges}, not its ranks' layers")
        out.append(plan)
    return out


def _step(plan: Any, efficiency: float, action_s: float = 0.0) -> float:
    shared = replace(plan, shared_cores=plan.shared_cores * efficiency, action_s=plan.action_s + action_s) \
        if plan.shared_cores else plan
    return shared.predicted_step_s(shared.simulate())


def _mode(plan: Any) -> str:
    """The runtime mode of a plan's schedule (``engine.schedules.send_mode``)."""
    from engine.schedules import send_mode

    return send_mode(plan.build_schedule())


def shared_pipeline_steps(rec: Mapping[str, Any], fixed: FixedCosts, efficiency: float | Mapping[str, float],
                          action_s: float = 0.0) -> list[float]:
    """Per run of ``rec`` (in order), the step the plan predicts for the measured pipeline when
    its ranks get ``efficiency`` of the cores' time (a mapping: per runtime mode,
    ``SharedFit.by_mode``) and each compute action costs ``action_s`` more
    (``FixedCosts.shared_action_s``).

    >>> rec = {"ranks": 3, "cores": 2, "layers_per_rank": 2, "size": 8, "width": 16, "hidden": 64,
    ...        "layer": {"forward_s": 1e-3, "backward_s": 2e-3},
    ...        "runs": [{"schedule": "1f1b", "microbatches": 4, "step_s": 0.03}]}
    >>> shared_pipeline_steps(rec, FixedCosts(cores=2), 0.5)[0] > shared_pipeline_steps(rec, FixedCosts(cores=2), 1.0)[0]
    True
    """
    plans = _plans(rec, fixed)
    if isinstance(efficiency, Mapping):
        return [_step(plan, float(efficiency[_mode(plan)]), action_s) for plan in plans]
    return [_step(plan, efficiency, action_s) for plan in plans]


def _records(recs: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record (a mapping) or several as a list."""
    return [recs] if isinstance(recs, Mapping) else list(recs)


def _runs(recs: Mapping[str, Any] | Sequence[Mapping[str, Any]], fixed: FixedCosts) -> list[tuple[Any, float]]:
    """Every run of every record: (its plan, its measured step)."""
    return [(plan, float(run["step_s"])) for rec in _records(recs)
            for plan, run in zip(_plans(rec, fixed), rec["runs"])]


def _fit_efficiency(runs: list[tuple[Any, float]], action_s: float, tolerance: float) -> float:
    """The efficiency within :data:`EFFICIENCY_RANGE` that brings the runs' mean log(predicted /
    measured) to 0 (bisection: the prediction grows as the efficiency falls)."""
    def excess(e: float) -> float:
        return sum(_errors(runs, e, action_s)) / len(runs)

    lo, hi = EFFICIENCY_RANGE
    if excess(hi) >= 0:
        return hi
    if excess(lo) <= 0:
        return lo
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def fit_shared_efficiency(rec: Mapping[str, Any] | Sequence[Mapping[str, Any]], fixed: FixedCosts, *,
                          action_s: float = 0.0, tolerance: float = 1e-3) -> float:
    """The efficiency (within :data:`EFFICIENCY_RANGE`) at which the plan predicts ``rec``'s
    measured steps, each compute action charged ``action_s`` more: the mean over its runs of
    log(predicted / measured) brought to 0 by bisection. ``rec``: the ``shared`` record of
    ``engine.overhead.measure_cpu_costs`` (or a list of them, e.g. one per microbatch size);
    ``fixed``: this machine's fixed costs."""
    return _fit_efficiency(_runs(rec, fixed), action_s, tolerance)


@dataclass(frozen=True)
class SharedFit:
    """What :func:`fit_shared_costs` fitted: ``efficiency`` over every run
    (``FixedCosts.shared_efficiency``), ``by_mode`` the same per runtime mode
    (``FixedCosts.shared_efficiency_by_mode``), ``action_s`` (``FixedCosts.shared_action_s``) and
    ``rms_log_error``, the root mean square over the runs of log(predicted / measured) under
    ``by_mode`` and ``action_s``."""

    efficiency: float
    action_s: float
    rms_log_error: float
    by_mode: dict[str, float] = field(default_factory=dict)


def _errors(runs: list[tuple[Any, float]], efficiency: float, action_s: float) -> list[float]:
    """Per run, log(predicted / measured)."""
    return [math.log(_step(plan, efficiency, action_s) / measured) for plan, measured in runs]


def fit_shared_costs(recs: Mapping[str, Any] | Sequence[Mapping[str, Any]], fixed: FixedCosts, *,
                     max_action_s: float = ACTION_RANGE_S[1], tolerance: float = 1e-3) -> SharedFit:
    """The efficiency and the per-action cost that ranks outnumbering their cores pay, fitted
    together on the shared pipeline measured at two or more microbatch sizes (``recs``: the
    ``shared`` records of ``engine.overhead.measure_cpu_costs``). For a per-action cost in
    ``[0, max_action_s]``, the efficiency of :func:`fit_shared_efficiency` over every run; the
    cost is the one at which each size's runs are predicted as well as the others' (the sizes'
    mean log errors closest to each other: a grid, then a golden section around its best point).
    Each size's mean is over the same schedules, so a schedule the plan favours weighs the same
    at every size and only the actions' size tells the two apart; one size cannot (a longer step
    is either). A cost per action weighs four times as much at a quarter of the samples. At that
    cost, ``SharedFit.by_mode`` is the efficiency fitted on each runtime mode's runs apart
    (``engine.schedules.send_mode`` of the run's schedule).

    >>> rec = {"ranks": 3, "cores": 2, "layers_per_rank": 2, "size": 8, "width": 16, "hidden": 64,
    ...        "layer": {"forward_s": 1e-3, "backward_s": 2e-3},
    ...        "runs": [{"schedule": "1f1b", "microbatches": 4, "step_s": 0.03}]}
    >>> fit_shared_costs([rec], FixedCosts(cores=2)).efficiency <= 1.0
    True
    """
    groups = [_runs(rec, fixed) for rec in _records(recs)]
    runs = [run for group in groups for run in group]

    def spread(a: float) -> float:   # how far apart the sizes' mean log errors are at this cost
        e = _fit_efficiency(runs, a, tolerance)
        means = [sum(_errors(group, e, a)) / len(group) for group in groups]
        return max(means) - min(means)

    grid = [max_action_s * k / 16 for k in range(17)]
    best = min(range(len(grid)), key=lambda k: spread(grid[k]))
    a = _golden_min(spread, grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)], max_action_s * 1e-3)
    modes: dict[str, list[tuple[Any, float]]] = {}
    for run in runs:
        modes.setdefault(_mode(run[0]), []).append(run)
    by_mode = {mode: _fit_efficiency(group, a, tolerance) for mode, group in sorted(modes.items())}
    errors = [x for mode, group in modes.items() for x in _errors(group, by_mode[mode], a)]
    return SharedFit(efficiency=_fit_efficiency(runs, a, tolerance), action_s=a,
                     rms_log_error=math.sqrt(sum(x * x for x in errors) / len(errors)), by_mode=by_mode)


def _golden_min(f: Any, lo: float, hi: float, tolerance: float) -> float:
    """The minimum of a unimodal ``f`` on ``[lo, hi]`` by golden section, one new evaluation per
    step (the inner point kept is the next step's other)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = f(a), f(b)
    while hi - lo > tolerance:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = f(b)
    return (lo + hi) / 2
