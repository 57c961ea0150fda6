"""Exact contiguous split and the baselines, as pure functions on numbers (numpy).

The stage cost model and the exact feasibility probe are in :mod:`partitioner.feasible`
(time ``sum(time[s:e]) + cut_time[e]``, memory static + in-flight activations + boundary
buffers, per stage j with its own cap). :func:`optimal_split` minimises ``max_j time_j``
subject to ``mem_j <= caps[j]`` exactly: bisection on the bottleneck, first on its value
until few candidate stage times ``time(s, e)`` remain in the bracket, then over those
candidates, each step one probe (an O(k log n) greedy on monotone envelopes that settles
almost every probe, the exact windowed sweep otherwise). The result is the smallest
candidate the probe accepts, so it is the optimum whatever the costs.

Tie-break among splits with the optimal bottleneck: when the stage-time sum varies (boundary
transfers, ``cut_time``), the split with the smallest sum of stage times (exact dynamic
program restricted to the optimal bottleneck); otherwise, from the last stage backwards, each
stage starts as early as feasible, i.e. later stages take as many layers as the bottleneck and
memory allow (under 1F1B later stages hold fewer microbatches, so earlier stages keep headroom).

Example::

    import numpy as np
    from partitioner.solve import optimal_split
    bounds, b = optimal_split(np.array([1., 2, 3, 4]), 2)
    # bounds == [(0, 3), (3, 4)], b == 6.0
"""

from __future__ import annotations

import numpy as np

from .feasible import Infeasible, Problem

__all__ = [
    "optimal_split", "min_memory_scale", "uniform_split", "parameter_split", "greedy_split",
    "split_costs", "fits_any", "pipeline_lower_bound", "Infeasible",
]

_CANDIDATES = 1 << 14   # enumerate the candidate bottlenecks once the bracket holds this few
_Problem = Problem      # the name older callers use


def _caps_array(caps, k: int) -> np.ndarray | None:
    if caps is None:
        return None
    c = np.asarray(caps, dtype=np.float64)
    if c.ndim == 0:
        return np.full(k, float(c))
    if c.shape != (k,):
        raise ValueError(f"memory caps must be one number or {k} numbers (one per stage), got {c.shape[0]}")
    return c


def optimal_split(time, k: int, *, static=None, act=None, out=None, inflight=None, caps=None,
                  cut_time=None, recompute_time=None, checkpointing: str = "off",
                  return_variants: bool = False, shared=None, pend=None, pending=None, recompute_act=None):
    """Exact min-bottleneck contiguous split of ``len(time)`` layers into ``k`` stages.

    Returns ``(bounds, bottleneck)`` (plus the per-stage variant list, 1 = recompute, with
    ``return_variants=True``); raises :class:`Infeasible` when no split fits ``caps``.
    ``checkpointing``: "off", "on" (every stage recomputes) or "auto" (a stage recomputes only
    when that is what lets the split fit, decided exactly inside the search). ``pend`` (per
    layer) and ``pending`` (per stage): the gradients a microbatch keeps between its I and its
    W under a split-backward schedule, and the microbatches a stage has pending at its peak
    (:mod:`partitioner.feasible`). ``recompute_act``: per layer, what a layer checkpointed on its
    own keeps per held microbatch (per-layer recompute; None: a recomputing stage is one checkpoint).
    """
    P = Problem(time, k, static, act, out, inflight, cut_time, recompute_time, checkpointing, shared,
                pend, pending, recompute_act)
    c = _caps_array(caps, k)
    if not P.feasible(np.inf, c):
        raise Infeasible("no split fits the memory limits")
    B = _min_bottleneck(P, c)
    rows = P.rows(B, c)
    assert rows is not None
    bounds, var = P.reconstruct(rows, B, c)
    t, _ = P.costs(bounds, var)
    if return_variants:
        return bounds, float(np.max(t)), var
    return bounds, float(np.max(t))


