"""``partition``: profile in, :class:`~partitioner.plan.Plan` out.

Example::

    from partitioner import LayerCost, Profile, partition
    prof = Profile([LayerCost(1e-3, 2e-3, 4 << 20, 8 << 20, 1 << 20)] * 16)
    plan = partition(prof, 4, microbatches=8, memory_limit_bytes=200 << 20)
    print(plan.summary())

How it decides (``method="optimal"``): the exact min-bottleneck contiguous split
(:func:`partitioner.solve.optimal_split`) where a stage's time is forward + backward (+ one
more forward when it recomputes) + twice its outgoing boundary transfer (activation forward,
gradient back) when ``link_bytes_per_s`` is given, and a stage's memory is its static state
plus in-flight activations for the schedule plus boundary buffers (see ``memory.py``). The
plan's ``step_s`` and ``bubble_fraction`` then come from ``engine.simulate`` on the same
costs. For ``virtual_stages > 1`` with loop placement (interleaved-1f1b) the search runs over
the ``p * v`` chunks: it is exact for the largest chunk time under the per-chunk limit ``rank
limit / v``, a sufficient condition for the rank to fit (a split that fits only by giving one
chunk of a rank more than 1/v of its memory is not found); the reported rank memory is the
exact sum of its chunks. For the V placement (zbv, rank r holds chunks r and 2p-1-r) the
search is exact for the rank's time and memory, each the sum of its two chunks
(:func:`partitioner.vsplit.optimal_v_split`). Which rank runs which chunk comes from
``engine.schedules`` (``chunk_ranks``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .costs import Profile
from engine.schedules import SCHEDULE_INFO, chunk_ranks

from .memory import SCHEDULES, inflight_from_schedule, inflight_per_chunk, rank_totals, static_factor
from .plan import PartitionError, Plan
from .solve import (Infeasible, fits_any, greedy_split, min_memory_scale, optimal_split, parameter_split,
                    pipeline_lower_bound, split_costs, uniform_split)
from .vsplit import min_v_memory_scale, optimal_v_split

__all__ = ["partition", "METHODS"]

METHODS: tuple[str, ...] = ("optimal", "uniform", "parameters", "greedy")


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


def partition(profile: Profile, num_stages: int, *, schedule: str = "1f1b", microbatches: int,
              virtual_stages: int = 1, data_parallel: int = 1, zero_stage: int = 1, optimizer: str = "adamw",
              memory_limit_bytes: "float | Sequence[float] | None" = None, method: str = "optimal",
              link_bytes_per_s: float | None = None, activation_checkpointing: "bool | str" = False,
              simulate: bool = True, max_inflight: int | None = None) -> Plan:
    """Split ``profile`` into ``num_stages`` pipeline stages (see the module docstring).

    ``memory_limit_bytes``: one number for every rank, or one per rank. ``method``: "optimal"
    or a baseline ("uniform", "parameters", "greedy"; baselines ignore the limits when
    choosing, and the plan reports whether each rank fits). ``activation_checkpointing``:
    False, True (every stage recomputes) or "auto" (a stage recomputes only where the exact
    search needs it to fit). ``max_inflight``: zb-h2's bound on the microbatches a rank holds
    (its memory knob). Raises :class:`PartitionError` when no split fits, naming the smallest
    limit (or the stage count) that would.
    """
    p, m, v = int(num_stages), int(microbatches), int(virtual_stages)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if schedule == "interleaved-1f1b" and v < 2:
        raise ValueError("interleaved-1f1b needs virtual_stages >= 2; use schedule='1f1b' for one chunk per rank")
    info = SCHEDULE_INFO[schedule]
    if info.chunks_per_rank is not None and v != info.chunks_per_rank:
        raise ValueError(f"schedule={schedule!r} runs {info.chunks_per_rank} chunk(s) per rank; pass "
                         f"virtual_stages={info.chunks_per_rank} (got {v})")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_stages, microbatches and virtual_stages must be >= 1 (got {p}, {m}, {v})")
    if link_bytes_per_s is not None and link_bytes_per_s <= 0:
        raise ValueError("link_bytes_per_s must be > 0 (or None for free transfers)")
    ckpt = {False: "off", True: "on", "off": "off", "on": "on", "auto": "auto"}.get(activation_checkpointing)
    if ckpt is None:
        raise ValueError(f"activation_checkpointing must be False, True or 'auto', got {activation_checkpointing!r}")
    n = len(profile)
    k = p * v
    if k > n:
        most = n // v
        raise PartitionError(
            f"{p} stages x {v} chunks need at least {k} layers but the profile has {n}; "
            f"use at most {most} stages" + (f" (or fewer virtual stages)" if v > 1 else "")
            + f": the model has {n} layers")

    L = profile.layers
    f = np.array([c.forward_s for c in L])
    b = np.array([c.backward_s for c in L])
    w = np.array([c.weight_s for c in L])
    sf = static_factor(profile.itemsize, optimizer, zero_stage, data_parallel)
    static = np.array([c.param_bytes for c in L], dtype=np.float64) * sf
    act = np.array([c.activation_bytes for c in L], dtype=np.float64)
    out = np.array([c.output_bytes for c in L], dtype=np.float64)
    shared = np.array([c.shared_input_bytes for c in L], dtype=np.float64)
    comm_layer = out / link_bytes_per_s if link_bytes_per_s else np.zeros(n)
    cut_time = np.concatenate([[0.0], 2 * comm_layer[:-1], [0.0]])
    inflight = inflight_per_chunk(schedule, p, m, v, max_inflight=max_inflight)
    ranks = chunk_ranks(schedule, p, v)
    vee = info.placement == "v"
    inflight_src = "closed form"
    if simulate:
        try:
            from engine.schedules import build_schedule
        except ImportError:
            pass
        else:  # what the engine will run
            inflight = inflight_from_schedule(build_schedule(schedule, p, m, v, max_inflight=max_inflight))
            inflight_src = "engine schedule"

    rank_caps: list[float] | None
    if memory_limit_bytes is None:
        rank_caps = None
    elif np.ndim(memory_limit_bytes) == 0:
        rank_caps = [float(memory_limit_bytes)] * p
    else:
        rank_caps = [float(x) for x in memory_limit_bytes]  # type: ignore[union-attr]
        if len(rank_caps) != p:
            raise ValueError(f"memory_limit_bytes has {len(rank_caps)} entries; give one number or {p} (one per rank)")
    if rank_caps is not None and min(rank_caps) <= 0:
        raise ValueError("memory_limit_bytes must be > 0")
    chunk_caps = None if rank_caps is None else [rank_caps[ranks[c]] / v for c in range(k)]
    notes: list[str] = [f"in-flight microbatches per stage {inflight} (from the {inflight_src})"]
    common = dict(static=static, act=act, out=out, inflight=inflight, shared=shared)

    recompute = [ckpt == "on"] * k
    if method == "optimal":
        try:
            if vee:   # exact on ranks: each rank's time and memory sum its two chunks
                bounds, _, var = optimal_v_split(f + b, p, caps=rank_caps, cut_time=cut_time, recompute_time=f,
                                                 checkpointing=ckpt, return_variants=True, **common)
            else:
                bounds, _, var = optimal_split(f + b, k, caps=chunk_caps, cut_time=cut_time, recompute_time=f,
                                               checkpointing=ckpt, return_variants=True, **common)
        except Infeasible as e:
            raise PartitionError(_infeasible_message(e, n, p, v, rank_caps, chunk_caps, ckpt, f, schedule, m,
                                                     common, max_inflight)) from None
        if ckpt == "auto":
            recompute = [bool(x) for x in var]
        notes.append("optimal: exact min-bottleneck contiguous split"
                     + (" under the memory limits" if rank_caps else " (no memory limit given)")
                     + ("; among equal bottlenecks, the smallest sum of stage times" if link_bytes_per_s or ckpt == "auto"
                        else "; among equal bottlenecks, later stages take as many layers as allowed"))
        if vee:
            notes.append("zbv: exact over ranks (V placement: rank r holds chunks r and 2p-1-r; the largest rank "
                         "time under each rank's limit)")
        elif v > 1 and rank_caps:
            notes.append(f"interleaved: each chunk limited to rank limit / {v} (sufficient, not necessary, for the rank to fit)")
    else:
        if method == "uniform":
            bounds = uniform_split(n, k)
        elif method == "parameters":
            bounds = parameter_split(static, k)
        else:
            bounds = greedy_split(f + b, k)
        notes.append({"uniform": "uniform: equal layer counts (Megatron); memory limits not used to choose",
                      "parameters": "parameters: balanced parameter bytes (DeepSpeed's default); memory limits not used to choose",
                      "greedy": "greedy: torchgpipe block-partition local search on time; memory limits not used to choose"}[method])
        if ckpt == "auto" and chunk_caps is not None:
            _, mem_plain = split_costs(bounds, time=f + b, cut_time=cut_time, **common)
            recompute = [bool(mem_plain[c] > chunk_caps[c]) for c in range(k)]
    if any(recompute):
        idx = [c for c in range(k) if recompute[c]]
        notes.append(f"activation checkpointing on stage(s) {idx}"
                     + (": their activations would not fit otherwise" if ckpt == "auto" else " (requested)"))
    elif ckpt == "auto":
        notes.append("activation checkpointing not needed: every stage fits without recomputation")

    t_stage, mem_stage = split_costs(bounds, time=f + b, cut_time=cut_time, recompute_time=f, recompute=recompute,
                                     **common)
    s_idx = [a for a, _ in bounds]
    e_idx = [e for _, e in bounds]
    sum_of = lambda arr: [float(arr[a:e].sum()) for a, e in bounds]  # noqa: E731
    f_c, b_c, w_c = sum_of(f), sum_of(b), sum_of(w)
    b_c = [bb + (ff if r else 0.0) for bb, ff, r in zip(b_c, f_c, recompute)]
    act_c = [inflight[c] * (act[s_idx[c]:e_idx[c]].sum() + (shared[s_idx[c]] if s_idx[c] > 0 else 0.0))
             if not recompute[c]
             else inflight[c] * (out[s_idx[c] - 1] if s_idx[c] > 0 else 0.0) + act[s_idx[c]:e_idx[c]].sum()
             for c in range(k)]
    comm_b = [float(comm_layer[e - 1]) for e in e_idx[:-1]]
    rank_mem = [float(x) for x in rank_totals(list(mem_stage), schedule, p, v)]
    rank_fits = [True] * p if rank_caps is None else [rank_mem[r] <= rank_caps[r] * (1 + 1e-12) for r in range(p)]

    # closed form: sum of stage work + (m - 1) * bottleneck (exact for gpipe / 1f1b with
    # equal stages; for other schedules only a fallback when the simulator is not used)
    closed = float(sum(f_c) + sum(b_c) + 2 * sum(comm_b) + (m - 1) * float(np.max(t_stage)))
    step, bubble, predicted_by = closed, 0.0, "closed form"
    if simulate:
        try:
            from engine.schedules import build_schedule
            from engine.simulate import simulate as _simulate
        except ImportError as e:  # the engine is optional for the partitioner
            notes.append(f"engine.simulate unavailable ({e}); step from the closed form")
        else:
            sched = build_schedule(schedule, p, m, v, max_inflight=max_inflight)
            res = _simulate(sched, forward_s=f_c, backward_s=b_c, weight_s=[min(x, y) for x, y in zip(w_c, b_c)],
                            comm_s=comm_b if k > 1 else 0.0)
            step, bubble, predicted_by = res.step_s, res.bubble_fraction, "engine.simulate"
            if res.peak_inflight != rank_totals(inflight, schedule, p, v):  # pragma: no cover
                notes.append(f"warning: simulator's peak in-flight {res.peak_inflight} differs from the memory model "
                             f"{rank_totals(inflight, schedule, p, v)}")

    total = float((f + b).sum())
    lb_b = max(float((f + b).max()), total / k)
    if info.chunks_per_rank == 1:
        lower = pipeline_lower_bound(f + b, k, m, carried=f if info.splits_backward else None)
    else:
        lower = max(m * max(float((f + b).max()), total / p), total)
    if rank_caps is not None and not all(rank_fits):
        bad = [r for r in range(p) if not rank_fits[r]]
        notes.append(f"does NOT fit on rank(s) {bad}: predicted {[_gib(rank_mem[r]) for r in bad]} "
                     f"> limit {[_gib(rank_caps[r]) for r in bad]}")
    return Plan(
        stage_ranges=[(int(a), int(e)) for a, e in bounds], stage_time_s=[float(x) for x in t_stage],
        stage_memory_bytes=[int(math.ceil(x)) for x in mem_stage], bottleneck_s=float(np.max(t_stage)),
        step_s=float(step), bubble_fraction=float(bubble), lower_bound_s=float(lower), schedule=schedule,
        num_stages=p, microbatches=m, virtual_stages=v, data_parallel=data_parallel, zero_stage=zero_stage,
        optimizer=optimizer, method=method, fits=all(rank_fits),
        memory_limit_bytes=None if rank_caps is None else [int(x) for x in rank_caps],
        link_bytes_per_s=link_bytes_per_s, bottleneck_lower_bound_s=lb_b, closed_form_step_s=closed,
        predicted_by=predicted_by, stage_activation_bytes=[int(math.ceil(x)) for x in act_c],
        stage_inflight=list(inflight), stage_recompute=list(recompute), stage_forward_s=f_c, stage_backward_s=b_c,
        stage_weight_s=w_c, boundary_comm_s=comm_b, rank_memory_bytes=[int(math.ceil(x)) for x in rank_mem],
        rank_fits=rank_fits, layer_names=[c.name for c in L], notes=notes,
    )


def _infeasible_message(err: Exception, n: int, p: int, v: int, rank_caps, chunk_caps, ckpt: str, f, schedule: str,
                        m: int, common: dict[str, Any], max_inflight: int | None = None) -> str:
    k = p * v
    if chunk_caps is None:
        return str(err)
    if SCHEDULE_INFO[schedule].placement == "v":
        return _infeasible_v_message(n, p, rank_caps, ckpt, f, schedule, m, common)
    scalar = len(set(rank_caps)) == 1
    if scalar:
        need, _ = min_memory_scale(k, n, recompute_time=f, checkpointing=ckpt, **common)
        need_rank = math.ceil(need * v)
        msg = (f"no split of {n} layers into {p} stages fits {int(rank_caps[0])} bytes ({_gib(rank_caps[0])}) per rank "
               f"with {schedule}, m={m}; the smallest memory_limit_bytes that works is {need_rank} "
               f"({_gib(need_rank)})")
        if v > 1:
            msg += f" (with each chunk held to the rank limit / {v})"
        # more stages lower the per-stage memory; find the first count that fits
        for p2 in range(p + 1, min(n // v, 4 * p) + 1):
            inf2 = inflight_per_chunk(schedule, p2, m, v)
            if fits_any(p2 * v, n, static=common["static"], act=common["act"], out=common["out"], inflight=inf2,
                        shared=common["shared"], caps=rank_caps[0] / v, recompute_time=f, checkpointing=ckpt):
                msg += f", or use {p2} stages"
                break
    else:
        scale, _ = min_memory_scale(k, n, caps=chunk_caps, recompute_time=f, checkpointing=ckpt, **common)
        need = [math.ceil(c * scale) for c in rank_caps]
        msg = (f"no split of {n} layers into {p} stages fits the per-rank limits {[int(c) for c in rank_caps]}; "
               f"scaling them by {scale:.4f} works: memory_limit_bytes={need}")
    if ckpt == "off" and fits_any(k, n, caps=chunk_caps, recompute_time=f, checkpointing="auto", **common):
        msg += "; activation_checkpointing='auto' would also fit"
    return msg


def _infeasible_v_message(n: int, p: int, rank_caps, ckpt: str, f, schedule: str, m: int,
                          common: dict[str, Any]) -> str:
    """The smallest limit that fits a V split (each rank: the sum of its two chunks)."""
    scalar = len(set(rank_caps)) == 1
    base = None if scalar else rank_caps
    scale, _ = min_v_memory_scale(n, p, caps=base, recompute_time=f, checkpointing=ckpt, **common)
    if scalar:
        need = math.ceil(scale)
        return (f"no V split of {n} layers over {p} ranks ({2 * p} chunks) fits {int(rank_caps[0])} bytes "
                f"({_gib(rank_caps[0])}) per rank with {schedule}, m={m}; the smallest memory_limit_bytes that "
                f"works is {need} ({_gib(need)})")
    need = [math.ceil(c * scale) for c in rank_caps]
    return (f"no V split of {n} layers over {p} ranks fits the per-rank limits {[int(c) for c in rank_caps]}; "
            f"scaling them by {scale:.4f} works: memory_limit_bytes={need}")
