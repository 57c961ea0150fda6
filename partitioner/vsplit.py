"""Exact split of ``2p`` chunks placed in a V (zbv): rank r holds chunk r and chunk 2p-1-r.

The layers are cut into ``2p`` contiguous chunks ``[b_0, b_1), ..., [b_{2p-1}, b_{2p})``;
rank r runs chunk r (left arm) and chunk 2p-1-r (right arm), so its time is the sum of the
two chunks' times and its memory the sum of their memories (each chunk costed as in
:mod:`partitioner.feasible`, with its own in-flight count; given the rank's schedule states,
``(held, pending)`` per chunk, the largest such sum over them: which state is the peak depends
on the split). The last rank's two chunks are
adjacent (the turn of the V): the hand-off between them stays on the rank, so its transfer
time is not charged. :func:`optimal_v_split` minimises the largest rank time subject to each
rank's memory cap, exactly, by dynamic programming over the two open ends of the V: after
ranks ``0..r-1`` the state is ``(a, c)`` = (end of the left arm, start of the right arm), its
value the smallest possible largest rank time so far. Cost O(p n^4 / 4) numpy work: fine to a
few hundred layers (the planner's models are split per block, not per operator, for zbv).

Example::

    import numpy as np
    from partitioner.vsplit import optimal_v_split
    bounds, b = optimal_v_split(np.array([1., 1, 1, 1, 4, 1]), 2)
    # rank 0: chunks 0 and 3; rank 1: chunks 1 and 2. bounds == [(0, 1), (1, 4), (4, 5), (5, 6)]
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .feasible import Infeasible, Problem, mem_tol

__all__ = ["optimal_v_split", "min_v_memory_scale", "v_split_costs"]


States = Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]]


def _coefs(P: Problem, name: str, al, be, ga, j: int, count: tuple[int, int] | None
           ) -> tuple[float, float, float, float]:
    """Chunk j's (alpha, beta, gamma, delta) in variant ``name``; ``count`` = (held, pending)
    overrides the problem's in-flight and pending counts (``feasible.Problem``'s variants)."""
    if count is None:
        a, d = P.coefs(name, al, j)
        return a, float(be[j]), float(ga[j]), d
    held, pending = count
    if name == "recompute":
        return (float(held), 1.0, 0.0, 0.0) if P.layer_recompute else (1.0, held + 1.0, 0.0, 0.0)
    return float(held), 1.0, float(held), float(pending)


def _chunk_tables(P: Problem, j: int, local_end: bool = False, counts: list | None = None
                  ) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """Per variant, (time, memories) of chunk ``j`` on ``[s, e)`` as (n+1, n+1) matrices indexed
    [s, e] (inf where s >= e): one memory per (held, pending) state of ``counts`` (None: the
    problem's own counts). ``local_end``: the chunk's outgoing hand-off is on its rank."""
    n = P.n
    s = np.arange(n + 1)[:, None]
    e = np.arange(n + 1)[None, :]
    bad = s >= e
    out = []
    for name, PT, EC, al, be, ga in P.variants:
        end = P.end_cost(EC, j) - P.cut_of(j) if local_end else P.end_cost(EC, j)
        t = end[e] - PT[s]
        ms = []
        for count in counts or [None]:
            a, b, g, d = _coefs(P, name, al, be, ga, j, count)
            PA = P.prefix(name)
            m = (P.PS[e] - P.PS[s] + a * (PA[e] - PA[s]) + d * (P.PG[e] - P.PG[s]) + b * P.inbuf[s]
                 + g * P.shared[s] + P.outbuf[e])
            ms.append(np.where(bad, np.inf, m))
        out.append((np.where(bad, np.inf, t), ms))
    return out


def _counts(states: States | None, p: int, j: int) -> list | None:
    """Chunk j's (held, pending) in each state of its rank (rank r: chunks r and 2p-1-r)."""
    if states is None:
        return None
    r, side = (j, 0) if j < p else (2 * p - 1 - j, 1)
    return [(held[side], pending[side]) for held, pending in states[r]]


def _pair(ml: list[np.ndarray], mr: list[np.ndarray]) -> np.ndarray:
    """A rank's memory: the largest over its states of its two chunks' sum (broadcast)."""
    out = ml[0] + mr[0]
    for x, y in zip(ml[1:], mr[1:]):
        out = np.maximum(out, x + y)
    return out


def _weighted(w: tuple[float, float], t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """w_t * t + w_m * m, leaving out a zero-weight term (its infinities stay infinite)."""
    if w[1] == 0.0:
        return w[0] * t
    if w[0] == 0.0:
        return w[1] * m
    return w[0] * t + w[1] * m


def _level(best: np.ndarray, left, right, cap: float | None, room: int, weight: tuple[float, float]):
    """One rank of the arms: new[a', c'] = min over (a, c) of max(best[a, c], pair objective)
    with the left chunk [a, a') and right chunk [c', c), subject to the pair memory <= cap.
    ``weight``: the objective is w_t * time + w_m * memory. Returns (new, arg[a', c'] =
    (a, c, left variant, right variant))."""
    N = best.shape[0]
    new = np.full((N, N), np.inf)
    arg = np.full((N, N, 4), -1, dtype=np.int64)
    idx = np.arange(N)
    for a in range(N):
        cs = np.nonzero(np.isfinite(best[a]))[0]
        if cs.size == 0:
            continue
        ap = idx[a + 1:]
        for vl, (tl, ml) in enumerate(left):
            for vr, (tr, mr) in enumerate(right):
                pm = (_pair([x[a, ap][:, None, None] for x in ml], [y[:, cs][None] for y in mr])
                      if cap is not None or weight[1] else None)
                obj = _weighted(weight, tl[a, ap][:, None, None] + tr[:, cs][None], pm)
                val = np.maximum(obj, best[a, cs][None, None, :])
                ok = (idx[None, :, None] >= ap[:, None, None] + room) & np.isfinite(val)
                if cap is not None:
                    ok &= pm <= cap + mem_tol(cap)
                val = np.where(ok, val, np.inf)
                k = np.argmin(val, axis=2)
                v = np.take_along_axis(val, k[..., None], axis=2)[..., 0]
                sub = new[a + 1:]
                better = v < sub
                sub[better] = v[better]
                arg[a + 1:][better] = np.stack([np.full(k.shape, a), cs[k], np.full(k.shape, vl),
                                                np.full(k.shape, vr)], axis=-1)[better]
    return new, arg


def _turn(best: np.ndarray, left, right, cap: float | None, weight: tuple[float, float]):
    """The last rank: chunks [a, mid) and [mid, c). Returns (value, (a, c, mid, vl, vr))."""
    top, where = np.inf, None
    for a, c in zip(*np.nonzero(np.isfinite(best))):
        if c - a < 2:
            continue
        mids = np.arange(a + 1, c)
        for vl, (tl, ml) in enumerate(left):
            for vr, (tr, mr) in enumerate(right):
                pm = _pair([x[a, mids] for x in ml], [y[mids, c] for y in mr]) if cap is not None or weight[1] else None
                obj = _weighted(weight, tl[a, mids] + tr[mids, c], pm)
                ok = np.isfinite(obj)
                if cap is not None:
                    ok &= pm <= cap + mem_tol(cap)
                if not ok.any():
                    continue
                i = int(np.argmin(np.where(ok, obj, np.inf)))
                val = max(float(best[a, c]), float(obj[i]))
                if val < top:
                    top, where = val, (int(a), int(c), int(mids[i]), vl, vr)
    return top, where


def _solve(P: Problem, p: int, caps: np.ndarray | None, weight: tuple[float, float],
           scale: np.ndarray | None = None, states: States | None = None):
    """Min over V splits of the max over ranks of the weighted pair objective (divided by
    ``scale[r]`` when given). Returns (value, bounds, variants) or raises Infeasible."""
    n, N = P.n, P.n + 1
    best = np.full((N, N), np.inf)
    best[0, n] = 0.0
    args = []
    for r in range(p - 1):
        left = _chunk_tables(P, r, counts=_counts(states, p, r))
        right = _chunk_tables(P, 2 * p - 1 - r, counts=_counts(states, p, 2 * p - 1 - r))
        w = weight if scale is None else (weight[0] / scale[r], weight[1] / scale[r])
        best, arg = _level(best, left, right, None if caps is None else float(caps[r]),
                           2 * (p - 1 - r), w)
        args.append(arg)
    left = _chunk_tables(P, p - 1, local_end=True, counts=_counts(states, p, p - 1))
    right = _chunk_tables(P, p, counts=_counts(states, p, p))
    w = weight if scale is None else (weight[0] / scale[p - 1], weight[1] / scale[p - 1])
    top, where = _turn(best, left, right, None if caps is None else float(caps[p - 1]), w)
    if where is None:
        raise Infeasible("no V split fits the memory limits")
    a, c, mid, vl, vr = where
    cuts_l, cuts_r, var_l, var_r = [mid, a], [mid, c], [vl], [vr]
    for r in range(p - 2, -1, -1):
        a, c, vl, vr = (int(x) for x in args[r][a, c])
        cuts_l.append(a)
        cuts_r.append(c)
        var_l.append(vl)
        var_r.append(vr)
    cuts = cuts_l[::-1] + cuts_r[1:]
    bounds = [(cuts[i], cuts[i + 1]) for i in range(2 * p)]
    return top, bounds, var_l[::-1] + var_r


def _problem(time, p, static, act, out, inflight, cut_time, recompute_time, checkpointing, shared,
             pend=None, pending=None, recompute_act=None):
    if p < 1:
        raise ValueError(f"number of ranks must be >= 1, got {p}")
    return Problem(time, 2 * p, static, act, out, inflight, cut_time, recompute_time, checkpointing, shared,
                   pend, pending, recompute_act)


def _rank_caps(caps, p: int) -> np.ndarray | None:
    if caps is None:
        return None
    c = np.asarray(caps, dtype=np.float64)
    if c.ndim == 0:
        return np.full(p, float(c))
    if c.shape != (p,):
        raise ValueError(f"memory caps must be one number or {p} numbers (one per rank), got {c.shape[0]}")
    return c


def optimal_v_split(time, p: int, *, static=None, act=None, out=None, inflight=None, caps=None,
                    cut_time=None, recompute_time=None, checkpointing: str = "off",
                    return_variants: bool = False, shared=None, pend=None, pending=None,
                    states: States | None = None, recompute_act=None):
    """Exact V split of ``len(time)`` layers into ``2p`` chunks on ``p`` ranks (rank r: chunks
    r and 2p-1-r) minimising the largest rank time under per-rank memory ``caps`` (one number
    or one per rank). ``inflight``: per chunk (2p). Returns ``(bounds, bottleneck)`` (plus, with
    ``return_variants=True``, per chunk 1 where it recomputes its activations); raises
    :class:`Infeasible` when no split fits. ``pend`` / ``pending``: per layer, the gradients a
    microbatch keeps from I to W, and per chunk the microbatches pending (split backward).
    ``states`` (per rank, its ``((held_left, held_right), (pending_left, pending_right))``
    candidates, ``partitioner.memory.schedule_states``): a rank's memory is then the largest
    over its states, exact where no state dominates for every split. ``recompute_act``: per-layer
    recompute's held bytes per layer (``feasible.Problem``)."""
    P = _problem(time, p, static, act, out, inflight, cut_time, recompute_time, checkpointing, shared,
                 pend, pending, recompute_act)
    _, bounds, var = _solve(P, p, _rank_caps(caps, p), (1.0, 0.0), states=states)
    t, _ = v_split_costs(P, bounds, var)
    if return_variants:
        return bounds, float(np.max(t)), [int(P.variants[v][0] == "recompute") for v in var]
    return bounds, float(np.max(t))


def v_split_costs(P: Problem, bounds: Sequence[tuple[int, int]], variant: Sequence[int] | None = None,
                  states: States | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rank times, rank memories) of a V split (the turn's hand-off is free; with ``states``
    a rank's memory is the largest over them)."""
    k = len(bounds)
    p = k // 2
    t, m = P.costs(bounds, variant)
    t = t.copy()
    t[p - 1] -= P.cut_of(p - 1)[bounds[p - 1][1]]
    mem = m[:p] + m[::-1][:p]
    if states is not None:
        vi = [0] * k if variant is None else list(variant)
        for r in range(p):
            sums = []
            for count_l, count_r in zip(_counts(states, p, r), _counts(states, p, 2 * p - 1 - r)):
                sums.append(sum(_chunk_memory(P, j, bounds[j], vi[j], c)
                                for j, c in ((r, count_l), (2 * p - 1 - r, count_r))))
            mem[r] = max(sums)
    return t[:p] + t[::-1][:p], mem


def _chunk_memory(P: Problem, j: int, bound: tuple[int, int], v: int, count: tuple[int, int]) -> float:
    name, _, _, al, be, ga = P.variants[v]
    a, b, g, d = _coefs(P, name, al, be, ga, j, count)
    s, e = bound
    PA = P.prefix(name)
    return float(P.PS[e] - P.PS[s] + a * (PA[e] - PA[s]) + d * (P.PG[e] - P.PG[s]) + b * P.inbuf[s]
                 + g * P.shared[s] + P.outbuf[e])


def min_v_memory_scale(n: int, p: int, *, static=None, act=None, out=None, inflight=None, caps=None,
                       recompute_time=None, checkpointing: str = "off", shared=None, pend=None,
                       pending=None, states: States | None = None, recompute_act=None
                       ) -> tuple[float, list[tuple[int, int]]]:
    """Smallest factor ``a`` such that some V split fits ``a * caps`` per rank (``caps=None``:
    1 byte per rank, so ``a`` is the smallest uniform limit in bytes), with that split."""
    P = _problem(np.zeros(n), p, static, act, out, inflight, None,
                 np.zeros(n) if checkpointing != "off" else None, checkpointing, shared, pend, pending,
                 recompute_act)
    base = np.ones(p) if caps is None else _rank_caps(caps, p)
    if np.any(base <= 0):
        raise ValueError("memory caps must be > 0")
    _, bounds, var = _solve(P, p, None, (0.0, 1.0), scale=base, states=states)
    _, mem = v_split_costs(P, bounds, var, states)
    return float(np.max(mem / base)), bounds