def _min_bottleneck(P: Problem, caps: np.ndarray | None) -> float:
    """The smallest candidate stage time the probe accepts (exact): halve the value bracket
    while it holds many candidates, then bisect over the candidates themselves."""
    lo = max(float(np.max(P.time)), float(np.sum(P.time)) / P.k) * (1 - 1e-9)
    hi = P.max_time() * (1 + 1e-9) + 1e-300   # every stage fits in time: feasible
    if P.feasible(lo, caps):
        lo = 0.0
    while True:
        cand = P.candidates_between(lo, hi, _CANDIDATES)
        if cand is not None:
            break
        mid = (lo + hi) / 2
        if P.feasible(mid, caps):
            hi = mid
        else:
            lo = mid
    cand = cand[cand > lo]
    a, b = 0, cand.size - 1   # the largest candidate is >= the optimum, so feasible
    while a < b:
        mid = (a + b) // 2
        if P.feasible(float(cand[mid]), caps):
            b = mid
        else:
            a = mid + 1
    return float(cand[a])


def min_memory_scale(k: int, n: int, *, static=None, act=None, out=None, inflight=None, caps=None,
                     recompute_time=None, checkpointing: str = "off", rel_tol: float = 1e-9, shared=None,
                     pend=None, pending=None, recompute_act=None) -> tuple[float, list[tuple[int, int]]]:
    """Smallest factor ``a`` such that some split fits ``a * caps`` (``caps=None``: a cap of 1
    byte per stage, so ``a`` is the smallest uniform limit in bytes), with that split.
    Time is unconstrained. Bisection on ``a`` with the exact probe; the returned figure is the
    largest ``mem_j / caps_j`` of the split found, so it is achieved (feasible) and within
    ``rel_tol`` (or a quarter byte) of the minimum."""
    P = Problem(np.zeros(n), k, static, act, out, inflight, None,
                np.zeros(n) if checkpointing != "off" else None, checkpointing, shared, pend, pending, recompute_act)
    base = np.ones(k) if caps is None else _caps_array(caps, k)
    if np.any(base <= 0):
        raise ValueError("memory caps must be > 0")
    even = uniform_split(n, k)
    _, mem = P.costs(even)
    hi = float(np.max(mem / base)) * (1 + 1e-12) + 1e-9
    lo = 0.0
    while hi - lo > rel_tol * hi + (0.25 if caps is None else 0.0):
        mid = (lo + hi) / 2
        if P.feasible(np.inf, base * mid):
            hi = mid
        else:
            lo = mid
    rows = P.rows(np.inf, base * hi)
    assert rows is not None
    bounds, var = P.reconstruct(rows, np.inf, base * hi)
    _, mem = P.costs(bounds, var)
    return float(np.max(mem / base)), bounds


def split_costs(bounds, *, time, static=None, act=None, out=None, inflight=None, cut_time=None,
                recompute_time=None, recompute=None, shared=None, pend=None, pending=None, recompute_act=None):
    """(stage times, stage memory) arrays of a given split; ``recompute``: per-stage bools."""
    rec = [bool(r) for r in recompute] if recompute is not None else [False] * len(bounds)
    mode = "auto" if any(rec) else "off"
    P = Problem(time, len(bounds), static, act, out, inflight, cut_time,
                recompute_time if any(rec) else None, mode, shared, pend, pending, recompute_act)
    return P.costs(bounds, [1 if r else 0 for r in rec])


def fits_any(k: int, n: int, *, static=None, act=None, out=None, inflight=None, caps=None,
             recompute_time=None, checkpointing: str = "off", shared=None, pend=None, pending=None,
             recompute_act=None) -> bool:
    """Whether any split into ``k`` stages fits ``caps`` (time unconstrained)."""
    try:
        P = Problem(np.zeros(n), k, static, act, out, inflight, None,
                    np.zeros(n) if checkpointing != "off" else None, checkpointing, shared, pend, pending,
                    recompute_act)
    except Infeasible:
        return False
    return P.feasible(np.inf, _caps_array(caps, k))


