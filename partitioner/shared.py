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
(``engine.overhead.measure_cpu_costs``'s ``shared`` record: three ranks on two cores, two layers
each, 1F1B, GPipe and ZB-H2 at 4 and 8 microbatches and interleaved 1F1B at 6, so every way the
runtime waits for its sends, ``engine.schedules.send_mode``): the efficiency ``e`` such that the
plan of the same pipeline, with this machine's fixed costs and the layers' times measured alone,
predicts the measured steps on ``e x cores`` cores (a geometric mean over the runs). One figure
for every mode: fitted per mode, the modes differed by less than the held-out check's noise, and
in opposite directions on the generic pipeline and on issue 39's MLP (docs/performance.md). The
planner simulates a pipeline whose ranks outnumber its cores on ``FixedCosts.shared_efficiency x
cores``.

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
from dataclasses import replace
from typing import Any, Mapping

from .costs import FixedCosts, LayerCost, Profile

__all__ = ["fit_shared_efficiency", "shared_pipeline_steps", "EFFICIENCY_RANGE"]

EFFICIENCY_RANGE = (0.3, 1.0)
"""The fitted efficiency is clamped to this range (1.0: the ranks get all of the cores' time)."""


def _profile(rec: Mapping[str, Any], fixed: FixedCosts) -> Profile:
    """The measured pipeline's layers as a profile: each layer's alone times, its fp32 bytes."""
    w, h, size = int(rec["width"]), int(rec["hidden"]), int(rec["size"])
    t = rec["layer"]
    layer = LayerCost(forward_s=float(t["forward_s"]), backward_s=float(t["backward_s"]),
                      input_grad_s=t.get("input_grad_s"), weight_grad_s=t.get("weight_grad_s"), param_bytes=(2 * w * h + w + h) * 4, activation_bytes=(w + 2 * h) * size * 4,
                      output_bytes=w * size * 4)
    n = int(rec["ranks"]) * int(rec["layers_per_rank"])
    return Profile([layer] * n, meta={"what": "engine.overhead shared pipeline"},
                   fixed=replace(fixed, cores=int(rec["cores"]), shared_efficiency=1.0))


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


def _step(plan: Any, efficiency: float) -> float:
    shared = replace(plan, shared_cores=plan.shared_cores * efficiency) if plan.shared_cores else plan
    return shared.predicted_step_s(shared.simulate())


def shared_pipeline_steps(rec: Mapping[str, Any], fixed: FixedCosts, efficiency: float) -> list[float]:
    """Per run of ``rec`` (in order), the step the plan predicts for the measured pipeline when
    its ranks get ``efficiency`` of the cores' time.

    >>> rec = {"ranks": 3, "cores": 2, "layers_per_rank": 2, "size": 8, "width": 16, "hidden": 64,
    ...        "layer": {"forward_s": 1e-3, "backward_s": 2e-3},
    ...        "runs": [{"schedule": "1f1b", "microbatches": 4, "step_s": 0.03}]}
    >>> shared_pipeline_steps(rec, FixedCosts(cores=2), 0.5)[0] > shared_pipeline_steps(rec, FixedCosts(cores=2), 1.0)[0]
    True
    """
    return [_step(plan, efficiency) for plan in _plans(rec, fixed)]


def fit_shared_efficiency(rec: Mapping[str, Any], fixed: FixedCosts, *, tolerance: float = 1e-3) -> float:
    """The efficiency (within :data:`EFFICIENCY_RANGE`) at which the plan predicts ``rec``'s
    measured steps: the mean over its runs of log(predicted / measured) brought to 0 by bisection
    (the prediction grows as the efficiency falls). ``rec``: the ``shared`` record of
    ``engine.overhead.measure_cpu_costs``; ``fixed``: this machine's fixed costs."""
    runs = [(plan, float(run["step_s"])) for plan, run in zip(_plans(rec, fixed), rec["runs"])]

    def excess(e: float) -> float:
        return sum(math.log(_step(plan, e) / measured) for plan, measured in runs) / len(runs)

    lo, hi = EFFICIENCY_RANGE
    if excess(hi) >= 0:
        return hi
    if excess(lo) <= 0:
        return lo
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return (lo + hi) / 2
