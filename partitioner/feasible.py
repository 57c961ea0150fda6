"""The stage cost model of a contiguous split and its exact feasibility test (numpy).

A problem is ``n`` layers with per-layer ``time`` (seconds), ``static`` bytes (parameters,
gradients, optimizer state), ``act`` bytes (saved per microbatch) and ``out`` bytes (what
crosses a cut after the layer), cut into ``k`` contiguous non-empty stages. Stage ``j``
covering ``[s, e)`` in variant ``v`` (plain, or recomputing its activations) costs::

    time_j = PT_v[e] - PT_v[s] + cut_time[e]            # cut_time[n] = 0 (or cut_time[j][e]: per stage)
    mem_j  = static(s, e) + alpha_j * act(s, e) + delta_j * pend(s, e) + beta_j * out[s-1]
             + gamma_j * shared[s] + out[e-1]            # boundary terms only at real cuts

(``cut_time`` may be one row per stage, ``(k, n + 1)``: stage j's outgoing transfer on its own
link, e.g. NVLink or a NIC; the distinct rows are kept once. ``pend``: the gradients a microbatch keeps between its I and its W under a split-backward
schedule, ``delta_j`` the microbatches stage j has pending at its peak; a recomputing stage
runs I and W as one full backward, so its ``delta`` is 0.) A recomputing stage holds per
in-flight microbatch its input (``beta_j = inflight_j + 1``, with the receive buffer) and one
microbatch's ``act`` while it recomputes (``alpha_j = 1``); with ``recompute_act`` (per-layer
recompute: the bytes each checkpointed layer keeps, its input) it holds ``inflight_j`` times
``recompute_act(s, e)`` instead (the first layer's input among them, ``beta_j = 1``), the one
layer recomputing at a time being a transient that does not add over layers.

"Is there a split with every stage within time ``B`` and its memory cap?" is answered in
three exact steps:

1. an *optimistic* greedy: drop the boundary terms (``cut_time``, buffers, ``shared``: all
   >= 0), which leaves a problem where a stage's constraint only gets easier on a sub-range.
   There the farthest reach after j stages, ``Z_j``, bounds every feasible split's j-th cut
   from above (and a backward pass ``L_j`` from below); ``Z_k < n`` proves "no";
2. a *pessimistic* greedy: add the largest boundary terms instead; a split it finds fits
   the true constraints, which proves "yes";
3. otherwise (boundary terms decide) the exact reachability sweep, restricted to the
   windows ``[L_j, Z_j]``: prefix ``[0, e)`` splits into ``j + 1`` stages iff some reachable
   ``s`` in the window has ``time(s, e) <= B`` (an interval of ``s``) and
   ``u_j(s) <= r_j(e)`` (the memory test, separated), answered for all ``e`` at once by a
   range minimum (sparse table) of ``u_j``.

Steps 1 and 2 cost O(k log n) in Python; step 3 O(sum of window sizes x log n) in numpy.

Example::

    P = Problem(np.array([1., 2, 3, 4]), 2)
    P.feasible(6.0, None), P.feasible(5.9, None)    # (True, False)
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Sequence

import numpy as np

__all__ = ["Problem", "Infeasible", "REL"]

REL = 1e-12


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


def time_tol(B: float) -> float:
    return REL * max(abs(B), 1e-300)


def mem_tol(cap: float) -> float:
    return REL * max(abs(cap), 1.0) + 1e-6


class Problem:
    """Prefix sums, per-stage tests and the exact feasibility probe. A stage may run in one of
    several variants: "plain" (activations held per in-flight microbatch) and, with activation
    checkpointing, "recompute" (time += recompute_time; holds only its input per in-flight
    microbatch plus one microbatch's activations while recomputing)."""

    def __init__(self, time, k, static=None, act=None, out=None, inflight=None, cut_time=None,
                 recompute_time=None, checkpointing: str = "off", shared=None, pend=None, pending=None,
                 recompute_act=None):
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
        ct, self.cut_row = _cut_rows(cut_time, n, k)
        self.cut_time = ct   # (rows, n + 1): the distinct cut-time rows; stage j's is ct[cut_row[j]]
        self.PS = np.concatenate([[0.0], np.cumsum(self.static)])
        self.PA = np.concatenate([[0.0], np.cumsum(self.act)])
        self.PG = np.concatenate([[0.0], np.cumsum(_arr(pend, n, "pend"))])
        self.layer_recompute = recompute_act is not None
        self.PR = (np.concatenate([[0.0], np.cumsum(_arr(recompute_act, n, "recompute_act"))])
                   if self.layer_recompute else self.PA)
        self.pending = np.zeros(k) if pending is None else np.asarray(pending, dtype=np.float64)
        if self.pending.shape != (k,):
            raise ValueError(f"pending must have length {k}")
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
            self.variants.append(("plain", PT, PT[None, :] + ct, self.inflight, np.ones(k), self.inflight))
        if checkpointing in ("on", "auto"):
            rt = _arr(recompute_time, n, "recompute_time")
            PT = np.concatenate([[0.0], np.cumsum(self.time + rt)])
            # the stage input is kept anyway (the checkpoint): shared adds nothing
            if self.layer_recompute:   # every layer's input per held microbatch (PR)
                self.variants.append(("recompute", PT, PT[None, :] + ct, self.inflight, np.ones(k), np.zeros(k)))
            else:
                self.variants.append(("recompute", PT, PT[None, :] + ct, np.ones(k), self.inflight + 1, np.zeros(k)))
        self._tables: tuple | None = None

    def end_cost(self, EC: np.ndarray, j: int) -> np.ndarray:
        """Stage j's end cost (``PT + cut_time``) of a variant's rows ``EC``."""
        return EC[self.cut_row[j]]

    def cut_of(self, j: int) -> np.ndarray:
        """Stage j's cut-time row (length n + 1)."""
        return self.cut_time[self.cut_row[j]]

    def prefix(self, name: str) -> np.ndarray:
        """The prefix sums the held microbatches of variant ``name`` multiply: ``act``'s, or
        under per-layer recompute the recomputing stages' ``recompute_act``'s."""
        return self.PR if name == "recompute" else self.PA

    # -- costs of a given split -------------------------------------------------------
    def costs(self, bounds: Sequence[tuple[int, int]], variant: Sequence[int] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        s = np.array([b[0] for b in bounds])
        e = np.array([b[1] for b in bounds])
        vi = np.zeros(len(bounds), dtype=np.int64) if variant is None else np.asarray(variant)
        t = np.empty(len(bounds))
        m = np.empty(len(bounds))
        for j in range(len(bounds)):
            name, PT, EC, al, be, ga = self.variants[vi[j]]
            t[j] = self.end_cost(EC, j)[e[j]] - PT[s[j]]
            a, d = self.coefs(name, al, j)
            PA = self.prefix(name)
            m[j] = (self.PS[e[j]] - self.PS[s[j]] + a * (PA[e[j]] - PA[s[j]])
                    + d * (self.PG[e[j]] - self.PG[s[j]]) + be[j] * self.inbuf[s[j]] + ga[j] * self.shared[s[j]] + self.outbuf[e[j]])
        return t, m

    def coefs(self, name: str, al: np.ndarray, j: int) -> tuple[float, float]:
        """Stage j's (alpha, delta) in variant ``name``: held microbatches times ``act``,
        pending ones times ``pend`` (only a plain stage splits its backward)."""
        return float(al[j]), (float(self.pending[j]) if name == "plain" else 0.0)

    def held(self, name: str, al: np.ndarray, j: int, idx):  # noqa: ANN001, ANN201 - int or array
        """The prefix of stage j's per-microbatch bytes in variant ``name`` at ``idx``."""
        a, d = self.coefs(name, al, j)
        PA = self.prefix(name)
        return a * PA[idx] + d * self.PG[idx] if d else a * PA[idx]

    def stage_ok(self, j: int, s: np.ndarray, e: int, B: float, caps: np.ndarray | None, v: int) -> np.ndarray:
        """Mask over candidate starts ``s`` for stage j ending at e in variant v."""
        name, PT, EC, al, be, ga = self.variants[v]
        ok = np.ones(s.shape, dtype=bool)
        if np.isfinite(B):
            ok &= PT[s] >= self.end_cost(EC, j)[e] - B - time_tol(B)
        if caps is not None:
            u = be[j] * self.inbuf[s] + ga[j] * self.shared[s] - self.PS[s] - self.held(name, al, j, s)
            rhs = caps[j] - self.PS[e] - self.held(name, al, j, e) - self.outbuf[e]
            ok &= u <= rhs + mem_tol(caps[j])
        return ok

    # -- the exact probe ----------------------------------------------------------------
    def feasible(self, B: float, caps: np.ndarray | None) -> bool:
        """Whether some split has every stage within time ``B`` and memory ``caps``."""
        if self._forward(B, caps, pessimistic=False) is None:
            return False
        if self._forward(B, caps, pessimistic=True) is not None:
            return True
        return self.rows(B, caps) is not None

    def rows(self, B: float, caps: np.ndarray | None) -> list[np.ndarray] | None:
        """Reachability rows R[0..k] (R[j][e]: prefix [0, e) splits into j feasible stages and
        e can still be the j-th cut of a whole feasible split), or None if there is none."""
        Z = self._forward(B, caps, pessimistic=False)
        L = None if Z is None else self._backward(B, caps)
        if Z is None or L is None or any(lo > hi for lo, hi in zip(L, Z)) or L[-1] > self.n:
            return None
        R = np.zeros(self.n + 1, dtype=bool)
        R[0] = True
        out = [R]
        for j in range(self.k):
            R = self._sweep_stage(j, R, L[j], Z[j], max(L[j + 1], j + 1), Z[j + 1], B, caps)
            if R is None:
                return None
            out.append(R)
        return out if out[self.k][self.n] else None

    def _sweep_stage(self, j: int, R: np.ndarray, s0: int, s1: int, e0: int, e1: int, B: float,
                     caps: np.ndarray | None) -> np.ndarray | None:
        """Ends ``e`` in ``[e0, e1]`` reachable by stage j from the starts ``R`` in ``[s0, s1]``."""
        if e0 > e1:
            return None
        E = np.arange(e0, e1 + 1)
        Rw = R[s0:s1 + 1]
        hi = np.minimum(E - 1, s1) - s0
        ok = np.zeros(E.size, dtype=bool)
        cnt = np.concatenate([[0], np.cumsum(Rw)]) if caps is None else None
        S = np.arange(s0, s1 + 1)
        for name, PT, EC, al, be, ga in self.variants:
            if np.isfinite(B):
                lo = np.searchsorted(PT, self.end_cost(EC, j)[E] - B - time_tol(B), side="left")
            else:
                lo = np.zeros(E.size, dtype=np.int64)
            lo = np.maximum(lo, s0) - s0
            okv = lo <= hi
            if caps is None:
                okv &= (cnt[np.clip(hi, -1, Rw.size - 1) + 1] - cnt[np.clip(lo, 0, Rw.size)]) > 0
            else:
                u = np.where(Rw, be[j] * self.inbuf[S] + ga[j] * self.shared[S] - self.PS[S]
                             - self.held(name, al, j, S), np.inf)
                rhs = caps[j] - self.PS[E] - self.held(name, al, j, E) - self.outbuf[E]
                okv &= _range_min(u, lo, hi, okv) <= rhs + mem_tol(caps[j])
            ok |= okv
        if not ok.any():
            return None
        out = np.zeros(self.n + 1, dtype=bool)
        out[E[ok]] = True
        return out

    # -- greedy envelopes ---------------------------------------------------------------
    def _greedy_tables(self) -> tuple:
        """Per variant: start prefix (list), optimistic / pessimistic non-decreasing envelopes
        of the end cost (lists), and the largest boundary memory terms; cached."""
        if self._tables is None or self._tables[0] is not self.variants:
            per = []
            for name, PT, EC, al, be, ga in self.variants:
                if np.any(np.diff(PT) < 0):
                    per = None   # no monotone start cost: the sweep decides everything
                    break
                # per-stage cut rows: the cheapest bounds every stage from below, the dearest from above
                opt = np.minimum.accumulate(EC.min(axis=0)[::-1])[::-1]
                pess = np.maximum.accumulate(EC.max(axis=0))
                bmax = be * float(self.inbuf.max()) + ga * float(self.shared.max())
                dl = self.pending if name == "plain" else np.zeros(self.k)
                per.append((PT.tolist(), opt.tolist(), pess.tolist(), al, bmax, dl, self.prefix(name).tolist()))
            self._tables = (self.variants, per, self.PS.tolist(), self.PA.tolist(),
                            float(self.outbuf.max()), self.PG.tolist())
        return self._tables

    def _forward(self, B: float, caps: np.ndarray | None, pessimistic: bool) -> list[int] | None:
        """Optimistic: upper bounds Z_j on every feasible split's cuts (None: infeasible).
        Pessimistic: the cuts of a split that is truly feasible (None: none found)."""
        _, per, PS, _, obmax, PG = self._greedy_tables()
        n, k = self.n, self.k
        if per is None:
            return None if pessimistic else [0] + [n - (k - 1 - j) for j in range(k)]
        cuts = [0]
        for j in range(k):
            s = cuts[-1]
            reach = s
            for PTl, opt, pess, al, bmax, dl, PA in per:
                a, d = float(al[j]), float(dl[j])
                e = bisect_right(pess if pessimistic else opt, PTl[s] + B + time_tol(B)) - 1 \
                    if np.isfinite(B) else n
                if caps is not None:
                    budget = caps[j] + mem_tol(caps[j]) - ((bmax[j] + obmax) if pessimistic else 0.0)
                    q = PS[s] + a * PA[s] + d * PG[s] + budget
                    e = min(e, s + bisect_right(range(s, n + 1), q,
                                                key=lambda x: PS[x] + a * PA[x] + d * PG[x]) - 1)
                reach = max(reach, e)
            nxt = min(reach, n - (k - 1 - j))
            # a bound need not advance (the true cut may lie below it); a split must
            if nxt <= s if pessimistic else nxt < j + 1:
                return None
            cuts.append(nxt)
        return cuts if cuts[k] == n else None

    def _backward(self, B: float, caps: np.ndarray | None) -> list[int]:
        """Lower bounds L_j on every feasible split's cuts (optimistic, from the right): the
        j-th cut is at least the least start that the optimistic stage j allows for an end at
        L_{j+1} (that least start only grows with the end), and one above the previous cut."""
        _, per, PS, _, _, PG = self._greedy_tables()
        n, k = self.n, self.k
        if per is None:
            return list(range(k)) + [n]
        cuts = [n]
        for j in range(k - 1, -1, -1):
            e = cuts[-1]
            start = n
            for PTl, opt, _, al, _, dl, PA in per:
                a, d = float(al[j]), float(dl[j])
                s = bisect_left(PTl, opt[e] - B - time_tol(B)) if np.isfinite(B) else 0
                if caps is not None:
                    q = PS[e] + a * PA[e] + d * PG[e] - caps[j] - mem_tol(caps[j])
                    s = max(s, bisect_left(range(0, e + 1), q, key=lambda x: PS[x] + a * PA[x] + d * PG[x]))
                start = min(start, s)
            cuts.append(max(start, j))
        cuts = cuts[::-1]
        for j in range(1, k + 1):
            cuts[j] = max(cuts[j], cuts[j - 1] + 1)
        return cuts

    # -- reconstruction -------------------------------------------------------------------
    def reconstruct(self, rows, B, caps) -> tuple[list[tuple[int, int]], list[int]]:
        """A split feasible at B: (bounds, variant index per stage). Among the feasible splits:
        with transfer times or several variants, the smallest sum of stage times; otherwise,
        from the last stage backwards, each stage starts as early as feasible."""
        if np.any(self.cut_time[:, 1:-1] > 0) or len(self.variants) > 1:
            return self._min_sum(rows, B, caps)
        bounds, var = [], []
        e = self.n
        for j in range(self.k - 1, -1, -1):
            s = np.nonzero(rows[j][:e])[0]
            s = s[self.stage_ok(j, s, e, B, caps, 0)]
            if s.size == 0:  # cannot happen if rows came from rows()
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
                    val = dp[s] + self.end_cost(EC, j)[e] - PT[s]
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

    # -- candidate bottlenecks ----------------------------------------------------------
    def candidates_between(self, lo: float, hi: float, limit: int) -> np.ndarray | None:
        """The distinct stage times in ``(lo, hi]`` (widened by rounding slack), sorted; None
        when there are more than ``limit`` of them."""
        lo_w, hi_w = lo - 4 * time_tol(lo), hi + 4 * time_tol(hi)
        E = self.E[1:]
        pieces = []
        total = 0
        for _, PT, ECs, _, _, _ in self.variants:
            for EC in ECs:   # every stage's cut row (a superset of each stage's candidates)
                a = np.searchsorted(PT, EC[E] - hi_w, side="left")
                b = np.minimum(np.searchsorted(PT, EC[E] - lo_w, side="right"), E)
                cnt = np.maximum(b - a, 0)
                total += int(cnt.sum())
                if total > limit:
                    return None
                ends = np.repeat(E, cnt)
                starts = np.repeat(a, cnt) + (np.arange(ends.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
                pieces.append(EC[ends] - PT[starts])
        return np.unique(np.concatenate(pieces)) if pieces else np.zeros(0)

    def max_time(self) -> float:
        return max(float(np.max(EC)) for _, _, EC, _, _, _ in self.variants)


def _cut_rows(cut_time, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct cut-time rows ``(rows, n + 1)`` (ends 0 and n cost nothing) and each stage's
    row: ``cut_time`` None, one row (every stage) or one per stage ``(k, n + 1)``."""
    if cut_time is None:
        return np.zeros((1, n + 1)), np.zeros(k, dtype=np.int64)
    ct = np.array(cut_time, dtype=np.float64)
    if ct.shape == (n + 1,):
        ct = ct[None, :]
    elif ct.shape != (k, n + 1):
        raise ValueError(f"cut_time must have length n + 1 = {n + 1}, or shape (stages, n + 1) = ({k}, {n + 1})")
    ct[:, n] = 0.0
    ct[:, 0] = 0.0
    if ct.shape[0] == 1:
        return ct, np.zeros(k, dtype=np.int64)
    seen: dict[bytes, int] = {}   # a row's bytes -> its index among the distinct rows
    firsts: list[int] = []        # the first stage of each distinct row
    idx = np.empty(k, dtype=np.int64)
    for j, row in enumerate(ct):
        key = row.tobytes()
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(j)
        idx[j] = seen[key]
    return ct[firsts], idx


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
