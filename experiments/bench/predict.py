"""Predictions from pipeshard's partitioner, calibrated, and their errors against measurements.

Chain: a measured per-layer profile (``experiments.bench.problem.profile_model``) ->
:func:`calibrate` (optional: one factor on every layer time so that ``m`` microbatches of
forward + backward through all layers take what the single-process run measured; it absorbs
what isolated layer timings miss: the optimizer step, cache effects and machine load at run
time; with the single process's split step, the measured I and W get a factor of their own) ->
``partitioner.partition`` (which predicts the step with ``engine.simulate`` on the
per-stage costs, transfers at the measured link speed) -> compared with the measured row.

Example::

    cal, k = calibrate(profile, single_step_s=0.8, microbatches=8)
    plan = plan_for(cal, 2, "1f1b", 8, link_bytes_per_s=2e9)
    errs = prediction_fields(plan, row)   # predicted_step_s, step_error, activation ...
"""

from __future__ import annotations

from typing import Any

__all__ = ["calibrate", "plan_for", "prediction_fields", "relative_error"]


def calibrate(profile: Any, single_step_s: float, microbatches: int,
              optimizer: str = "sgd", split_step_s: float | None = None) -> tuple[Any, float]:
    """``(profile with every time x k, k)`` with ``k = (single_step_s - update) / (m x sum(f +
    b))``, ``update`` the optimizer's step over every parameter when the profile carries fixed
    costs (``partitioner.FixedCosts``), else 0.

    With ``split_step_s`` (the same step with the backward split into I and W, the single
    process's ``"loaded-split"`` mode), the layers whose split was measured get their I and W
    scaled by their own factor instead, so that the split step is matched too (the profile's
    meta says it: ``split_calibration_factor``)."""
    from partitioner import Profile

    total = microbatches * sum(c.forward_s + c.backward_s for c in profile.layers)
    update = 0.0
    if profile.fixed is not None:
        update = profile.fixed.optimizer_s(optimizer, sum(c.param_bytes for c in profile.layers))
    if total <= 0 or single_step_s <= update:
        return profile, 1.0
    k = (single_step_s - update) / total
    layers = [c.times_scaled(k) for c in profile.layers]
    meta = dict(profile.meta, calibrated=True, calibration_factor=k,
                calibration="layer times x k so that m x sum(f + b) = the measured single-process step")
    ks = _split_factor(layers, split_step_s - update, microbatches) if split_step_s else None
    if ks is not None:
        layers = [_split_scaled(c, ks) for c in layers]
        meta.update(split_calibration_factor=ks * k,
                    split_calibration="I and W x the split factor so that the split step matches too")
    return Profile(layers, dtype=profile.dtype, meta=meta, fixed=profile.fixed), k


def _split_factor(layers: list, split_s: float, m: int) -> float | None:
    """The factor on the (already calibrated) I and W of the layers whose split was measured that
    makes ``m`` microbatches of F, I and W (whole backward elsewhere) take ``split_s``."""
    split = sum(c.input_grad_s + c.weight_grad_s for c in layers if c.input_grad_s is not None)
    rest = sum(c.forward_s + (c.backward_s if c.input_grad_s is None else 0.0) for c in layers)
    if split <= 0 or split_s <= m * rest:
        return None
    return (split_s - m * rest) / (m * split)


def _split_scaled(c: Any, ks: float) -> Any:
    import dataclasses

    if c.input_grad_s is None:
        return c
    return dataclasses.replace(c, input_grad_s=c.input_grad_s * ks, weight_grad_s=c.weight_grad_s * ks)


def plan_for(profile: Any, num_stages: int, schedule: str, microbatches: int, *,
             virtual_stages: int = 1, method: str = "optimal",
             link_bytes_per_s: float | None = None, calibration: float | None = None) -> Any:
    """``partitioner.partition`` as the bench runs it (plain SGD, no ZeRO); notes the calibration."""
    import partitioner

    plan = partitioner.partition(profile, num_stages, schedule=schedule, microbatches=microbatches,
                                 virtual_stages=virtual_stages, method=method, optimizer="sgd",
                                 zero_stage=0, link_bytes_per_s=link_bytes_per_s)
    if calibration is not None:
        plan.notes.append(f"calibrated: layer times x {calibration:.3f} from the measured "
                          "single-process step (experiments.bench.predict.calibrate)")
    return plan


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """``predicted / measured - 1`` (None when either is missing)."""
    if not predicted or not measured:
        return None
    return predicted / measured - 1.0


def prediction_fields(plan: Any, row: dict[str, Any], raw_plan: Any = None) -> dict[str, Any]:
    """Prediction fields for a pipeshard row: step time and per-rank activation bytes, predicted
    (from ``plan``) next to measured (the row's ``step_s`` and engine stats), with errors."""
    p = plan.num_stages
    pred_act = [int(x) for x in plan.per_rank(plan.stage_activation_bytes)]
    stats = row.get("stats") or []
    meas_act = [int(s.get("peak_activation_bytes", 0)) for s in stats] if stats else None
    act_err = None
    if meas_act and len(meas_act) == p:
        act_err = [relative_error(a, b) for a, b in zip(pred_act, meas_act)]
    out = {
        "predicted_step_s": plan.step_s,
        "step_error": relative_error(plan.step_s, row.get("step_s")),
        "predicted_bubble": plan.bubble_fraction,
        "predicted_activation_bytes": pred_act,
        "measured_activation_bytes": meas_act,
        "activation_error": act_err,
        "plan_stage_ranges": [list(r) for r in plan.stage_ranges],
    }
    if raw_plan is not None:
        out["predicted_step_uncalibrated_s"] = raw_plan.step_s
        out["step_error_uncalibrated"] = relative_error(raw_plan.step_s, row.get("step_s"))
    return out