def pipeline_lower_bound(time, k: int, m: int, carried=None) -> float:
    """A lower bound on the step of a one-chunk-per-rank pipeline (gpipe, 1f1b, zb-h1) over
    every contiguous split into ``k`` stages, transfers ignored.

    For a split, stage j computes ``m * T_j`` and cannot start before the first microbatch's
    forward reaches it; with an atomic backward (gpipe, 1f1b) its last backward must also
    still travel back through stages ``i < j``. So ``step >= m * T_j + sum_{i<j} C_i`` with
    ``C = carried``: forward + backward for gpipe/1f1b (the default, ``carried = time``), the
    forward only for zb-h1 (deferred weight gradients can overlap the return trip). The result
    is the minimum over splits of the maximum over j, solved exactly like the bottleneck (the
    start term ``m * PT[s] - PC[s]`` is non-decreasing in s since ``C <= T``).
    """
    t = np.asarray(time, dtype=np.float64)
    c = t if carried is None else np.minimum(np.asarray(carried, dtype=np.float64), t)
    P = Problem(t, k)
    PT = np.concatenate([[0.0], np.cumsum(t)])
    PC = np.concatenate([[0.0], np.cumsum(c)])
    P.variants = [("bound", m * PT - PC, (m * PT)[None, :], P.inflight, np.ones(k), np.zeros(k))]
    lo = max(m * float(np.max(t)), m * float(PT[-1]) / k) * (1 - 1e-9)
    hi = P.max_time() * (1 + 1e-9) + 1e-300
    if P.feasible(lo, None):
        return lo / (1 - 1e-9)
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if P.feasible(mid, None):
            hi = mid
        else:
            lo = mid
    return lo


def uniform_split(n: int, k: int) -> list[tuple[int, int]]:
    """Equal layer counts; the first ``n % k`` stages get one more (as DeepSpeed's partition_uniform)."""
    if k > n:
        raise Infeasible(f"{k} stages need at least {k} layers; the model has {n} layers, so use at most {n} stages")
    q, r = divmod(n, k)
    out, s = [], 0
    for j in range(k):
        e = s + q + (1 if j < r else 0)
        out.append((s, e))
        s = e
    return out


def parameter_split(params, k: int) -> list[tuple[int, int]]:
    """Balanced parameter counts: the exact min-max split of ``params`` (DeepSpeed balances the
    same weights, with a max-minus-min objective)."""
    w = np.asarray(params, dtype=np.float64)
    if k > w.size:
        raise Infeasible(f"{k} stages need at least {k} layers; the model has {w.size} layers, so use at most {w.size} stages")
    return optimal_split(w, k)[0]


def greedy_split(time, k: int, max_iter: int | None = None) -> list[tuple[int, int]]:
    """torchgpipe's ``balance_by_time``: the block-partition local search of Bárány et al.

    Values are normalised to [0, 1]; starting from equal layer counts, the largest block
    repeatedly pushes one layer, through the neighbour, towards the smallest block nearest to
    it, until max block <= min block + 1 (one normalised element).
    """
    x = np.asarray(time, dtype=np.float64)
    n = x.size
    if k > n:
        raise Infeasible(f"{k} stages need at least {k} layers; the model has {n} layers, so use at most {n} stages")
    span = x.max() - x.min()
    norm = np.zeros(n) if span == 0 else (x - x.min()) / span
    pre = np.concatenate([[0.0], np.cumsum(norm)])
    ends = [n // k * (i + 1) for i in range(k - 1)] + [n]

    def sizes() -> np.ndarray:
        starts = [0] + ends[:-1]
        return pre[np.array(ends)] - pre[np.array(starts)]

    limit = max_iter if max_iter is not None else 4 * n * k + 100
    it = 0
    while it < limit:
        sz = sizes()
        big = int(np.argmax(sz))
        big_size = sz[big]
        while it < limit:
            it += 1
            sz = sizes()
            small_size = sz.min()
            if big_size <= small_size + 1:
                return _bounds_from_ends(ends)
            mins = np.nonzero(sz == small_size)[0]
            q = int(mins[np.argmin(np.abs(mins - big))])
            if big < q:
                h = q - 1
                start_h = ends[h - 1] if h > 0 else 0
                if ends[h] - start_h <= 1:
                    return _bounds_from_ends(ends)
                ends[h] -= 1
            else:
                h = q + 1
                if ends[h] - ends[q] <= 1:
                    return _bounds_from_ends(ends)
                ends[q] += 1
            if big == h:
                break
    return _bounds_from_ends(ends)


def _bounds_from_ends(ends: list[int]) -> list[tuple[int, int]]:
    starts = [0] + ends[:-1]
    return [(int(s), int(e)) for s, e in zip(starts, ends)]
