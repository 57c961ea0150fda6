"""``zb-auto``: a zero-bubble schedule built from measured costs under an in-flight bound.

The Zero Bubble paper (Qi et al., arXiv 2401.10241, section 3) builds its automatic schedule in
two parts: a greedy pass that places each rank's next F, I or W as the clock advances (an I as
soon as its gradient arrives, the critical path; an F while memory allows; a W only to fill a
gap that would otherwise be idle, or when memory forces it), then a refinement (the paper: an
ILP seeded by the greedy). This module keeps that structure and does its own versions:

- :func:`greedy` is an event-driven list scheduler over all ranks at once: it always commits
  the action that can start earliest anywhere, so every start time it uses is exact (the
  simulator's), and it places a W in a gap only when the next input cannot arrive before the W
  ends (a lower bound on the arrival; ``slack`` lets a W run into the gap by a fraction of its
  time). Knobs: I before a ready F or not, and the slack.
- :func:`build_auto` runs the greedy at every knob setting (and with each rank's forwards
  limited to the round trip of its first microbatch, :func:`leads`), adds the handcrafted zb-h1 / zb-h2
  orders where they fit the bound, scores each with :func:`engine.simulate.simulate` (the very
  model the planner uses) over ``steps`` consecutive steps, and then improves the best by a
  local search that moves single W's earlier or later on their rank (first improvement, within
  a time budget): every move is re-simulated, so the result is never worse than its seed.

The result is a :class:`~engine.schedules.Schedule` like any other: ``validate`` checks it and
the runtime runs it. It is deterministic in its arguments (no randomness, no wall-clock
dependence: the local search is bounded by a move count, not by time).

Example::

    >>> from engine.schedules import build_schedule
    >>> s = build_schedule("zb-auto", 4, 8, max_inflight=4, forward_s=1.0, backward_s=2.0,
    ...                    weight_s=1.0)
    >>> max(len(a) for a in s.actions), s.max_inflight
    (24, 4)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Sequence

from engine.schedules import Action, Schedule, _split_backward, register_cost_builder
from engine.simulate import simulate

__all__ = ["greedy", "build_auto", "leads", "KNOBS"]

KNOBS: tuple[tuple[bool, float], ...] = tuple(
    (prefer_i, slack) for prefer_i in (True, False) for slack in (0.0, 0.5, 1.0))
"""The greedy's settings tried: (run a ready I before a ready F, W slack as a fraction of W)."""

_INF = math.inf


class _State:
    """The greedy's bookkeeping: counts of F / I / W placed per rank, finish times, clocks."""

    def __init__(self, p: int, m: int) -> None:
        self.nf, self.ni, self.nw = [0] * p, [0] * p, [0] * p
        self.end_f = [[_INF] * m for _ in range(p)]
        self.end_i = [[_INF] * m for _ in range(p)]
        self.free = [0.0] * p
        self.acts: list[list[Action]] = [[] for _ in range(p)]


def greedy(p: int, m: int, cap: int | Sequence[int], f: Sequence[float], i: Sequence[float], w: Sequence[float],
           c: Sequence[float], prefer_i: bool = True, slack: float = 0.0,
           lead: Sequence[int] | None = None, reserve: int = 0,
           hold: float = 1.0, cool: float | None = None,
           pending: Sequence[int] | None = None) -> list[list[Action]]:
    """One rank per chunk (chunk r on rank r); per-rank action lists for ``m`` microbatches that
    never hold more than ``cap`` microbatches (one bound, or one per rank; an F holds one until
    its W).

    ``f``, ``i``, ``w``: per-chunk forward, input-gradient and weight-gradient times; ``c``: per
    boundary transfer times (``p - 1``); ``lead``: per rank, the most forwards it may run ahead
    of its input gradients (None: only ``cap`` limits them); ``reserve``: weight gradients a rank
    keeps pending for its cool-down (a W fills an earlier gap only beyond them, or when memory
    needs it); ``hold``: the part of a microbatch's memory kept from its I to its W (1: all of
    it, as pipeshard's runtime keeps the saved tensors until W); ``cool``: the W slack once the
    rank has run its last forward (None: ``slack``); ``pending``: per rank, the most microbatches
    whose I has run and W not yet (None: no bound beyond ``cap``).

    >>> [" ".join(map(str, a)) for a in greedy(2, 2, 2, [1, 1], [1, 1], [1, 1], [0])]
    ['0F0 0F1 0I0 0W0 0I1 0W1', '1F0 1I0 1F1 1I1 1W0 1W1']
    """
    st = _State(p, m)
    todo = 3 * m * p
    lead = list(lead) if lead is not None else [m] * p
    caps = _caps(cap, p)
    knobs = (prefer_i, slack)
    extra = (reserve, hold, cool)
    pend = list(pending) if pending is not None else [m] * p
    decisions = [_decide(st, r, p, m, caps[r], f, i, w, c, *knobs, lead[r], *extra, pend[r])
                 for r in range(p)]
    while todo:
        r = min(range(p), key=lambda q: (decisions[q][0], q))
        start, kind = decisions[r]
        if start == _INF:   # no rank knows when its next input comes: the earliest W goes
            r = min((q for q in range(p) if st.nw[q] < st.ni[q]), key=lambda q: (st.free[q], q))
            start, kind = st.free[r], "W"
        _commit(st, r, kind, start, f, i, w)
        todo -= 1
        for q in (r - 1, r, r + 1):
            if 0 <= q < p:
                decisions[q] = _decide(st, q, p, m, caps[q], f, i, w, c, *knobs, lead[q], *extra, pend[q])
    return st.acts


