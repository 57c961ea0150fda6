"""Per-stage memory model: static state by optimizer/dtype/ZeRO, activations by schedule.

Memory of a stage covering layers ``[s, e)`` at pipeline position ``j``::

    static_factor * param_bytes(s, e)              # weights + grads + optimizer state
    + inflight[j] * (activation_bytes(s, e)        # saved-for-backward, per held microbatch
                     + shared_input_bytes[s])      #   (+ the input copy at a cut, see LayerCost)
    + output_bytes[s-1] + output_bytes[e-1]        # boundary buffers (gradient in / out)

Example::

    from partitioner.memory import static_factor, inflight_per_chunk
    static_factor(4, "adamw", zero_stage=1, data_parallel=4)   # 4+4+8/4 bytes per 4 bytes -> 2.5
    inflight_per_chunk("1f1b", 4, 8)                            # [4, 3, 2, 1]
"""

from __future__ import annotations

from engine.choices import OPTIMIZERS, ZERO_STAGES
from engine.schedules import SCHEDULE_INFO, SCHEDULES, build_schedule, chunk_ranks

__all__ = ["static_factor", "inflight_per_chunk", "inflight_from_schedule", "rank_totals",
           "OPTIMIZER_STATE_BYTES", "SCHEDULES"]

# Optimizer state in bytes per parameter (kept in fp32), for each of engine.choices.OPTIMIZERS.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8, "adam": 8,            # exp_avg + exp_avg_sq
    "sgd": 0,                         # plain SGD
}


def static_factor(itemsize: int, optimizer: str = "adamw", zero_stage: int = 1, data_parallel: int = 1) -> float:
    """Bytes of static state per byte of parameters.

    Weights and gradients are kept in the training dtype (``itemsize`` bytes per element);
    optimizer state in fp32, plus an fp32 master copy when the dtype is narrower than fp32
    (mixed precision). ZeRO stage >= 1 divides optimizer state (and the master copy) by the
    data-parallel degree, stage >= 2 also the gradients.
    """
    opt = optimizer.lower()
    if opt not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZERS)}")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0, 1 or 2 (got {zero_stage}); stage 3 shards weights, "
                         "which a pipeline stage keeps whole")
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    state = OPTIMIZER_STATE_BYTES[opt] + (4 if itemsize < 4 else 0)
    grads = itemsize / (data_parallel if zero_stage >= 2 else 1)
    state = state / (data_parallel if zero_stage >= 1 else 1)
    return (itemsize + grads + state) / itemsize


def _interleaved_forward_order(p: int, m: int, v: int) -> list[int]:
    """Local chunk index of each forward a rank runs, in Megatron's interleaved order."""
    return [(k // p) % v for k in range(m * v)]


def inflight_per_chunk(schedule: str, num_stages: int, microbatches: int, virtual_stages: int = 1,
                       max_inflight: int | None = None) -> list[int]:
    """Microbatches whose activations each chunk holds at its rank's peak (chunk order).

    - gpipe: m on every stage.
    - 1f1b: min(p - j, m).
    - zb-h1: min(p, m) on every stage: a microbatch is held until its W, and H1 caps every
      rank at 1F1B's pipeline peak (its first stage's count), so later ranks hold more than
      under 1F1B while the largest rank does not (the engine's zb-h1 builds exactly this).
    - zb-h2: min(max_inflight, m) on every stage (max_inflight defaults to 2p - 1).
    - interleaved-1f1b: rank r runs min((p - r - 1) * 2 + (v - 1) * p, m * v) warm-up
      forwards (Megatron) and one more before its first backward; each chunk holds the
      forwards of that prefix that belong to it.
    - zbv (V placement, rank r holds chunks r and 2p-1-r): with m >= 2p - 1, rank r peaks at
      2p chunk activations, 2p-1-r of chunk r and r+1 of chunk 2p-1-r; fewer microbatches are
      read from the engine's schedule.
    """
    p, m, v = num_stages, microbatches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_stages, microbatches, virtual_stages must be >= 1 (got {p}, {m}, {v})")
    info = SCHEDULE_INFO[schedule]
    if info.chunks_per_rank is not None and v != info.chunks_per_rank:
        raise ValueError(f"schedule={schedule!r} runs {info.chunks_per_rank} chunk(s) per rank; "
                         f"pass virtual_stages={info.chunks_per_rank} (got {v})")
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(p - j, m) for j in range(p)]
    if schedule == "zb-h1":
        return [min(p, m)] * p
    if schedule == "zb-h2":
        cap = build_schedule(schedule, p, m, max_inflight=max_inflight).max_inflight
        return [min(cap, m)] * p
    if schedule == "zbv":
        if m < 2 * p - 1:
            return inflight_from_schedule(build_schedule(schedule, p, m, v))
        return [2 * p - 1 - c if c < p else 2 * p - c for c in range(2 * p)]
    out = [0] * (p * v)
    order = _interleaved_forward_order(p, m, v)
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        for local in order[: min(warm + 1, m * v)]:
            out[local * p + r] += 1
    return out


def inflight_from_schedule(schedule) -> list[int]:  # noqa: ANN001 - an engine.schedules.Schedule
    """Per chunk, the microbatches it holds when its rank first reaches its peak count, read
    from a schedule's action lists (F adds one; B, or W for split backwards, releases one).
    This is what the engine runs, so the planner prefers it to the closed forms above."""
    k = schedule.num_chunks
    out = [0] * k
    for r, acts in enumerate(schedule.actions):
        held = [0] * k
        best, best_held = 0, [0] * k
        for a in acts:
            if a.kind == "F":
                held[a.stage] += 1
                if sum(held) > best:
                    best, best_held = sum(held), list(held)
            elif a.kind in ("B", "W"):
                held[a.stage] -= 1
        for c in schedule.stages_of(r):
            out[c] = best_held[c]
    return out


def rank_totals(per_chunk: list, schedule: str, num_stages: int, virtual_stages: int = 1) -> list:
    """Sum a per-chunk figure over each rank's chunks (the schedule's placement).

    >>> rank_totals([1, 2, 3, 4], "zbv", 2, 2), rank_totals([1, 2, 3, 4], "interleaved-1f1b", 2, 2)
    ([5, 5], [4, 6])
    """
    out = [0] * num_stages
    for c, r in enumerate(chunk_ranks(schedule, num_stages, virtual_stages)):
        out[r] += per_chunk[c]
    return out
