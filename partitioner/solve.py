"""Exact contiguous split and the baselines, as pure functions on numbers (numpy).

A problem is ``n`` layers with per-layer ``time`` (seconds), ``static`` bytes (parameters,
gradients, optimizer state), ``act`` bytes (saved per microbatch) and ``out`` bytes (what
crosses a cut after the layer), cut into ``k`` contiguous non-empty stages. Stage ``j``
covering ``[s, e)`` costs::

    time_j = sum(time[s:e]) + cut_time[e]                 # cut_time[n] = 0
    mem_j  = sum(static[s:e]) + inflight[j] * (sum(act[s:e]) + shared[s])
             + out[s-1] + out[e-1]                        # boundary terms only at real cuts

:func:`optimal_split` minimises ``max_j time_j`` subject to ``mem_j <= caps[j]`` exactly.
Method: bisection over the sorted candidate bottleneck values (every ``time(s, e)``), each
probed by a forward reachability sweep: prefix ``[0, e)`` is splittable into ``j + 1`` stages
iff some reachable ``s`` has ``time(s, e) <= B`` (an interval of ``s``, by prefix sums) and
``mem_j(s, e) <= cap_j``; the memory test separates into ``u_j(s) <= r_j(e)`` and is answered
for all ``e`` at once by a range-minimum (sparse table) of ``u_j`` over the reachable starts in
the interval. The probe is exact for any non-negative costs (no monotonicity assumption), so
the bisection returns the optimum. Cost: O(k n log n) per probe, ~log2(n^2) probes.

Tie-break among splits with the optimal bottleneck: when the stage-time sum varies (boundary
transfers, ``cut_time``), the split with the smallest sum of stage times (exact O(k n^2) dynamic
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

from typing import Sequence

import numpy as np

__all__ = [
    "optimal_split", "min_memory_scale", "uniform_split", "parameter_split", "greedy_split",
    "split_costs", "fits_any", "pipeline_lower_bound", "Infeasible",
]

_REL = 1e-12


class Infeasible(Exception):
    """No split satisfies the constraints (internal; partition() turns it into PartitionError)."""


def _arr(x: Sequence[float] | np.ndarray | None, n: int, name: str) -> np.ndarray:
    if x is None:
        return np.zeros(n)
    a = np.asarray(x, dtype=np.float64)
    if a.shape != (n,):
        raise ValueError(f"{name} must have length {n}, got shape {a.shape}")
    if np.any(a < 0) or not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite and >= 0")
    return a


class _Problem:
    """Prefix sums and per-stage tests. A stage may run in one of several variants:
    "plain" (activations held per in-flight microbatch) and, with activation checkpointing,
    "recompute" (time += recompute_time; holds only its input per in-flight microbatch plus
    one microbatch's activations while recomputing)."""

    def __init__(self, time, k, static=None, act=None, out=None, inflight=None, cut_time=None,
                 recompute_time=None, checkpointing: str = "off", shared=None):
        t = np.asarray(time, dtype=np.float64)
        if t.ndim != 1 or t.size == 0:
            raise ValueError("time must be a non-empty 1-D sequence")
        n = t.size
        if k < 1:
            raise ValueError(f"number of stages must be >= 1, got {k}")
        if k > n:
            raise Infeasible(f"{k} stages need at least {k} layers; the model has {n} layers, so use at most {n} stages")
        if checkpointing not in ("off", "on", "auto"):
            raise ValueError(f"checkpointing must be 'off', 'on' or 'auto', got {checkpointing!r}")
        self.n, self.k = n, k
        self.time = _arr(t, n, "time")
        self.static = _arr(static, n, "static")
        self.act = _arr(act, n, "act")
        self.out = _arr(out, n, "out")
        self.inflight = np.ones(k) if inflight is None else np.asarray(inflight, dtype=np.float64)
        if self.inflight.shape != (k,):
            raise ValueError(f"inflight must have length {k}")
        ct = np.zeros(n + 1) if cut_time is None else np.array(cut_time, dtype=np.float64)
        if ct.shape != (n + 1,):
            raise ValueError(f"cut_time must have length n + 1 = {n + 1}")
        ct[n] = 0.0
        ct[0] = 0.0
        self.cut_time = ct
        self.PS = np.concatenate([[0.0], np.cumsum(self.static)])
        self.PA = np.concatenate([[0.0], np.cumsum(self.act)])
        # boundary buffers: inbuf[s] = out[s-1] for s >= 1; outbuf[e] = out[e-1] for e < n
        self.inbuf = np.concatenate([[0.0], self.out])
        self.outbuf = np.concatenate([[0.0], self.out[:-1], [0.0]])
        self.E = np.arange(n + 1)
        # input bytes a stage's first layer saves that the previous layer already counted:
        # only held again when a cut separates them (shared[s] at a cut s > 0)
        self.shared = np.concatenate([[0.0], _arr(shared, n, "shared")[1:], [0.0]])
        # variants: (name, PT, endcost, alpha[k] (times sum act), beta[k] (times inbuf[s]),
        #            gamma[k] (times shared[s]))
        self.variants = []
        if checkpointing in ("off", "auto"):
            PT = np.concatenate([[0.0], np.cumsum(self.time)])
            self.variants.append(("plain", PT, PT + ct, self.inflight, np.ones(k), self.inflight))
        if checkpointing in ("on", "auto"):
            rt = _arr(recompute_time, n, "recompute_time")
            PT = np.concatenate([[0.0], np.cumsum(self.time + rt)])
            # the stage input is kept anyway (the checkpoint): shared adds nothing
            self.variants.append(("recompute", PT, PT + ct, np.ones(k), self.inflight + 1, np.zeros(k)))

    # -- costs of a given split -------------------------------------------------------
    def costs(self, bounds: Sequence[tuple[int, int]], variant: Sequence[int] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        s = np.array([b[0] for b in bounds])
        e = np.array([b[1] for b in bounds])
        vi = np.zeros(len(bounds), dtype=np.int64) if variant is None else np.asarray(variant)
        t = np.empty(len(bounds))
        m = np.empty(len(bounds))
        for j in range(len(bounds)):
            _, PT, EC, al, be, ga = self.variants[vi[j]]
            t[j] = EC[e[j]] - PT[s[j]]
            m[j] = (self.PS[e[j]] - self.PS[s[j]] + al[j] * (self.PA[e[j]] - self.PA[s[j]])
                    + be[j] * self.inbuf[s[j]] + ga[j] * self.shared[s[j]] + self.outbuf[e[j]])
        return t, m

    # -- feasibility ------------------------------------------------------------------
    @staticmethod
    def _tol(B: float) -> float:
        return _REL * max(abs(B), 1e-300)

    def probe(self, B: float, caps: np.ndarray | None) -> list[np.ndarray] | None:
        """Reachability rows R[0..k] (R[j][e]: prefix [0, e) splits into j feasible stages)."""
        n, k = self.n, self.k
        los = []
        for _, PT, EC, _, _, _ in self.variants:
            if np.isfinite(B):
                los.append(np.searchsorted(PT, EC - B - self._tol(B), side="left"))
            else:
                los.append(np.zeros(n + 1, dtype=np.int64))
        hi = self.E - 1
        R = np.zeros(n + 1, dtype=bool)
        R[0] = True
        rows = [R]
        for j in range(k):
            cnt = np.concatenate([[0], np.cumsum(R)]) if caps is None else None
            ok = np.zeros(n + 1, dtype=bool)
            for v, (_, PT, EC, al, be, ga) in enumerate(self.variants):
                lo_j = np.maximum(los[v], j)
                okv = lo_j <= hi
                if caps is None:
                    h = np.clip(hi, 0, n)
                    l = np.clip(lo_j, 0, n)
                    okv &= (cnt[h + 1] - cnt[l]) > 0
                else:
                    u = np.where(R, be[j] * self.inbuf + ga[j] * self.shared - self.PS - al[j] * self.PA, np.inf)
                    rhs = caps[j] - self.PS - al[j] * self.PA - self.outbuf
                    okv &= _range_min(u, lo_j, hi, okv) <= rhs + _REL * max(abs(caps[j]), 1.0) + 1e-6
                ok |= okv
            ok[0] = False
            ok[n - (k - 1 - j) + 1:] = False   # leave a layer for each later stage
            R = ok
            if not R.any():
                return None
            rows.append(R)
        return rows if rows[k][n] else None

    def stage_ok(self, j: int, s: np.ndarray, e: int, B: float, caps: np.ndarray | None, v: int) -> np.ndarray:
        """Mask over candidate starts ``s`` for stage j ending at e in variant v (as probe)."""
        _, PT, EC, al, be, ga = self.variants[v]
        ok = np.ones(s.shape, dtype=bool)
        if np.isfinite(B):
            ok &= PT[s] >= EC[e] - B - self._tol(B)
        if caps is not None:
            u = be[j] * self.inbuf[s] + ga[j] * self.shared[s] - self.PS[s] - al[j] * self.PA[s]
            rhs = caps[j] - self.PS[e] - al[j] * self.PA[e] - self.outbuf[e]
            ok &= u <= rhs + _REL * max(abs(caps[j]), 1.0) + 1e-6
        return ok

    def reconstruct(self, rows, B, caps) -> tuple[list[tuple[int, int]], list[int]]:
        """A split feasible at B: (bounds, variant index per stage)."""
        if np.any(self.cut_time[1:-1] > 0) or len(self.variants) > 1:
            return self._min_sum(rows, B, caps)
        bounds, var = [], []
        e = self.n
        for j in range(self.k - 1, -1, -1):
            s = np.nonzero(rows[j][:e])[0]
            s = s[self.stage_ok(j, s, e, B, caps, 0)]
            if s.size == 0:  # cannot happen if rows came from probe
                raise RuntimeError("internal error: reconstruction found no start")
            bounds.append((int(s[0]), e))
            var.append(0)
            e = int(s[0])
        return bounds[::-1], var[::-1]

    def _min_sum(self, rows, B, caps) -> tuple[list[tuple[int, int]], list[int]]:
        """Among splits with every stage feasible at B, the one with the smallest sum of stage
        times (ties: earlier variant, i.e. no recomputation)."""
        n, k = self.n, self.k
        dp = np.full(n + 1, np.inf)
        dp[0] = 0.0
        arg = np.zeros((k, n + 1), dtype=np.int64)
        argv = np.zeros((k, n + 1), dtype=np.int64)
        for j in range(k):
            new = np.full(n + 1, np.inf)
            starts = np.nonzero(np.isfinite(dp) & rows[j])[0]
            for e in np.nonzero(rows[j + 1])[0]:
                s_all = starts[starts < e]
                for v, (_, PT, EC, _, _, _) in enumerate(self.variants):
                    s = s_all[self.stage_ok(j, s_all, int(e), B, caps, v)]
                    if s.size == 0:
                        continue
                    val = dp[s] + EC[e] - PT[s]
                    i = int(np.argmin(val))
                    if val[i] < new[e] * (1 - 1e-12) or not np.isfinite(new[e]):
                        new[e] = val[i]
                        arg[j, e] = s[i]
                        argv[j, e] = v
            dp = new
        if not np.isfinite(dp[n]):
            raise RuntimeError("internal error: min-sum reconstruction found no split")
        bounds, var = [], []
        e = n
        for j in range(k - 1, -1, -1):
            s = int(arg[j, e])
            bounds.append((s, e))
            var.append(int(argv[j, e]))
            e = s
        return bounds[::-1], var[::-1]

    def candidates(self) -> np.ndarray:
        s, e = np.triu_indices(self.n + 1, k=1)
        return np.unique(np.concatenate([EC[e] - PT[s] for _, PT, EC, _, _, _ in self.variants]))

    def max_time(self) -> float:
        return max(float(np.max(EC)) for _, _, EC, _, _, _ in self.variants)


def _range_min(a: np.ndarray, lo: np.ndarray, hi: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """min(a[lo[i]..hi[i]]) for every i (inf where not ok), via a sparse table."""
    n = a.size
    levels = [a]
    w = 1
    longest = int(np.max(np.where(ok, hi - lo + 1, 1))) if ok.any() else 1
    while 2 * w <= min(n, longest):  # only the levels the widest query needs
        prev = levels[-1]
        nxt = np.full(n, np.inf)
        nxt[: n - w] = np.minimum(prev[: n - w], prev[w:])
        levels.append(nxt)
        w *= 2
    table = np.stack(levels)
    lo_c = np.where(ok, lo, 0)
    hi_c = np.where(ok, hi, 0)
    length = hi_c - lo_c + 1
    lvl = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
    res = np.minimum(table[lvl, lo_c], table[lvl, hi_c - (1 << lvl) + 1])
    return np.where(ok, res, np.inf)


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
                  return_variants: bool = False, shared=None):
    """Exact min-bottleneck contiguous split of ``len(time)`` layers into ``k`` stages.

    Returns ``(bounds, bottleneck)`` (plus the per-stage variant list, 1 = recompute, with
    ``return_variants=True``); raises :class:`Infeasible` when no split fits ``caps``.
    ``checkpointing``: "off", "on" (every stage recomputes) or "auto" (a stage recomputes only
    when that is what lets the split fit, decided exactly inside the search).
    """
    P = _Problem(time, k, static, act, out, inflight, cut_time, recompute_time, checkpointing, shared)
    c = _caps_array(caps, k)
    if P.probe(np.inf, c) is None:
        raise Infeasible("no split fits the memory limits")
    lb = max(float(np.max(P.time)), float(np.sum(P.time)) / k)
    if P.n <= 2500:  # bisection over the exact candidate values
        cand = P.candidates()
        cand = cand[cand >= lb * (1 - 1e-9)]
        lo, hi = 0, cand.size - 1   # the largest candidate is always time-feasible
        while lo < hi:
            mid = (lo + hi) // 2
            if P.probe(float(cand[mid]), c) is not None:
                hi = mid
            else:
                lo = mid + 1
        B = float(cand[lo])
    else:  # too many pairs to list: bisection on the value to relative 1e-12
        lo_v, hi_v = lb * (1 - 1e-9), P.max_time() * (1 + 1e-9) + 1e-300
        while hi_v - lo_v > 1e-12 * hi_v:
            mid = (lo_v + hi_v) / 2
            if P.probe(mid, c) is not None:
                hi_v = mid
            else:
                lo_v = mid
        B = hi_v
    rows = P.probe(B, c)
    assert rows is not None
    bounds, var = P.reconstruct(rows, B, c)
    t, _ = P.costs(bounds, var)
    if return_variants:
        return bounds, float(np.max(t)), var
    return bounds, float(np.max(t))


def min_memory_scale(k: int, n: int, *, static=None, act=None, out=None, inflight=None, caps=None,
                     recompute_time=None, checkpointing: str = "off", rel_tol: float = 1e-9, shared=None
                     ) -> tuple[float, list[tuple[int, int]]]:
    """Smallest factor ``a`` such that some split fits ``a * caps`` (``caps=None``: a cap of 1
    byte per stage, so ``a`` is the smallest uniform limit in bytes), with that split.
    Time is unconstrained. Bisection on ``a`` with the exact probe; the returned figure is the
    largest ``mem_j / caps_j`` of the split found, so it is achieved (feasible) and within
    ``rel_tol`` (or a quarter byte) of the minimum."""
    P = _Problem(np.zeros(n), k, static, act, out, inflight, None,
                 np.zeros(n) if checkpointing != "off" else None, checkpointing, shared)
    base = np.ones(k) if caps is None else _caps_array(caps, k)
    if np.any(base <= 0):
        raise ValueError("memory caps must be > 0")
    even = uniform_split(n, k)
    _, mem = P.costs(even)
    hi = float(np.max(mem / base)) * (1 + 1e-12) + 1e-9
    lo = 0.0
    while hi - lo > rel_tol * hi + (0.25 if caps is None else 0.0):
        mid = (lo + hi) / 2
        if P.probe(np.inf, base * mid) is not None:
            hi = mid
        else:
            lo = mid
    rows = P.probe(np.inf, base * hi)
    assert rows is not None
    bounds, var = P.reconstruct(rows, np.inf, base * hi)
    _, mem = P.costs(bounds, var)
    return float(np.max(mem / base)), bounds


def split_costs(bounds, *, time, static=None, act=None, out=None, inflight=None, cut_time=None,
                recompute_time=None, recompute=None, shared=None):
    """(stage times, stage memory) arrays of a given split; ``recompute``: per-stage bools."""
    rec = [bool(r) for r in recompute] if recompute is not None else [False] * len(bounds)
    mode = "auto" if any(rec) else "off"
    P = _Problem(time, len(bounds), static, act, out, inflight, cut_time,
                 recompute_time if any(rec) else None, mode, shared)
    return P.costs(bounds, [1 if r else 0 for r in rec])


def fits_any(k: int, n: int, *, static=None, act=None, out=None, inflight=None, caps=None,
             recompute_time=None, checkpointing: str = "off", shared=None) -> bool:
    """Whether any split into ``k`` stages fits ``caps`` (time unconstrained)."""
    try:
        P = _Problem(np.zeros(n), k, static, act, out, inflight, None,
                     np.zeros(n) if checkpointing != "off" else None, checkpointing, shared)
    except Infeasible:
        return False
    return P.probe(np.inf, _caps_array(caps, k)) is not None


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
    P = _Problem(t, k)
    PT = np.concatenate([[0.0], np.cumsum(t)])
    PC = np.concatenate([[0.0], np.cumsum(c)])
    P.variants = [("bound", m * PT - PC, m * PT, P.inflight, np.ones(k), np.zeros(k))]
    lo = max(m * float(np.max(t)), m * float(PT[-1]) / k) * (1 - 1e-9)
    hi = P.max_time() * (1 + 1e-9) + 1e-300
    if P.probe(lo, None) is not None:
        return lo / (1 - 1e-9)
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if P.probe(mid, None) is not None:
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