def _ready_i(st: _State, r: int, p: int, c: Sequence[float]) -> float:
    k = st.ni[r]
    if k >= st.nf[r]:
        return _INF
    down = 0.0 if r == p - 1 else st.end_i[r + 1][k] + c[r]
    return max(st.end_f[r][k], down)


def _ready_f(st: _State, r: int, m: int, c: Sequence[float]) -> float:
    k = st.nf[r]
    if k >= m:
        return _INF
    return 0.0 if r == 0 else st.end_f[r - 1][k] + c[r - 1]


def _arrival_bound(st: _State, r: int, p: int, m: int, f: Sequence[float], i: Sequence[float],
                   c: Sequence[float], t_i: float, t_f: float) -> float:
    """A lower bound on when rank ``r``'s next F or I input can be there."""
    lb_f = t_f
    if t_f == _INF and 0 < r and st.nf[r] < m:
        lb_f = st.free[r - 1] + f[r - 1] + c[r - 1]
    lb_i = t_i
    if t_i == _INF and st.ni[r] < st.nf[r] and r < p - 1:
        lb_i = st.free[r + 1] + i[r + 1] + c[r]
    return min(lb_f, lb_i)


def _decide(st: _State, r: int, p: int, m: int, cap: int, f: Sequence[float], i: Sequence[float],
            w: Sequence[float], c: Sequence[float], prefer_i: bool, slack: float,
            lead: int, reserve: int = 0, hold: float = 1.0,
            cool: float | None = None, pend: int = 1 << 30) -> tuple[float, str]:
    """(start, kind) of rank ``r``'s next action, or (inf, "") when it cannot tell yet."""
    t = st.free[r]
    has_w = st.nw[r] < st.ni[r]
    if has_w and st.ni[r] - st.nw[r] >= pend:
        return t, "W"   # as many pending weight gradients as allowed: none more before a W
    if st.ni[r] == m and st.nf[r] == m:
        return (t, "W") if has_w else (_INF, "")
    t_i = _ready_i(st, r, p, c)
    t_f_raw = _ready_f(st, r, m, c)
    held = st.nf[r] - (1.0 - hold) * st.ni[r] - hold * st.nw[r]
    t_f = t_f_raw if held + 1.0 <= cap + 1e-9 and st.nf[r] - st.ni[r] < lead else _INF
    if t_i <= t and (prefer_i or t_f > t):
        return t, "I"
    if t_f <= t:
        return t, "F"
    if t_i <= t:
        return t, "I"
    if has_w:
        if t_f == _INF and t_f_raw < t_i and st.nf[r] - st.ni[r] < lead:
            return t, "W"   # memory: the next F needs a W first
        lb = _arrival_bound(st, r, p, m, f, i, c, t_i, t_f)
        spare = st.ni[r] - st.nw[r] > reserve or st.nf[r] == m
        if spare and t + w[r] <= lb + (slack if st.nf[r] < m or cool is None else cool) * w[r]:
            return t, "W"
    nxt = min(t_i, t_f)
    if nxt == _INF:
        return _INF, ""
    return nxt, ("I" if t_i <= t_f else "F")


def _commit(st: _State, r: int, kind: str, start: float, f: Sequence[float], i: Sequence[float],
            w: Sequence[float]) -> None:
    if kind == "F":
        k = st.nf[r]
        st.end_f[r][k] = st.free[r] = start + f[r]
        st.nf[r] += 1
    elif kind == "I":
        k = st.ni[r]
        st.end_i[r][k] = st.free[r] = start + i[r]
        st.ni[r] += 1
    else:
        k = st.nw[r]
        st.free[r] = start + w[r]
        st.nw[r] += 1
    st.acts[r].append(Action(kind, r, k))


def _caps(cap: int | Sequence[int], p: int) -> list[int]:
    return [int(cap)] * p if isinstance(cap, (int, float)) else [int(x) for x in cap]


def _inflight_ok(acts: list[Action], cap: int, hold: float = 1.0, pend: int | None = None) -> bool:
    """Whether a rank's list keeps within ``cap`` microbatches' memory (``hold``: see greedy)
    and ``pend`` pending weight gradients."""
    held, waiting = 0.0, 0
    for a in acts:
        held += {"F": 1.0, "I": hold - 1.0, "W": -hold}.get(a.kind, -1.0)
        waiting += {"I": 1, "W": -1}.get(a.kind, 0)
        if held > cap + 1e-9 or (pend is not None and waiting > pend):
            return False
    return True


def _local_search(actions: list[list[Action]], caps: Sequence[int], score, moves: int,
                  hold: float = 1.0, pend: Sequence[int | None] | None = None
                  ) -> tuple[list[list[Action]], float]:
    """Move single W's one place earlier or later on their rank while the score improves
    (first improvement; at most ``moves`` evaluations). A move keeps each W after its I and
    the in-flight bound; ``score`` returns inf for an order that cannot run."""
    best = score(actions)
    tried = 0
    improved = True
    while improved and tried < moves:
        improved = False
        for r, acts in enumerate(actions):
            for j, a in enumerate(acts):
                if a.kind != "W":
                    continue
                for d in (-1, 1):
                    k = j + d
                    if not 0 <= k < len(acts) or acts[k].kind == "W":
                        continue
                    if d < 0 and acts[k].kind == "I" and acts[k].microbatch == a.microbatch:
                        continue
                    trial = list(acts)
                    trial[j], trial[k] = trial[k], trial[j]
                    if not _inflight_ok(trial, caps[r], hold, None if pend is None else pend[r]):
                        continue
                    cand = actions[:r] + [trial] + actions[r + 1:]
                    tried += 1
                    got = score(cand)
                    if got < best - 1e-12:
                        actions, best, improved = cand, got, True
                        break
                    if tried >= moves:
                        return actions, best
                if improved:
                    break
            if improved:
                break
    return actions, best


def build_auto(p: int, m: int, cap: int | Sequence[int], f: Sequence[float], b: Sequence[float],
               w: Sequence[float], c: Sequence[float], steps: int = 1,
               moves: int = 200, hold: float = 1.0,
               pending: Sequence[int] | None = None) -> list[list[Action]]:
    """The best per-rank order found for these costs (see the module docstring).

    ``b`` is the full backward (``i = b - w``); ``steps``: consecutive steps the score
    simulates (1: the optimizer step synchronises the ranks; more: a rank-local step, so the
    steady state counts); ``moves``: the local search's evaluation budget; ``hold``: the part of
    a microbatch's memory kept from its I to its W (:func:`greedy`); ``pending``: per rank, the
    most weight gradients pending (:func:`greedy`).
    """
    i = [x - y for x, y in zip(b, w)]

    def score(actions: list[list[Action]], validated: bool = False) -> float:
        s = Schedule("zb-auto", p, m, 1, actions, "loop", max(caps))
        try:   # a local-search move only moves a W, so a validated seed's moves need no validator
            return simulate(s, f, b, w, c, steps=steps, validate_schedule=not validated).step_s
        except ValueError:   # an order the validator rejects, or one that deadlocks over steps
            return _INF

    caps = _caps(cap, p)
    seeds = [greedy(p, m, caps, f, i, w, c, prefer_i, slack, hold=hold, pending=pending)
             for prefer_i, slack in KNOBS]
    for extra in (0, 1):   # forwards limited to the round trip: the rest of the bound defers W's
        lead = [min(x, k) for x, k in zip(leads(p, f, i, c, extra), caps)]
        for reserve in sorted({0, p // 2, p}):
            seeds += [greedy(p, m, caps, f, i, w, c, True, slack, lead, reserve, hold, cool, pending)
                      for slack in (0.0, 0.5) for cool in (None, 1.0)]
    x = max(min(min(caps) - p, m - p), 0)   # the handcrafted orders, where the bound allows them
    seeds.append([_split_backward(r, m, min(m, p - r), r) for r in range(p)])           # zb-h1
    seeds.append([_split_backward(r, m, min(m, p - r + min(x, p - 1 - r)),              # zb-h2
                                  r + x - min(x, p - 1 - r)) for r in range(p)])
    pend = list(pending) if pending is not None else [None] * p
    seeds = [a for a in seeds if all(_inflight_ok(acts, k, hold, g) for acts, k, g in zip(a, caps, pend))]
    scored = sorted(((score(a), n, a) for n, a in enumerate(seeds)), key=lambda t: t[:2])
    best = scored[0][2]
    if moves > 0 and p * m <= 512 and scored[0][0] < _INF:
        best, _ = _local_search(best, caps, partial(score, validated=True), moves, hold, pend)
    return best


def leads(p: int, f: Sequence[float], i: Sequence[float], c: Sequence[float], extra: int) -> list[int]:
    """Per rank, the forwards that fill the wait for its first input gradient (the round trip
    of one microbatch through the later ranks), plus ``extra``.

    >>> leads(4, [1.0] * 4, [1.0] * 4, [0.0] * 3, 0)
    [7, 5, 3, 1]
    """
    out = []
    for r in range(p):
        trip = sum(f[q] + i[q] for q in range(r + 1, p)) + 2 * sum(c[r:]) + i[r]
        out.append(1 + max(0, math.ceil(trip / f[r] - 1e-9) - 1) + extra if f[r] > 0 else p + extra)
    return out


register_cost_builder("zb-auto", build_auto)
